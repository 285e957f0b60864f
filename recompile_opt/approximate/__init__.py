"""Approximate backward (issue 24): values kept for the backward in fewer bytes than exact, for a small,
measured gradient error. ``few_bit``: an activation's input kept as a 1-4-bit code of where it falls in
a piecewise-constant approximation of the derivative (Novikov et al. 2022); ``tables``: those
approximations, optimised here and stored as data."""
