"""What a plan costs on a graph: time and memory, predicted and measured.

``cost_model`` bytes per storage and recompute time per node (a roofline over FLOPs and traffic);
``kernels`` the kernels Inductor will make of the nodes; ``peak`` a step's peak simulated over those
kernels; ``simulator`` partitions a plan and simulates it (what the planner's searches call);
``inductor_peak`` the exact peak walked in the code Inductor generates; ``measure`` real peaks and
saved tensors of a step, to hold the predictions to.

May import: torch, ``recompile_opt._torch_internals``, ``recompile_opt.passes.partition`` (the
simulator prices the graphs a plan partitions into). Never the planner: costs are facts about graphs.
"""
