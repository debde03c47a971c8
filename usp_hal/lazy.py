"""The submodules of a layer's package as attributes, imported on first use.

Each layer's ``__init__`` sets ``__getattr__ = submodules(__name__)``, so that after a plain
``import usp_hal``, ``usp_hal.parallel.comm`` (say) resolves without importing every module of
every layer up front.  A leaf: it imports nothing of the package.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def submodules(package: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``name`` is its submodule ``package.name``; a
    name that is no submodule raises AttributeError (so ``hasattr`` and ``getattr(..., default)``
    behave), while an import error inside an existing submodule propagates."""
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
    return __getattr__
