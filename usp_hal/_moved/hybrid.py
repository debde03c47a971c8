"""Former path: the module is :mod:`usp_hal.mixers.head_parallel` (this name is the same module object)."""
import sys

from usp_hal.mixers import head_parallel as _module

sys.modules[__name__] = _module
