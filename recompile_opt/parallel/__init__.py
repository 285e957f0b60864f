"""Tensor and sequence parallelism (issue 22, in progress; the plan: docs/parallel-design.md). Built so
far: the transitions' autograd rules (:mod:`recompile_opt.parallel.collectives`) and the layout found
from the graph (:func:`recompile_opt.parallel.layout.find_layout`: which linears are column- and
row-parallel, which modules run on sequence shards, and why), and its parameters placed as DTensors
(:func:`recompile_opt.parallel.module.distribute_parameters`), and each rank's forward for tensor and
sequence parallelism (:mod:`recompile_opt.parallel.rewrite`; dropout off). Not yet: dropout's masks on
shards, the planner's view of the collectives, ``recompile_opt.parallelize``."""
