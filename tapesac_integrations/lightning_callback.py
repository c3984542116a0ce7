"""Deprecated: ``tapesac_lightning.lightning_callback``, under its old path (see the package's docstring)."""

import sys

from tapesac_lightning import lightning_callback

# The import system returns what sys.modules holds once this file has run, so the old path
# yields the module itself: its classes keep one identity under both names.
sys.modules[__name__] = lightning_callback
