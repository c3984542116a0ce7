"""The controller and what it decides with: the step's life cycle (``controller``), its schedule,
buckets, budget, ranks and plan cache, region profiles (``profile``, ``profiling``), measured
step times and the solver's entry points (``solve``, ``step_frontier``), and the step report.

Imports every layer below it: base, ``plan``, ``measure``, ``tape`` and ``blocks``.
"""
