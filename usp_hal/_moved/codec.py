"""Former path: the module is :mod:`usp_hal.parallel.codec` (this name is the same module object)."""
import sys

from usp_hal.parallel import codec as _module

sys.modules[__name__] = _module
