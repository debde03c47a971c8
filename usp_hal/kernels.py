"""``from usp_hal.kernels import AttnType``: where yunchang 0.6.4 keeps its enum
(yunchang/kernels/__init__.py), so code written for yunchang imports it with only the package
name changed.  usp-hal's kernels are backends (:mod:`usp_hal.dispatch.registry`); yunchang's kernel
functions (``flash_attn_forward`` and the like) have no counterpart here."""
from __future__ import annotations

from .dispatch.registry import AttnType

__all__ = ["AttnType"]
