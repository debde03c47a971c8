"""Former path: the module is :mod:`usp_hal.dispatch.reference` (this name is the same module object)."""
import sys

from usp_hal.dispatch import reference as _module

sys.modules[__name__] = _module
