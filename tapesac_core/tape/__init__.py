"""The tape and what makes and reads it: the recorded graph (``tape``), value identity and holding
(``values``, ``holding``), recording at the dispatcher (``recorder``), one block's state
(``block``), replay in backward (``replay``, ``verify``), steady state (``signature``,
``steady``, ``steady_cache``, ``size_templates``, ``draws``, ``recompute``), op rules (``ops``,
``kernels``, ``lifetimes``).

Imports the base modules, ``plan`` and ``measure``; never ``blocks``, ``control`` or ``report``.
"""
