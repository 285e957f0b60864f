"""Tensor and sequence parallelism (issue 22, in progress): the collectives' autograd rules so far
(:mod:`recompile_opt.parallel.collectives`). The plan for the rest is in docs/parallel-design.md."""
