"""The old import path of :mod:`usp_hal.integrations.training.grads`, kept working: importing this module gives
that module itself (the same object in ``sys.modules``), so its functions, its state and any
attribute set or monkeypatched through this name are the new module's."""
import sys
from typing import TYPE_CHECKING

from usp_hal.integrations.training import grads as _module

if TYPE_CHECKING:       # for type checkers, which do not follow the sys.modules entry
    from usp_hal.integrations.training.grads import *  # noqa: F401,F403

sys.modules[__name__] = _module
