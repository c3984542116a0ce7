"""Checkpointed blocks as users meet them: ``checkpoint`` and ``record`` (``running``), wrapping
modules (``wrapping``), the plan and trace scopes blocks run under (``plan_scope``,
``trace_scope``), per-module settings (``block_settings``) and the setups refused (``refusals``).

Imports the base modules, ``plan``, ``measure`` and ``tape``.
"""
