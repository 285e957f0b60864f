"""The planner: from a :class:`~recompile_opt.planner.problem.Problem` (plain data keyed by node name)
to the set of values to keep and to recompute.

``problem`` the data; ``ilp`` the MILP (PuLP: HiGHS or CBC); ``search`` the planning around it (budget
ranges, the least-peak search, ``peak_memory``); ``policies`` the fixed baselines; ``blocks`` repeated
transformer blocks solved once; ``budget_split`` one byte budget over several graphs.

May import: ``recompile_opt.options`` and ``recompile_opt.plan`` (the option and result types), PuLP.
Never torch: a plan is decided on plain data, so every solver and policy is testable by hand, and a
peak is priced through the ``Simulate`` callable the caller passes in (``recompile_opt.costs``).
"""
