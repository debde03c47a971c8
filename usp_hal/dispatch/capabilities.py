"""What a backend can do (declared as data) and what one attention call asks for.

A backend class declares its capabilities as class attributes (see
:class:`usp_hal.dispatch.backend.AttentionBackend`): flags and ranges, per-version and per-device
:class:`Limit` entries, and the :class:`Positions` of its causal/window masks.  What one
kernel call asks for besides its tensors is one frozen :class:`KernelCall`, carried from the
plan (or a decode step) to the adapter; a call, with its tensors, is described for the
rules by an :class:`AttnRequest`, which :meth:`AttnRequest.of` alone builds from the two.
:func:`declared_reasons` compares a request with a backend's declarations and returns
human-readable reasons; an empty list means "supported".  The backend's
``not_supported_reasons`` classmethod starts from it, and that one method serves dispatch,
the probe CLI, the docs table, the test parametrisation, the CI matrices and the per-call
check in the backend's ``forward``/``backward``, so every rule is written once.

This module imports nothing else of the package but the platform layer (device facts).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Optional, Tuple

import torch

from . import platform as _platform

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


@dataclass(frozen=True, eq=False)
class KernelCall:
    """What one kernel call needs besides its tensors, as one frozen value: the pipeline's
    plan builds one per call, the ring derives each block's from it (:meth:`with_`), a
    decode step builds its own, and every backend method takes it
    (``forward(q, k, v, call)``, ``backward(dout, q, k, v, out, lse, call)``).

    * ``scale``: the softmax scale (None: ``1/sqrt(head_dim)``, resolved by the backend
      before its kernel runs, so a kernel always sees a float);
    * ``causal``, ``window`` ``(left, right)`` (-1: unbounded), ``softcap``,
      ``alibi_slopes`` (``[H]`` or ``[B, H]``), ``dropout_p``, ``deterministic``;
    * ``key_offset``: global key position minus global query position of the two blocks
      (matters with window/alibi), ``mask``: a bool tensor broadcastable to
      ``[B, H, Sq, Sk]`` (True: attend), ``packing``: the sequence boundaries of a packed
      call (:class:`usp_hal.parallel.ring.Packing`; the packed methods only);
    * ``needs_grad`` / ``needs_lse``: whether the call's gradients and its lse are used
      (what dispatch and the per-call admission check).

    Equality is identity (the value may hold tensors); :attr:`key` is what admission keys on."""

    scale: Optional[float] = None
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    deterministic: bool = False
    key_offset: int = 0
    mask: Optional[torch.Tensor] = None
    packing: Any = None
    needs_grad: bool = False
    needs_lse: bool = False

    def __post_init__(self):
        w = self.window
        if type(w) is not tuple or len(w) != 2 or type(w[0]) is not int or type(w[1]) is not int:
            object.__setattr__(self, "window", tuple(int(x) for x in w))

    def with_(self, **kw) -> "KernelCall":
        """A variant of this call (e.g. a ring block's: ``call.with_(causal=..., key_offset=...)``)."""
        return replace(self, **kw)

    def flash_kwargs(self) -> dict:
        """This call as flash-attn's keywords: ``dropout_p``, ``softmax_scale``, ``causal``,
        ``window_size``, ``softcap``, ``alibi_slopes``, the options of flash-attn's
        ``flash_attn_func`` that a forward uses, and the ones yunchang 0.6.4's "fwd-only" kernel
        contract passes (yunchang/ring/ring_flash_attn.py, with ``return_softmax=``).  A default
        ``KernelCall()`` gives flash-attn's defaults.  Not ``deterministic``, which only
        flash-attn's backward reads."""
        return dict(dropout_p=self.dropout_p, softmax_scale=self.scale, causal=self.causal, window_size=self.window,
                    softcap=self.softcap, alibi_slopes=self.alibi_slopes)

    def scale_for(self, head_dim: int) -> float:
        """The scale as a float: the given one, or ``1/sqrt(head_dim)``."""
        return float(self.scale) if self.scale is not None else 1.0 / math.sqrt(head_dim)

    @property
    def has_window(self) -> bool:
        return self.window != (-1, -1)

    @property
    def positional(self) -> bool:
        """Key positions matter beyond causal: a window or alibi (then ``key_offset`` does too)."""
        return self.window != (-1, -1) or self.alibi_slopes is not None

    @cached_property
    def key(self) -> tuple:
        """What the per-call rules see of this call (not the scale, the tensors' values, nor
        ``needs_grad``: a forward is checked as a forward and a backward as a gradient call)."""
        return (self.causal, self.window, self.softcap, self.alibi_slopes is None, self.dropout_p,
                self.deterministic, not self.key_offset, None if self.mask is None else tuple(self.mask.shape),
                self.packing is None, self.needs_lse)


@dataclass(frozen=True)
class AttnRequest:
    """Everything about one attention call that decides whether a backend can serve it.

    ``head_dim``/``num_heads`` describe what the *kernel* sees (after the Ulysses split).
    ``needs_lse`` is True when the call's lse is merged across ring blocks or returned,
    ``key_offset`` when window/alibi must be applied with a position offset between the
    query and key block (ring blocks off the diagonal).  ``seqlen_q``/``seqlen_k`` (optional)
    let rules that depend on the two lengths decide at dispatch time; without them those
    rules are checked per kernel call.  ``device_model`` (optional) is what
    :func:`usp_hal.dispatch.platform.device_model` reports for the device.
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
    seqlen_q: Optional[int] = None
    seqlen_k: Optional[int] = None
    device_model: Optional[str] = None
    # packed documents (cu_seqlens): the core cuts every kernel call at document boundaries
    varlen: bool = False
    # a boolean mask on some kernel calls (the partial blocks of a ``mask=`` call)
    mask: bool = False

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

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall, *, lengths: bool = True,
           **over) -> "AttnRequest":
        """The one constructor of a call's request: dtype, device facts and head dims from the
        tensors (``[.., S, H, D]``), options from ``call``, and ``Sq``/``Sk`` with ``lengths``.
        ``over``: fields a caller knows better than the tensors show (dispatch before the
        Ulysses split: the kernel's head counts, whether ring blocks will carry key offsets)."""
        dev = _platform.device_type_of(q.device)
        index = q.device.index or 0
        fields_: dict = dict(
            dtype=q.dtype, device_type=dev, head_dim=q.shape[-1], head_dim_v=v.shape[-1], num_heads=q.shape[-2],
            num_kv_heads=k.shape[-2], causal=bool(call.causal), window=call.window, softcap=float(call.softcap or 0.0),
            alibi=call.alibi_slopes is not None, dropout_p=float(call.dropout_p or 0.0), needs_grad=call.needs_grad,
            needs_lse=call.needs_lse, deterministic=bool(call.deterministic), key_offset=bool(call.key_offset),
            compute_capability=_platform.compute_capability(dev, index),
            device_model=_platform.device_model(dev, index),
            seqlen_q=q.shape[-3] if lengths else None, seqlen_k=k.shape[-3] if lengths else None,
            mask=call.mask is not None)
        fields_.update(over)
        return cls(**fields_)

    def describe(self) -> str:
        parts = [
            f"dtype={dtype_name(self.dtype)}",
            f"device={self.device_type}",
            f"head_dim={self.head_dim}"
            + (f"/{self.head_dim_v}" if self.head_dim_v not in (None, self.head_dim) else ""),
            f"heads={self.num_heads}/{self.kv_heads}",
            f"causal={self.causal}",
        ]
        if self.seqlen_q is not None and self.seqlen_k is not None:
            parts.append(f"Sq={self.seqlen_q}, Sk={self.seqlen_k}")
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
        if self.mask:
            parts.append("mask")
        return ", ".join(parts)


@dataclass(frozen=True)
class Package:
    """A distribution a backend needs: checked with importlib.metadata and find_spec only."""

    dist: str                      # distribution name for importlib.metadata
    module: str                    # top-level module name that is safe for find_spec
    min_version: Optional[str] = None
    alt_dists: tuple = ()          # other distribution names that provide the same module
    extra: Optional[str] = None    # the usp-hal extra that installs it
    wheel: bool = True             # pip installs it from a prebuilt wheel (no compiler, minutes at most)


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""
    version: Optional[str] = None
    details: dict = field(default_factory=dict)

    def __bool__(self) -> bool:  # pragma: no cover - convenience
        return self.ok


# ----------------------------------------------------------------------------- declared rules
#: Request features a :class:`Limit` can name in ``uses``/``unless``.
FEATURES = {
    "causal": lambda r: bool(r.causal),
    "window": lambda r: r.has_window,
    "left_window": lambda r: int(tuple(r.window)[0]) >= 0,
    "right_window": lambda r: int(tuple(r.window)[1]) >= 0,
    "softcap": lambda r: bool(r.softcap),
    "alibi": lambda r: bool(r.alibi),
    "dropout": lambda r: bool(r.dropout_p),
    "backward": lambda r: bool(r.needs_grad),
    "lse": lambda r: bool(r.needs_lse),
    "deterministic": lambda r: bool(r.deterministic and r.needs_grad),
    "gqa": lambda r: r.kv_heads != r.num_heads,
    "key_offset": lambda r: bool(r.key_offset),
    "dk_ne_dv": lambda r: r.v_dim != r.head_dim,
    "fp16": lambda r: r.dtype == torch.float16,
    "bf16": lambda r: r.dtype == torch.bfloat16,
    "fp32": lambda r: r.dtype == torch.float32,
    "fp64": lambda r: r.dtype == torch.float64,
}


def _arch_matches(cc: tuple, pattern: str) -> bool:
    """``sm90`` is exactly 9.0, ``sm8x`` any 8.y, ``sm100+`` 10.0 and above."""
    text = pattern[2:] if pattern.startswith("sm") else pattern
    if text.endswith("+"):
        base = text[:-1]
        return tuple(cc) >= (int(base[:-1]), int(base[-1]))
    if text.endswith("x"):
        return int(cc[0]) == int(text[:-1])
    return tuple(cc) == (int(text[:-1]), int(text[-1]))


def sm(cc) -> str:
    return f"sm{cc[0]}{cc[1]}"


@dataclass(frozen=True)
class Limit:
    """One declared limit of a backend: it refuses a request when *every* condition given holds.

    * ``uses``: request features (keys of :data:`FEATURES`) the call must use; ``unless``:
      features whose use lifts the limit.
    * ``devices``: device types it applies to (empty: all).
    * ``version``: a PEP 440 specifier (e.g. ``"<2.6.0"``) the installed version of the
      backend's kernel package must match; ``torch``: the same for the torch version.  An
      unknown version never matches (the limit does not fire).
    * ``archs``: compute capabilities that *are* supported (``"sm90"``, ``"sm8x"``,
      ``"sm100+"``); the limit fires when the capability is known and matches none of them.
      ``models``: the same for device models (e.g. ``"intel_gpu_pvc"``).
    * ``head_dims``: ``(lo, hi)``, inclusive, on the head dim rounded up to ``pad_to``.
    * ``env``: ``(name, value)``: fires only while that environment variable has that value.

    ``reason`` is formatted with ``version``, ``torch``, ``cc`` (``smXY``), ``model`` and
    ``head_dim``; ``source`` names where the fact was read (repository, tag, file, function).
    """

    reason: str
    uses: tuple = ()
    unless: tuple = ()
    devices: tuple = ()
    version: Optional[str] = None
    torch: Optional[str] = None
    archs: tuple = ()
    models: tuple = ()
    head_dims: Optional[tuple] = None
    pad_to: int = 1
    env: Optional[tuple] = None
    source: str = ""

    def __post_init__(self):
        for name in tuple(self.uses) + tuple(self.unless):
            if name not in FEATURES:
                raise ValueError(f"Limit: unknown feature {name!r}; valid: {', '.join(FEATURES)}")

    def fires(self, req: AttnRequest, ctx: "RuleContext") -> Optional[str]:
        """The reason when this limit refuses ``req``, else None."""
        if self.devices and req.device_type not in self.devices:
            return None
        if any(not FEATURES[f](req) for f in self.uses) or any(FEATURES[f](req) for f in self.unless):
            return None
        if self.head_dims is not None:
            d = -(-req.head_dim // self.pad_to) * self.pad_to
            if not self.head_dims[0] <= d <= self.head_dims[1]:
                return None
        if self.env is not None and os.environ.get(self.env[0]) != self.env[1]:
            return None
        if self.version is not None and not _version_in(ctx.version, self.version):
            return None
        if self.torch is not None and not _version_in(ctx.torch_version, self.torch):
            return None
        cc = req.compute_capability
        if self.archs:
            if cc is None or any(_arch_matches(cc, a) for a in self.archs):
                return None
        if self.models:
            if req.device_model is None or req.device_model in self.models:
                return None
        return self.reason.format(version=ctx.version, torch=ctx.torch_version, cc=sm(cc) if cc else "?",
                                  model=req.device_model, head_dim=req.head_dim)

    def condition(self) -> str:
        """The condition in words (docs)."""
        words = (("devices", lambda x: "on " + "/".join(x)), ("uses", lambda x: "with " + " + ".join(x)),
                 ("unless", lambda x: "without " + " or ".join(x)), ("version", lambda x: f"package {x}"),
                 ("torch", lambda x: f"torch {x}"), ("archs", lambda x: "outside " + ", ".join(x)),
                 ("models", lambda x: "other than " + ", ".join(x)),
                 ("head_dims", lambda x: f"head dim {x[0]}..{x[1]}"), ("env", lambda x: f"{x[0]}={x[1]}"))
        parts = [say(getattr(self, name)) for name, say in words if getattr(self, name)]
        return ", ".join(parts) or "always"


def _version_in(version: Optional[str], spec: str) -> bool:
    if version is None:
        return False
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version
    try:
        v = Version(version)
    except InvalidVersion:
        import re
        nums = re.findall(r"\d+", version)
        v = Version(".".join(nums[:3]) if nums else "0")
    # local builds ("2.10.0+xpu") compare by their public part
    return Version(v.public) in SpecifierSet(spec, prereleases=True)


@dataclass(frozen=True)
class RuleContext:
    """What rules besides the request depend on: installed kernel version and torch version."""

    version: Optional[str] = None
    torch_version: Optional[str] = None


@dataclass(frozen=True)
class Positions:
    """How the kernel places causal/window/alibi masks when ``Sq != Sk`` (declared data).

    * ``alignment``: ``"top-left"`` (the contract's own convention) or ``"bottom-right"``
      (the kernel keeps key ``n`` for query ``m`` relative to ``m + Sk - Sq``); the adapter
      then translates the contract's bounds, which :func:`kernel_window` does and refuses
      when it cannot.
    * ``causal_any_lengths``: False when the kernel defines causal only for ``Sq == Sk``.
    * ``window``: ``"two-sided"``, ``"left-only"`` or ``"none"`` (documentation; what a kernel
      refuses is declared once, as flags or a :class:`Limit`).
    * ``alibi_any_lengths``: False when alibi distances are only the contract's for ``Sq == Sk``.
    * ``right_unbounded_from``: ``"seqlen_k"`` when the kernel treats a (translated) right
      bound ``>= Sk`` as unbounded, which is wrong for ``Sq >= Sk + 2`` (FlashAttention-2's
      ``mha_fwd``); ``"seqlen_q"`` when it does so from ``Sq - 1`` (always exact).
    """

    alignment: str = "top-left"
    causal_any_lengths: bool = True
    window: str = "two-sided"
    alibi_any_lengths: bool = True
    right_unbounded_from: Optional[str] = None
    source: str = ""


TOP_LEFT = Positions()


class Unsupported(NotImplementedError):
    """A call that a backend's declared capabilities refuse (the message has every reason)."""


def kernel_window(pos: Positions, sq: int, sk: int, causal: bool, window, alibi: bool = False) -> tuple:
    """``(causal, left, right)`` to hand the kernel so that it keeps exactly the contract's
    keys (top-left: key ``n`` for query ``m`` when ``m - left <= n <= m + right``, causal
    ``n <= m``), or :class:`Unsupported` with the reason when the kernel cannot express it."""
    left, right = int(window[0]), int(window[1])
    if sq == sk or pos.alignment == "top-left":
        if causal and sq != sk and not pos.causal_any_lengths:
            raise Unsupported(f"causal attention needs Sq == Sk (got Sq={sq}, Sk={sk})")
        return bool(causal), left, right
    if causal and not pos.causal_any_lengths:
        raise Unsupported(f"causal attention needs Sq == Sk (got Sq={sq}, Sk={sk}); the kernel aligns its "
                          "causal mask bottom-right")
    if alibi and not pos.alibi_any_lengths:
        raise Unsupported(f"alibi with Sq != Sk (Sq={sq}, Sk={sk}): the kernel measures alibi distances from "
                          "the bottom-right corner")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    shift = sk - sq
    k_left = left + shift if left >= 0 else -1
    k_right = right - shift if right >= 0 else -1
    what = (f"causal with window={tuple(window)}" if causal and tuple(window) != (-1, -1)
            else "causal" if causal else f"window={tuple(window)}")
    if (left >= 0 and k_left < 0) or (right >= 0 and k_right < 0):
        raise Unsupported(f"{what} with Sq={sq}, Sk={sk} cannot be expressed in the kernel's bottom-right "
                          "aligned window (it would need a negative bound)")
    if (pos.right_unbounded_from == "seqlen_k" and right >= 0 and sk <= k_right < sq - 1):
        raise Unsupported(f"{what} with Sq={sq}, Sk={sk}: the kernel's right bound would be {k_right} >= Sk, "
                          "which the kernel treats as unbounded although it still excludes keys here")
    return False, k_left, k_right


def position_reasons(pos: Positions, sq: int, sk: int, causal: bool, window, alibi: bool) -> list:
    try:
        kernel_window(pos, sq, sk, causal, window, alibi)
    except Unsupported as exc:
        return [str(exc)]
    return []


# ----------------------------------------------------------------------------- the flag rules
def declared_reasons(b: Any, req: AttnRequest, ctx: Optional[RuleContext] = None) -> list:
    """Every reason the declared capabilities of backend class ``b`` refuse ``req``: the
    flags and ranges, the compute-capability bounds, the :class:`Limit` entries, and (when
    the request carries both lengths) the :class:`Positions`."""
    reasons = []
    if req.device_type not in b.SUPPORTED_DEVICES:
        reasons.append(f"device={req.device_type} (supported: {', '.join(sorted(b.SUPPORTED_DEVICES))})")
    if req.dtype not in b.SUPPORTED_DTYPES:
        names = ", ".join(dtype_name(d) for d in sorted_dtypes(b.SUPPORTED_DTYPES))
        reasons.append(f"dtype={dtype_name(req.dtype)} (supported: {names})")
    hi = b.HEAD_DIM_MAX
    if req.head_dim < b.HEAD_DIM_MIN or (hi is not None and req.head_dim > hi):
        reasons.append(f"head_dim={req.head_dim} (supported: {b.HEAD_DIM_MIN}..{hi if hi is not None else 'any'})")
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
        reasons.append("does not return a log-sum-exp (needed for ring degree > 1 and return_lse)")
    if req.needs_grad and not b.HAS_BACKWARD:
        reasons.append("forward-only kernel: no backward")
    if req.deterministic and req.needs_grad and not (b.IS_DETERMINISTIC or b.SUPPORTS_DETERMINISTIC):
        reasons.append("backward is not deterministic")
    cc = req.compute_capability
    if cc is not None:
        lo = (b.MIN_COMPUTE_CAPABILITY or {}).get(req.device_type)
        if lo is not None and tuple(cc) < tuple(lo):
            reasons.append(f"needs compute capability >= {lo[0]}.{lo[1]}, found {cc[0]}.{cc[1]}")
        hi_cc = (b.MAX_COMPUTE_CAPABILITY or {}).get(req.device_type)
        if hi_cc is not None and tuple(cc) > tuple(hi_cc):
            reasons.append(f"built for compute capability <= {hi_cc[0]}.{hi_cc[1]} only, found {cc[0]}.{cc[1]}")
    ctx = ctx if ctx is not None else RuleContext()
    for limit in b.LIMITS:
        why = limit.fires(req, ctx)
        if why:
            reasons.append(why)
    if req.seqlen_q is not None and req.seqlen_k is not None and req.seqlen_q != req.seqlen_k:
        reasons.extend(position_reasons(b.POSITIONS, req.seqlen_q, req.seqlen_k, req.causal, req.window, req.alibi))
    if req.mask and not getattr(b, "SUPPORTS_MASK", False):
        reasons.append("a boolean attention mask (the partial blocks of mask=) is not supported: the kernel takes "
                       "no mask; use attn_type='sdpa' (or 'flex' where it runs)")
    if req.varlen and not getattr(b, "SUPPORTS_VARLEN", True):
        reasons.append("packed documents (cu_seqlens) not supported: the kernel cannot take the per-document "
                       "calls of the block plan; call it per document, or use a backend that declares SUPPORTS_VARLEN")
    return reasons


def not_supported_reasons(backend, req: AttnRequest) -> list:
    """Every reason ``backend`` (a class or an instance) refuses ``req``: its own
    ``not_supported_reasons`` classmethod."""
    return backend.not_supported_reasons(req)


_DTYPE_ORDER = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def sorted_dtypes(dtypes) -> list:
    return sorted(dtypes, key=lambda d: _DTYPE_ORDER.index(d) if d in _DTYPE_ORDER else 99)




def capability_row(backend) -> dict:
    """The declared capabilities of a backend as plain data (probe, docs, CI)."""
    b = backend
    return {
        "name": b.NAME,
        "description": b.DESCRIPTION,
        "devices": sorted(b.SUPPORTED_DEVICES),
        "dtypes": [dtype_name(d) for d in sorted_dtypes(b.SUPPORTED_DTYPES)],
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
        "varlen": ("kernel" if getattr(b, "VARLEN_KERNEL", False) else "calls")
        if getattr(b, "SUPPORTS_VARLEN", True) else False,
        "mask": bool(getattr(b, "SUPPORTS_MASK", False)),
        "min_compute_capability": {k: list(v) for k, v in (b.MIN_COMPUTE_CAPABILITY or {}).items()},
        "max_compute_capability": {k: list(v) for k, v in (b.MAX_COMPUTE_CAPABILITY or {}).items()},
        "input_layout": b.INPUT_LAYOUT,
        "limits": [{"reason": lim.reason, "when": lim.condition(), "source": lim.source} for lim in b.LIMITS],
        "packages": [p.dist for p in b.REQUIRED_PACKAGES],
        "comm": sorted({_platform.dist_backend_for(d) if d in _platform.PLATFORMS else "gloo"
                        for d in b.SUPPORTED_DEVICES}),
    }
