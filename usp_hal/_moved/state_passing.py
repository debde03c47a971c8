"""Former path: the module is :mod:`usp_hal.mixers.state_passing` (this name is the same module object)."""
import sys

from usp_hal.mixers import state_passing as _module

sys.modules[__name__] = _module
