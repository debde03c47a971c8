"""Former path: the module is :mod:`usp_hal.parallel.ulysses` (this name is the same module object)."""
import sys

from usp_hal.parallel import ulysses as _module

sys.modules[__name__] = _module
