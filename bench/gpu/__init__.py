"""The pieces of ``bench/gpu_check.py``, one concept each (the script keeps the CLI and ``main``).

* :mod:`.cases`   -- what is checked: the models, the backend options, the strategies; cases as plain dicts.
* :mod:`.models`  -- building a case's model and batch on its device (demo, tiny, Hugging Face, the GPU GPT).
* :mod:`.numerics` -- one step against eager: loss and gradient deviations, the measured peak.
* :mod:`.timing`  -- a strategy's first call, step time, peak and loss; a profile of its kernels.
* :mod:`.worker`  -- the child process: one case in, one JSON line out.
* :mod:`.driver`  -- fresh processes per case, a pool, per-case timeouts, cases that need earlier results.
* :mod:`.report`  -- the markdown: header, one table per part, targets.

Every case runs in its own interpreter (Dynamo, Inductor and the allocator keep global state), as in
``bench/comparison``; the driver imports no torch.
"""
