"""usp-hal: Unified Sequence Parallel attention over a registry of kernel backends.

``import usp_hal`` imports torch and nothing else: no kernel package, no device init.
"""
from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

# the modules' former paths resolve from _moved/, with a DeprecationWarning (see its docstring)
__path__.append(os.path.join(os.path.dirname(__file__), "_moved"))

from .dispatch.backend import AttentionBackend, BackendUnavailable  # noqa: E402
from .dispatch.capabilities import AttnRequest, Availability, KernelCall, Package  # noqa: E402
from .dispatch.registry import (  # noqa: E402
    REGISTRY,
    AttnType,
    get_backend,
    list_backends,
    register_backend,
    select_backend,
)

_LAZY = {
    "init_sequence_parallel": "parallel.mesh",
    "set_seq_parallel_pg": "parallel.mesh",
    "SequenceParallelMesh": "parallel.mesh",
    "get_default_mesh": "parallel.mesh",
    "LongContextAttention": "attention",
    "AsyncLongContextAttention": "attention",
    "async_qkv_attention": "overlap",
    "LongContextAttentionQKVPacked": "attention",
    "UlyssesAttention": "attention",
    "RingAttention": "attention",
    "shard": "parallel.sharding",
    "unshard": "parallel.sharding",
    "EXTRACT_FUNC_DICT": "compat.extract",
    "plan": "planning.planner",
    "ShardedKVCache": "serving",
    "head_parallel": "mixers.head_parallel",
}

# yunchang 0.6.4's other top-level names: they resolve here (``from usp_hal import
# ring_flash_attn_func`` works, as the drop-in promises) but are not usp-hal's own API, so they
# stay out of ``__all__``; usp_hal.compat.YUNCHANG_NAMES lists them.
_YUNCHANG = {name: "compat" for name in (
    "RING_IMPL_DICT", "RING_IMPL_QKVPACKED_DICT", "basic_extract_local", "zigzag_extract_local",
    "stripe_extract_local",
    "ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func",
    "ring_flash_attn_varlen_qkvpacked_func", "zigzag_ring_flash_attn_func",
    "zigzag_ring_flash_attn_kvpacked_func", "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func", "zigzag_ring_flash_attn_varlen_qkvpacked_func",
    "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func",
    "ring_pytorch_attn_func", "ring_flashinfer_attn_func", "ring_flashinfer_attn_kvpacked_func",
    "ring_flashinfer_attn_qkvpacked_func", "ring_npu_flash_attn_func")}

__all__ = [
    "AttentionBackend", "BackendUnavailable", "AttnRequest", "Availability", "KernelCall", "Package",
    "REGISTRY", "AttnType", "get_backend", "list_backends", "register_backend", "select_backend",
    *_LAZY,
]


_SUBMODULES = ("attention", "compat", "kernels", "overlap", "serving", "sequence", "dispatch", "parallel", "pipeline",
               "mixers", "planning", "integrations")


def __dir__():
    return sorted({*globals(), *_LAZY, *_YUNCHANG, *_SUBMODULES})


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY or name in _YUNCHANG:
        mod = _LAZY.get(name) or _YUNCHANG[name]
        return getattr(importlib.import_module(f".{mod}", __name__), name)
    if not name.startswith("_"):
        from ._moved import MOVED, SPLIT
        if f"{__name__}.{name}" in MOVED or f"{__name__}.{name}" in SPLIT:     # a former path: it warns
            return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'usp_hal' has no attribute {name!r}")
