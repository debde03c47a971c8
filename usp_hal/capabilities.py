"""What a backend can do (declared as data) and what one attention call asks for.

A backend class declares its capabilities as class attributes (see
:class:`usp_hal.backend.AttentionBackend`).  One call is described by an
:class:`AttnRequest`.  :func:`not_supported_reasons` compares the two and returns
human-readable reasons; an empty list means "supported".  The same function serves
dispatch, the probe CLI, the docs table, the test parametrisation and the CI matrices, so
every rule is written exactly once, here.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .backend import AttentionBackend

DTYPE_NAMES = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
}
NAME_TO_DTYPE = {v: k for k, v in DTYPE_NAMES.items()}
NAME_TO_DTYPE.update({"float64": torch.float64, "float32": torch.float32,
                      "float16": torch.float16, "bfloat16": torch.bfloat16})


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def parse_dtype(name) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return NAME_TO_DTYPE[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid: {sorted(set(DTYPE_NAMES.values()))}") from None


@dataclass(frozen=True)
class AttnRequest:
    """Everything about one attention call that decides whether a backend can serve it.

    ``head_dim``/``num_heads`` describe what the *kernel* sees (after the Ulysses split).
    ``ring`` is True when the call is one block of a ring (the kernel must return an lse
    that is merged across blocks), ``key_offset`` when window/alibi must be applied with
    a position offset between the query and key block (ring blocks off the diagonal).
    """

    dtype: torch.dtype = torch.float32
    device_type: str = "cpu"
    head_dim: int = 64
    head_dim_v: Optional[int] = None
    num_heads: int = 1
    num_kv_heads: Optional[int] = None
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    dropout_p: float = 0.0
    needs_grad: bool = False
    needs_lse: bool = False
    deterministic: bool = False
    key_offset: bool = False
    compute_capability: Optional[tuple] = None
    # packed documents (cu_seqlens): the core cuts every kernel call at document boundaries
    varlen: bool = False

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def has_window(self) -> bool:
        return tuple(self.window) != (-1, -1)

    def with_(self, **kw) -> "AttnRequest":
        return replace(self, **kw)

    def describe(self) -> str:
        parts = [
            f"dtype={dtype_name(self.dtype)}",
            f"device={self.device_type}",
            f"head_dim={self.head_dim}" + (f"/{self.head_dim_v}" if self.head_dim_v not in (None, self.head_dim) else ""),
            f"heads={self.num_heads}/{self.kv_heads}",
            f"causal={self.causal}",
        ]
        if self.has_window:
            parts.append(f"window={tuple(self.window)}")
        if self.softcap:
            parts.append(f"softcap={self.softcap}")
        if self.alibi:
            parts.append("alibi")
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p}")
        parts.append(f"grad={self.needs_grad}")
        parts.append(f"lse={self.needs_lse}")
        if self.deterministic:
            parts.append("deterministic")
        if self.varlen:
            parts.append("varlen")
        return ", ".join(parts)


@dataclass(frozen=True)
class Package:
    """A distribution a backend needs: checked with importlib.metadata and find_spec only."""

    dist: str                      # distribution name for importlib.metadata
    module: str                    # top-level module name that is safe for find_spec
    min_version: Optional[str] = None
    alt_dists: tuple = ()          # other distribution names that provide the same module
    extra: Optional[str] = None    # the usp-hal extra that installs it


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""
    version: Optional[str] = None
    details: dict = field(default_factory=dict)

    def __bool__(self) -> bool:  # pragma: no cover - convenience
        return self.ok


def not_supported_reasons(backend: "type[AttentionBackend] | AttentionBackend", req: AttnRequest) -> list:
    """Every reason the declared capabilities of ``backend`` refuse ``req``."""
    b = backend
    reasons = []
    if req.device_type not in b.SUPPORTED_DEVICES:
        reasons.append(f"device={req.device_type} (supported: {', '.join(sorted(b.SUPPORTED_DEVICES))})")
    if req.dtype not in b.SUPPORTED_DTYPES:
        reasons.append(f"dtype={dtype_name(req.dtype)} (supported: {', '.join(dtype_name(d) for d in _sorted_dtypes(b.SUPPORTED_DTYPES))})")
    if req.head_dim < b.HEAD_DIM_MIN or (b.HEAD_DIM_MAX is not None and req.head_dim > b.HEAD_DIM_MAX):
        hi = b.HEAD_DIM_MAX if b.HEAD_DIM_MAX is not None else "any"
        reasons.append(f"head_dim={req.head_dim} (supported: {b.HEAD_DIM_MIN}..{hi})")
    if b.HEAD_DIM_MULTIPLE > 1 and req.head_dim % b.HEAD_DIM_MULTIPLE:
        reasons.append(f"head_dim={req.head_dim} is not a multiple of {b.HEAD_DIM_MULTIPLE}")
    if req.v_dim != req.head_dim and not b.SUPPORTS_DIFFERENT_V_DIM:
        reasons.append(f"value head_dim {req.v_dim} differs from query head_dim {req.head_dim}")
    if req.kv_heads != req.num_heads:
        if not b.SUPPORTS_GQA:
            reasons.append(f"GQA/MQA (heads={req.num_heads}, kv_heads={req.kv_heads}) not supported")
        elif req.kv_heads <= 0 or req.num_heads % req.kv_heads:
            reasons.append(f"heads={req.num_heads} is not a multiple of kv_heads={req.kv_heads}")
    if req.causal and not b.SUPPORTS_CAUSAL:
        reasons.append("causal masking not supported")
    if req.has_window and not b.SUPPORTS_WINDOW:
        reasons.append(f"sliding window {tuple(req.window)} not supported")
    if req.softcap and not b.SUPPORTS_SOFTCAP:
        reasons.append(f"softcap={req.softcap} not supported")
    if req.alibi and not b.SUPPORTS_ALIBI:
        reasons.append("alibi_slopes not supported")
    if req.dropout_p and not b.SUPPORTS_DROPOUT:
        reasons.append(f"dropout_p={req.dropout_p} not supported")
    if req.key_offset and (req.has_window or req.alibi) and not b.SUPPORTS_KEY_OFFSET:
        reasons.append("window/alibi across ring blocks needs position offsets the kernel cannot take "
                       "(use ring_degree=1, or the sdpa backend)")
    if req.needs_lse and not b.RETURNS_LSE:
        reasons.append("does not return a log-sum-exp (needed for ring degree > 1 and return_attn_probs)")
    if req.needs_grad and not b.HAS_BACKWARD:
        reasons.append("forward-only kernel: no backward")
    if req.deterministic and req.needs_grad and not (b.IS_DETERMINISTIC or b.SUPPORTS_DETERMINISTIC):
        reasons.append("backward is not deterministic")
    if req.varlen and not getattr(b, "SUPPORTS_VARLEN", True):
        reasons.append("packed documents (cu_seqlens) not supported: the kernel cannot take the per-document "
                       "calls of the block plan; call it per document, or use a backend that declares SUPPORTS_VARLEN")
    mincc = b.MIN_COMPUTE_CAPABILITY.get(req.device_type) if b.MIN_COMPUTE_CAPABILITY else None
    if mincc is not None and req.compute_capability is not None and tuple(req.compute_capability) < tuple(mincc):
        reasons.append(f"needs compute capability >= {mincc[0]}.{mincc[1]}, found "
                       f"{req.compute_capability[0]}.{req.compute_capability[1]}")
    reasons.extend(b.extra_reasons(req))
    return reasons


_DTYPE_ORDER = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _sorted_dtypes(dtypes) -> list:
    return sorted(dtypes, key=lambda d: _DTYPE_ORDER.index(d) if d in _DTYPE_ORDER else 99)


def capability_row(backend) -> dict:
    """The declared capabilities of a backend as plain data (probe, docs, CI)."""
    b = backend
    return {
        "name": b.NAME,
        "description": b.DESCRIPTION,
        "devices": sorted(b.SUPPORTED_DEVICES),
        "dtypes": [dtype_name(d) for d in _sorted_dtypes(b.SUPPORTED_DTYPES)],
        "head_dim": [b.HEAD_DIM_MIN, b.HEAD_DIM_MAX],
        "head_dim_multiple": b.HEAD_DIM_MULTIPLE,
        "forward": True,
        "backward": b.HAS_BACKWARD,
        "lse": b.RETURNS_LSE,
        "causal": b.SUPPORTS_CAUSAL,
        "window": b.SUPPORTS_WINDOW,
        "softcap": b.SUPPORTS_SOFTCAP,
        "alibi": b.SUPPORTS_ALIBI,
        "dropout": b.SUPPORTS_DROPOUT,
        "gqa": b.SUPPORTS_GQA,
        "key_offset": b.SUPPORTS_KEY_OFFSET,
        "deterministic": bool(b.IS_DETERMINISTIC or b.SUPPORTS_DETERMINISTIC),
        "ring": b.RETURNS_LSE,
        "min_compute_capability": {k: list(v) for k, v in (b.MIN_COMPUTE_CAPABILITY or {}).items()},
        "packages": [p.dist for p in b.REQUIRED_PACKAGES],
        "comm": sorted({_COMM.get(d, "gloo") for d in b.SUPPORTED_DEVICES}),
    }


_COMM = {"cpu": "gloo", "cuda": "nccl", "rocm": "nccl", "npu": "hccl", "xpu": "xccl"}
