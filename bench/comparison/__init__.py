"""The pieces of ``bench/compare.py``, one concept each (the script itself keeps the CLI and ``main``).

* :mod:`.config`     -- model sizes, the (model, size) groups and the flags a worker is given.
* :mod:`.strategies` -- what each strategy is, and how a worker builds, checkpoints or compiles it.
* :mod:`.flops`      -- FLOP counting: eager under ``FlopCounterMode``, compiled graphs in a post-grad pass.
* :mod:`.joblock`    -- the shared/exclusive file lock that keeps timed sections alone (``--jobs N``).
* :mod:`.worker`     -- the measured child process: one strategy, one JSON line of figures.
* :mod:`.runner`     -- the driver's side: fresh processes, private caches, shuffled interleaved rounds.
* :mod:`.report`     -- aggregation of the runs into rows; markdown (headline and full tables) and CSV.
* :mod:`.pareto`     -- the dominance check on the measured (peak, step time) plane.

Why a package beside the script rather than one file: the worker, the driver and the report share
nothing but plain dicts (a worker's JSON line, a row), so each reads and tests on its own.  Every module
imports torch lazily, inside the functions that need it, so listing and validating strategies needs
no torch and a worker does its heavy imports only after taking the job lock.
"""
