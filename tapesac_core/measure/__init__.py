"""Measuring a step: memory meters (``memory``), op timers (``timing``), the sample step's
timeline of allocations (``timeline``) and step times (``step_time``).

Imports the package's base modules and ``plan`` only: recording and the controller both use it.
"""
