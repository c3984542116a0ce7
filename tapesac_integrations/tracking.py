"""Deprecated: ``tapesac_lightning.tracking``, under its old path (see the package's docstring)."""

import sys

from tapesac_lightning import tracking

# The import system returns what sys.modules holds once this file has run, so the old path
# yields the module itself: its classes keep one identity under both names.
sys.modules[__name__] = tracking
