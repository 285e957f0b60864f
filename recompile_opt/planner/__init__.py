"""The planner: from a :class:`~recompile_opt.planner.problem.Problem` (plain data keyed by node name)
to the set of values to keep and to recompute.

``problem`` the data; ``ilp`` the MILP (PuLP: HiGHS or CBC); ``search`` from options to a Plan (budget
resolution, fixed policies, infeasible limits, the plan's description); ``least_peak`` the searches
around the ILP whose plans are simulated (a fraction's 0.0 end, ``peak_memory``); ``solving`` what
both share (one solve with block reduction, candidates, the greedy fallback); ``policies`` the fixed
baselines; ``blocks`` repeated transformer blocks solved once; ``budget_split`` one byte budget over
several graphs.

May import: ``recompile_opt.options`` and ``recompile_opt.plan`` (the option and result types), PuLP.
Never torch: a plan is decided on plain data, so every solver and policy is testable by hand, and a
peak is priced through the ``Simulate`` callable the caller passes in (``recompile_opt.costs``).
"""
