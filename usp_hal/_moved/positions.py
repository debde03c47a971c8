"""Former path: the module is :mod:`usp_hal.sequence.positions` (this name is the same module object)."""
import sys

from usp_hal.sequence import positions as _module

sys.modules[__name__] = _module
