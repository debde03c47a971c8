"""Former path: the module is :mod:`usp_hal.pipeline.spec` (this name is the same module object)."""
import sys

from usp_hal.pipeline import spec as _module

sys.modules[__name__] = _module
