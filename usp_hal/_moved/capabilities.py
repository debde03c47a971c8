"""Former path: the module is :mod:`usp_hal.dispatch.capabilities` (this name is the same module object)."""
import sys

from usp_hal.dispatch import capabilities as _module

sys.modules[__name__] = _module
