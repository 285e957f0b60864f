"""Graph passes over AOTAutograd's joint forward+backward FX graph, installed as ``recompile_opt.passes``.

``joint_graph`` reads the joint graph into the planner's plain-data Problem (pricing nodes with
``recompile_opt.costs``); ``partition`` splits it into the forward and backward graphs a plan asks for.
Transformations of the graph itself (sequence parallelism, sequence chunking) land here too.

May import: torch, ``recompile_opt._torch_internals``, ``recompile_opt.costs``, and the planner's
``problem`` and ``policies`` (the data it builds, the block of a module path).
"""
