"""yunchang compatibility.

* :mod:`usp_hal.compat.yunchang`: yunchang 0.6.4's top-level functions and tables over
  usp-hal's attention (re-exported here, so ``usp_hal.compat.X`` works as before);
  :data:`YUNCHANG_NAMES` lists the ones ``usp_hal`` resolves without listing them in its
  ``__all__``.
* :mod:`usp_hal.compat.extract`: yunchang's ``EXTRACT_FUNC_DICT`` (``usp_hal.EXTRACT_FUNC_DICT``)
  over usp-hal's layouts, following the default mesh's placement;
* :mod:`usp_hal.compat.alias`: :func:`install_yunchang_alias` makes ``import yunchang`` (and the
  submodules xDiT and other yunchang consumers import) resolve to usp-hal, on request only.
"""
from __future__ import annotations

from .yunchang import *  # noqa: F401,F403
from .yunchang import YUNCHANG_NAMES
from .yunchang import __all__ as _names

__all__ = ["YUNCHANG_NAMES", *_names]
