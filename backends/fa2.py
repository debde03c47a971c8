"""FlashAttention-2 (distribution ``flash-attn``, import ``flash_attn``).

The adapter drives the low-level ``flash_attn.flash_attn_interface._flash_attn_forward`` /
``_flash_attn_backward`` (the only calls that return the lse and take a given lse back),
across both API generations, chosen by the installed version compared *numerically*
(``"2.10.0"`` is newer than ``"2.6.3"``):

=============  ===========================================  ==================================
version        forward                                      backward
=============  ===========================================  ==================================
2.5.x          ``window_size=(l, r)``, no ``softcap``;       ``window_size=(l, r)``; returns
               returns ``(out, q, k, v, out_padded,          ``(dq, dk, dv, softmax_d)``
               softmax_lse, S_dmask, rng_state)``
2.6.x          as 2.5 plus ``softcap``                       as 2.5 plus ``softcap``
>= 2.7         ``window_size_left/right``; returns           writes ``dq/dk/dv`` in place,
               ``(out, softmax_lse, S_dmask, rng_state)``    returns ``softmax_d``
=============  ===========================================  ==================================

What the adapter adds so that the kernel keeps the contract of :mod:`usp_hal.backend`:

* Head dims are zero-padded to a multiple of 8 before every call and sliced back
  (>= 2.7 rejects other head dims; zero columns add nothing to ``q.k`` and give zero
  output columns, so this is exact).  The scale is always passed explicitly, from the
  *unpadded* head dim when the caller gives none.
* The kernel writes lse ``+inf`` for a row that sees no key; it is returned as ``-inf``.
  Before the backward, ``-inf`` rows become ``+inf`` again (:func:`lse_for_backward`),
  so they contribute nothing even when ``out``/``lse`` are the ring-merged ones.
* The kernel aligns causal/window/alibi positions to the bottom-right corner, the contract
  to the top-left.  With ``Sq == Sk`` they agree.  Otherwise the window (and causal,
  folded into it) is shifted by ``Sk - Sq`` when the result is expressible, and refused
  with a reason when it is not; alibi is refused for ``Sq != Sk``.
* On its causal path (``causal``, or a window ``(-1, 0)``) the kernel adds ALiBi as
  ``+slope * key_index`` instead of ``-slope * |query_index - key_index|``: the same
  softmax, but the lse is larger by ``slope * query_index``.  The adapter subtracts that
  from the lse it returns and adds it back before the backward.

Dropout is declared unsupported on purpose: the contract's backward receives no RNG state
from the forward, so the kernel could not replay the forward's dropout mask.
"""
from __future__ import annotations

import importlib
import math
from typing import Optional

import torch

from usp_hal.backend import (
    AttentionBackend, BackendUnavailable, installed_version, lse_for_backward, normalize_lse,
    pad_head_dim, parse_version,
)
from usp_hal.capabilities import AttnRequest, Package
from usp_hal.platform import device_type_of

PACKAGE = Package(dist="flash-attn", module="flash_attn_2_cuda", min_version="2.5.0", extra="fa2")

SOFTCAP_SINCE = "2.6.0"        # _flash_attn_forward/_backward gained ``softcap``
SPLIT_WINDOW_SINCE = "2.7.0"   # window_size_left/right, 4-tuple forward, in-place backward
KERNEL_HEAD_DIM_MULTIPLE = 8   # what the C++ kernels accept; the adapter pads to it


# ---------------------------------------------------------------------------- shared helpers
# (also used by the FlashAttention-3 adapter, whose kernel has the same conventions)

def default_scale(softmax_scale: Optional[float], head_dim: int) -> float:
    """The caller's scale, or 1/sqrt(D) of the unpadded head dim (never the padded one)."""
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)


def kernel_window(name: str, sq: int, sk: int, causal: bool, window, has_alibi: bool) -> tuple:
    """Translate the contract's top-left positions into the kernel's bottom-right ones.

    Returns ``(causal, left, right)`` to pass to the kernel.  The kernel keeps key ``n`` for
    query ``m`` when ``m + (Sk - Sq) - left <= n <= m + (Sk - Sq) + right``, with a negative
    bound meaning unbounded, so a contract bound that would need a negative kernel bound
    cannot be expressed and is refused.
    """
    left, right = int(window[0]), int(window[1])
    if sq == sk:
        return bool(causal), left, right
    if has_alibi:
        raise NotImplementedError(
            f"{name}: the kernel measures alibi distances from the bottom-right corner, which "
            f"differs from the contract when Sq != Sk (Sq={sq}, Sk={sk}); use attn_type='sdpa'")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    shift = sk - sq
    k_left = left + shift if left >= 0 else -1
    k_right = right - shift if right >= 0 else -1
    if (left >= 0 and k_left < 0) or (right >= 0 and k_right < 0):
        what = f"causal with window={tuple(window)}" if causal else f"window={tuple(window)}"
        raise NotImplementedError(
            f"{name}: {what} with Sq={sq}, Sk={sk} cannot be expressed in the kernel's "
            f"bottom-right aligned window (it would need a negative bound); use attn_type='sdpa'")
    return False, k_left, k_right


def check_call(backend, q, k, v, *, causal, window, softcap, alibi_slopes, dropout_p, key_offset,
               needs_grad=False, deterministic=False) -> None:
    """Refuse, with every reason, a call the backend's declared capabilities do not cover.

    The device itself is the dispatcher's business (``availability`` and the registry); the
    kernel rejects foreign tensors on its own.  Here the shapes, dtypes and features of this
    one call are checked against the class attributes, through ``not_supported_reasons``.
    """
    name = backend.NAME
    for label, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name}: {label} must be [B, S, H, D], got shape {tuple(x.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0]:
        raise ValueError(f"{name}: shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (expected q [B, Sq, H, D], k/v [B, Sk, Hkv, D])")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{name}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if alibi_slopes is not None and tuple(alibi_slopes.shape) not in ((q.shape[2],), (q.shape[0], q.shape[2])):
        raise ValueError(f"{name}: alibi_slopes must be (H,) or (B, H) = {(q.shape[0], q.shape[2])}, "
                         f"got {tuple(alibi_slopes.shape)}")
    dev = device_type_of(q.device)
    if dev not in backend.SUPPORTED_DEVICES:
        dev = sorted(backend.SUPPORTED_DEVICES)[0]
    req = AttnRequest(dtype=q.dtype, device_type=dev, head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                      num_heads=q.shape[2], num_kv_heads=k.shape[2], causal=bool(causal),
                      window=tuple(int(w) for w in window), softcap=float(softcap or 0.0),
                      alibi=alibi_slopes is not None, dropout_p=float(dropout_p or 0.0),
                      needs_grad=needs_grad, needs_lse=True, deterministic=bool(deterministic),
                      key_offset=bool(key_offset))
    reasons = list(backend.not_supported_reasons(req))
    if key_offset and causal and not backend.SUPPORTS_KEY_OFFSET:
        reasons.append(f"causal with key_offset={key_offset} (the core only asks for causal on square "
                       f"diagonal blocks)")
    if reasons:
        alts = _alternatives(req, name)
        hint = (f"; backends whose declarations cover it: {', '.join(alts)}" if alts
                else "; run `usp-hal probe` to see what each backend supports")
        raise NotImplementedError(f"attn_type={name!r} cannot run this call ({req.describe()}):\n  - "
                                  + "\n  - ".join(reasons) + hint)


def _alternatives(req: AttnRequest, exclude: str) -> list:
    from usp_hal.registry import REGISTRY
    names = []
    for cand in REGISTRY.priority(req.device_type):
        if cand == exclude:
            continue
        try:
            cls = REGISTRY.get(cand)
        except ImportError:  # a registered adapter module that is not present in this install
            continue
        if not cls.not_supported_reasons(req):
            names.append(cand)
    return names


def unpad(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x if x.shape[-1] == head_dim else x[..., :head_dim].contiguous()


def check_lse(name: str, lse: torch.Tensor, q: torch.Tensor) -> None:
    want = (q.shape[0], q.shape[2], q.shape[1])
    if tuple(lse.shape) != want:
        raise ValueError(f"{name}: lse must be [B, H, Sq] = {want}, got {tuple(lse.shape)}")


# ---------------------------------------------------------------------------- the kernel
class _FA2Kernel:
    """One imported ``flash_attn_interface`` and the call convention of its version."""

    def __init__(self, iface, version: str) -> None:
        self.iface = iface
        self.version = version
        parsed = parse_version(version)
        self.split_window = parsed >= parse_version(SPLIT_WINDOW_SINCE)
        self.has_softcap = parsed >= parse_version(SOFTCAP_SINCE)

    def _common(self, kw: dict, causal, left, right, softcap) -> dict:
        if self.split_window:
            kw.update(window_size_left=left, window_size_right=right)
        else:
            kw["window_size"] = (left, right)
        if self.has_softcap:
            kw["softcap"] = float(softcap)
        elif softcap:
            raise NotImplementedError(f"fa2: softcap needs flash-attn >= {SOFTCAP_SINCE} "
                                      f"(installed: {self.version})")
        kw["causal"] = causal
        return kw

    def forward(self, q, k, v, scale, causal, left, right, softcap, slopes):
        kw = self._common(dict(q=q, k=k, v=v, dropout_p=0.0, softmax_scale=scale,
                               alibi_slopes=slopes, return_softmax=False), causal, left, right, softcap)
        res = self.iface._flash_attn_forward(**kw)
        want = 4 if self.split_window else 8
        if len(res) != want:
            raise RuntimeError(f"fa2: flash-attn {self.version} _flash_attn_forward returned {len(res)} "
                               f"values, expected {want} for this version")
        # <= 2.6: (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
        return (res[0], res[1]) if self.split_window else (res[0], res[5])

    def backward(self, dout, q, k, v, out, lse, scale, causal, left, right, softcap, slopes, deterministic):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kw = self._common(dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                               dropout_p=0.0, softmax_scale=scale, alibi_slopes=slopes,
                               deterministic=bool(deterministic), rng_state=None),
                          causal, left, right, softcap)
        res = self.iface._flash_attn_backward(**kw)
        if self.split_window:
            return dq, dk, dv          # written in place; ``res`` is softmax_d
        if not isinstance(res, (tuple, list)) or len(res) != 4:
            raise RuntimeError(f"fa2: flash-attn {self.version} _flash_attn_backward did not return "
                               f"(dq, dk, dv, softmax_d)")
        return res[0], res[1], res[2]


def _load_kernel() -> _FA2Kernel:
    try:
        iface = importlib.import_module("flash_attn.flash_attn_interface")
    except ImportError as exc:
        why = FlashAttn2Backend.availability().reason or "import failed"
        raise BackendUnavailable(f"fa2: cannot import flash_attn.flash_attn_interface ({exc}); {why}") from exc
    version = installed_version(PACKAGE)
    if version is None:
        version = getattr(importlib.import_module("flash_attn"), "__version__", None)
    if version is None:
        raise BackendUnavailable("fa2: cannot tell which flash-attn version is installed (no package "
                                 "metadata, no flash_attn.__version__), so its API generation is unknown")
    if parse_version(version) < parse_version(PACKAGE.min_version):
        raise BackendUnavailable(f"fa2: flash-attn {version} too old (needs >= {PACKAGE.min_version})")
    return _FA2Kernel(iface, version)


def _causal_path(causal: bool, left: int, right: int, sk: int) -> bool:
    """Whether the kernel takes its causal code path (its own window normalisation)."""
    if causal:
        right = 0
    if left >= sk:
        left = -1
    if right >= sk:
        right = -1
    return left < 0 and right == 0


def _alibi_lse_shift(slopes, q, k_causal, left, right, sk):
    """``slope * query_index`` [B|1, H, Sq] when the kernel's causal ALiBi path applies."""
    if slopes is None or not _causal_path(k_causal, left, right, sk):
        return None
    b, sq, h, _ = q.shape
    rows = torch.arange(sq, device=slopes.device, dtype=torch.float32)
    s = slopes.view(-1, h, 1)
    return s * rows.view(1, 1, sq)


def _slopes(alibi_slopes, q):
    if alibi_slopes is None:
        return None
    return alibi_slopes.to(device=q.device, dtype=torch.float32).contiguous()


# ---------------------------------------------------------------------------- the backend
class FlashAttn2Backend(AttentionBackend):
    NAME = "fa2"
    DESCRIPTION = "FlashAttention-2 (flash-attn): low-level forward/backward with lse, both API generations"
    SUPPORTED_DEVICES = frozenset({"cuda", "rocm"})
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    HEAD_DIM_MAX = 256
    SUPPORTS_CAUSAL = True
    SUPPORTS_WINDOW = True
    SUPPORTS_SOFTCAP = True           # from 2.6.0: see extra_reasons
    SUPPORTS_ALIBI = True
    SUPPORTS_DROPOUT = False          # the contract carries no RNG state into the backward
    SUPPORTS_GQA = True
    SUPPORTS_KEY_OFFSET = False       # window/alibi take no position offset between blocks
    RETURNS_LSE = True
    HAS_BACKWARD = True
    SUPPORTS_DETERMINISTIC = True     # ``deterministic`` is passed to the backward kernel
    MIN_COMPUTE_CAPABILITY = {"cuda": (8, 0)}
    REQUIRED_PACKAGES = (PACKAGE,)

    @classmethod
    def extra_reasons(cls, request: AttnRequest) -> list:
        reasons = []
        if request.softcap:
            ver = installed_version(PACKAGE)
            if ver is not None and parse_version(ver) < parse_version(SOFTCAP_SINCE):
                reasons.append(f"softcap needs flash-attn >= {SOFTCAP_SINCE} (installed: {ver})")
        return reasons

    def _kernel(self) -> _FA2Kernel:
        kernel = getattr(self, "_loaded_kernel", None)
        if kernel is None:
            kernel = self._loaded_kernel = _load_kernel()
        return kernel

    def forward(self, q, k, v, *, softmax_scale, causal=False, window=(-1, -1), softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, key_offset=0):
        check_call(type(self), q, k, v, causal=causal, window=window, softcap=softcap,
                   alibi_slopes=alibi_slopes, dropout_p=dropout_p, key_offset=key_offset)
        kernel = self._kernel()
        sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
        k_causal, left, right = kernel_window(self.NAME, sq, sk, causal, window, alibi_slopes is not None)
        slopes = _slopes(alibi_slopes, q)
        qp, kp, vp = (pad_head_dim(x, KERNEL_HEAD_DIM_MULTIPLE).contiguous() for x in (q, k, v))
        out, lse = kernel.forward(qp, kp, vp, default_scale(softmax_scale, d), k_causal, left, right,
                                  softcap or 0.0, slopes)
        lse = normalize_lse(lse)
        shift = _alibi_lse_shift(slopes, q, k_causal, left, right, sk)
        if shift is not None:
            lse = lse - shift
        return unpad(out, d), lse

    def backward(self, dout, q, k, v, out, lse, *, softmax_scale, causal=False, window=(-1, -1),
                 softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False, key_offset=0):
        check_call(type(self), q, k, v, causal=causal, window=window, softcap=softcap,
                   alibi_slopes=alibi_slopes, dropout_p=dropout_p, key_offset=key_offset,
                   needs_grad=True, deterministic=deterministic)
        check_lse(self.NAME, lse, q)
        kernel = self._kernel()
        sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
        k_causal, left, right = kernel_window(self.NAME, sq, sk, causal, window, alibi_slopes is not None)
        slopes = _slopes(alibi_slopes, q)
        lse_k = lse_for_backward(lse).to(torch.float32)
        shift = _alibi_lse_shift(slopes, q, k_causal, left, right, sk)
        if shift is not None:
            lse_k = lse_k + shift
        dop, qp, kp, vp, op = (pad_head_dim(x, KERNEL_HEAD_DIM_MULTIPLE).contiguous()
                               for x in (dout.to(q.dtype), q, k, v, out.to(q.dtype)))
        dq, dk, dv = kernel.backward(dop, qp, kp, vp, op, lse_k.contiguous(), default_scale(softmax_scale, d),
                                     k_causal, left, right, softcap or 0.0, slopes, deterministic)
        return unpad(dq, d), unpad(dk, d), unpad(dv, d)
