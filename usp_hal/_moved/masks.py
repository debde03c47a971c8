"""Former path: the module is :mod:`usp_hal.sequence.masks` (this name is the same module object)."""
import sys

from usp_hal.sequence import masks as _module

sys.modules[__name__] = _module
