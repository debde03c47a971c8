"""Former path: the module is :mod:`usp_hal.parallel.comm` (this name is the same module object)."""
import sys

from usp_hal.parallel import comm as _module

sys.modules[__name__] = _module
