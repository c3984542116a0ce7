"""The controller and what it decides with: the step's life cycle (``controller``, ``open_step``),
its schedule, buckets, budget, ranks and plan cache, solving and repricing plans (``solving``,
``repricing``), the state checkpoints keep (``saved_state``), the must-only memory model
(``memory_model``), region profiles (``profile``, ``profiling``), measured step times and the
solver's entry points (``solve``, ``step_frontier``), and the step report.

Imports every layer below it: base, ``plan``, ``measure``, ``tape`` and ``blocks``.
"""
