"""Former path: the module is :mod:`usp_hal.parallel.ring` (this name is the same module object)."""
import sys

from usp_hal.parallel import ring as _module

sys.modules[__name__] = _module
