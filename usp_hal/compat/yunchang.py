"""yunchang 0.6.4's public functions, over usp-hal's own attention.

``import usp_hal`` re-exports these names lazily, so code written for yunchang runs with its
import line changed.  Each maps to usp-hal's behaviour or refuses with the reason:

* the ring functions (``ring_flash_attn_func``, ``zigzag_ring_flash_attn_func``,
  ``stripe_flash_attn_func``, their ``kvpacked``/``qkvpacked`` forms, ``ring_pytorch_attn_func``,
  the ``ring_flashinfer_attn_*`` and ``ring_npu_flash_attn_func``): ring attention over the
  ``group`` they are given (the default process group for None), with the layout their name
  says; with ``return_attn_probs=True`` they return ``(out, lse, None)`` as yunchang's do
  (yunchang/ring/ring_flash_attn.py ``RingFlashAttnFunc.forward``);
* the varlen ring functions refuse: yunchang's take each rank's own ``cu_seqlens``,
  usp-hal's packed documents are one global ``cu_seqlens`` (``LongContextAttention(...)(...,
  cu_seqlens=...)``);
* ``RING_IMPL_DICT`` / ``RING_IMPL_QKVPACKED_DICT``: yunchang's keys to these functions;
* ``basic_extract_local`` / ``zigzag_extract_local`` / ``stripe_extract_local``: the
  ``EXTRACT_FUNC_DICT`` entries;
* the ring functions run on :func:`usp_hal.parallel.mesh.mesh_of_group` (the one-dimensional mesh of a
  process group a caller already has, as ``UlyssesAttention(sequence_process_group)`` does);
  an ``attn_processor`` becomes a backend through :mod:`usp_hal.dispatch.processor`.

The other functions with yunchang's attention keywords are here too, so yunchang's signatures
live in this one file: ``select_flash_attn_impl`` (yunchang.kernels) and
``ring_flash_attn_forward`` / ``ring_flash_attn_backward`` / ``RingFlashAttnFunc``
(yunchang.ring.ring_flash_attn).  ``usp_hal`` does not re-export them;
:func:`usp_hal.compat.alias.install_yunchang_alias` serves them under those module names.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, Tuple

import torch

from ..dispatch.capabilities import KernelCall
from ..dispatch.processor import processor_attn_type, processor_backend
from ..dispatch.registry import REGISTRY
from ..parallel.mesh import mesh_of_group
from .extract import EXTRACT_FUNC_DICT


class YunchangUnsupported(NotImplementedError):
    """A yunchang function whose contract usp-hal cannot honour; the message names the
    alternative."""


# ---------------------------------------------------------------------------- ring functions

_RING_MODULES: Dict[Tuple[Any, ...], Tuple[Any, Any]] = {}


def _ring_module(layout: str, attn_type, attn_processor, group):
    """One ring module per (layout, kernel, processor, group), kept so that repeated calls reuse
    its plans (at most 32; the oldest goes first)."""
    from ..attention import RingAttention
    key = (layout, attn_type if isinstance(attn_type, str) else repr(attn_type), id(attn_processor), group)
    got = _RING_MODULES.get(key)
    if got is None or got[1] is not attn_processor:
        mesh = mesh_of_group(group, "ring")
        module = RingAttention(ring_impl_type=layout, attn_type=attn_type, attn_processor=attn_processor, mesh=mesh)
        if len(_RING_MODULES) >= 32:
            _RING_MODULES.pop(next(iter(_RING_MODULES)))
        got = _RING_MODULES[key] = (module, attn_processor)
    return got[0]


def _ring(layout, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
          return_attn_probs, group, attn_type, attn_processor=None):
    module = _ring_module(layout, attn_type, attn_processor, group)
    res = module(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                 softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                 return_lse=bool(return_attn_probs))
    if return_attn_probs:
        out, lse = res
        return out, lse, None
    return res


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                         attn_type="auto", attn_processor=None):
    """Ring attention over ``group`` on the basic layout (yunchang/ring/ring_flash_attn.py):
    ``out``, or ``(out, lse, None)`` with ``return_attn_probs=True``."""
    return _ring("basic", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                 deterministic, return_attn_probs, group, attn_type, attn_processor)


def ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                  group=None, attn_type="auto"):
    """:func:`ring_flash_attn_func` with ``kv [B, S, 2, Hkv, D]``."""
    return _ring("basic", q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                 alibi_slopes, deterministic, return_attn_probs, group, attn_type)


def ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                   softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                   group=None, attn_type="auto"):
    """:func:`ring_flash_attn_func` with ``qkv [B, S, 3, H, D]``."""
    return _ring("basic", qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                 softcap, alibi_slopes, deterministic, return_attn_probs, group, attn_type)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                group=None, attn_type="auto", attn_processor=None):
    """Ring attention over ``group`` on the zigzag layout (yunchang/ring/zigzag_ring_flash_attn.py;
    usp-hal also runs it without ``causal``)."""
    return _ring("zigzag", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                 deterministic, return_attn_probs, group, attn_type, attn_processor)


def zigzag_ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None, attn_type="auto"):
    return _ring("zigzag", q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                 alibi_slopes, deterministic, return_attn_probs, group, attn_type)


def zigzag_ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, group=None, attn_type="auto"):
    return _ring("zigzag", qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                 softcap, alibi_slopes, deterministic, return_attn_probs, group, attn_type)


def stripe_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                           attn_type="auto", attn_processor=None):
    """Ring attention over ``group`` on the stripe layout (yunchang/ring/stripe_flash_attn.py)."""
    return _ring("stripe", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                 deterministic, return_attn_probs, group, attn_type, attn_processor)


def stripe_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                    group=None, attn_type="auto"):
    return _ring("stripe", q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                 alibi_slopes, deterministic, return_attn_probs, group, attn_type)


def stripe_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                     group=None, attn_type="auto"):
    return _ring("stripe", qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                 softcap, alibi_slopes, deterministic, return_attn_probs, group, attn_type)


def ring_pytorch_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                           attn_type="auto", attn_processor=None):
    """Basic ring with torch's scaled_dot_product_attention, whatever ``attn_type`` says (as
    yunchang/ring/ring_pytorch_attn.py, which reads only ``group``, ``softmax_scale`` and
    ``causal`` and returns the output alone)."""
    return _ring("basic", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                 deterministic, False, group, "sdpa")


def ring_flashinfer_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              group=None, attn_type="flashinfer", attn_processor=None):
    """Basic ring, kernel ``attn_type`` (FlashInfer by default; yunchang/ring/ring_flashinfer_attn.py)."""
    return _ring("basic", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                 deterministic, return_attn_probs, group, attn_type, attn_processor)


def ring_flashinfer_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                       softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                       group=None, attn_type="flashinfer"):
    return _ring("basic", q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                 alibi_slopes, deterministic, return_attn_probs, group, attn_type)


def ring_flashinfer_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                        group=None, attn_type="flashinfer"):
    return _ring("basic", qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                 softcap, alibi_slopes, deterministic, return_attn_probs, group, attn_type)


def ring_npu_flash_attn_func(group, q, k, v, head_num=None, input_layout="BSND"):
    """Basic ring over ``group`` with the Ascend NPU kernel, no mask (yunchang/ring/ring_npu_flash_attn.py)."""
    if input_layout != "BSND":
        raise NotImplementedError(f"input_layout={input_layout!r}: only 'BSND' ([B, S, H, D]) is supported")
    return _ring("basic", q, k, v, 0.0, None, False, (-1, -1), 0.0, None, False, False, group, "npu")


# ------------------------------------------- yunchang.kernels and yunchang.ring.ring_flash_attn
# served as those submodules by usp_hal.compat.alias (install_yunchang_alias), not by ``usp_hal``

def _local_fn(backend):
    # the "fwd-only" contract of yunchang/kernels/__init__.py (v0.6.4): fn(q, k, v, dropout_p=,
    # softmax_scale=, causal=, window_size=, softcap=, alibi_slopes=, return_softmax=) -> (out, lse)
    def fwd(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, return_softmax=False):
        if return_softmax:
            raise YunchangUnsupported("select_flash_attn_impl(...)(return_softmax=True): usp-hal's kernels "
                                      "return (out, lse), never the attention probabilities; use "
                                      "return_softmax=False (with dropout_p=0, as yunchang passes it)")
        return backend.forward(q, k, v, KernelCall(scale=softmax_scale, causal=causal, window=tuple(window_size),
                                                   softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p))
    fwd.__name__ = f"{backend.NAME}_forward"
    return fwd


# yunchang/kernels/__init__.py (v0.6.4): select_flash_attn_impl(impl_type, stage="fwd-bwd", attn_processor=None)
def select_flash_attn_impl(impl_type, stage: str = "fwd-bwd", attn_processor=None):
    """``stage="fwd-only"``: the usp-hal backend of ``impl_type`` (or ``attn_processor`` as one,
    :func:`usp_hal.dispatch.processor.processor_attn_type`) as a function returning
    ``(out [B, S, H, D], lse [B, H, S])``.  The ``bwd-only`` and ``fwd-bwd`` stages are refused:
    their call contracts differ per kernel in yunchang."""
    if stage != "fwd-only":
        if stage not in ("bwd-only", "fwd-bwd"):
            raise ValueError(f"Unknown stage: {stage}")
        raise YunchangUnsupported(
            f"select_flash_attn_impl(stage={stage!r}): yunchang's {stage} functions take each kernel's own "
            "arguments; usp-hal serves stage='fwd-only' (out, lse): use stage='fwd-only', and for gradients "
            "yunchang.ring.ring_flash_attn.ring_flash_attn_backward or usp_hal.LongContextAttention")
    if attn_processor is not None:
        cls = processor_attn_type(attn_processor, impl_type)
    else:
        cls = REGISTRY.get(impl_type)
    return _local_fn(cls())


def _basic_ring(group, q, k, v, softmax_scale, dropout_p, causal, window_size, softcap, alibi_slopes,
                deterministic, attn_type, attn_processor):
    return _ring("basic", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                 deterministic, True, group, attn_type, attn_processor)[:2]


# yunchang/ring/ring_flash_attn.py (v0.6.4): ring_flash_attn_forward(process_group, q, k, v, softmax_scale,
#     dropout_p=0, causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
#     attn_type=AttnType.FA, attn_processor=None) -> (out, lse [B, H, S])
def ring_flash_attn_forward(process_group, q, k, v, softmax_scale, dropout_p=0, causal=True, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, deterministic=False, attn_type="auto",
                            attn_processor=None):
    """The basic ring's forward over ``process_group`` (usp-hal's ring): ``(out, lse [B, H, S])``.
    ``attn_type`` defaults to ``"auto"`` (usp-hal's choice), not yunchang's ``AttnType.FA``."""
    with torch.no_grad():
        out, lse = _basic_ring(process_group, q, k, v, softmax_scale, dropout_p, causal, window_size, softcap,
                               alibi_slopes, deterministic, attn_type, attn_processor)
    return out, lse


# yunchang/ring/ring_flash_attn.py (v0.6.4): ring_flash_attn_backward(process_group, dout, q, k, v, out,
#     softmax_lse, softmax_scale, dropout_p=0, causal=True, window_size=(-1, -1), softcap=0.0,
#     alibi_slopes=None, deterministic=False, attn_type=AttnType.FA) -> (dq, dk, dv)
def ring_flash_attn_backward(process_group, dout, q, k, v, out, softmax_lse, softmax_scale, dropout_p=0,
                             causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, attn_type="auto"):
    """``(dq, dk, dv)`` of the basic ring over ``process_group``: usp-hal's ring forward is run
    again with autograd and differentiated (``out``/``softmax_lse`` are not read)."""
    if dropout_p:
        raise YunchangUnsupported("ring_flash_attn_backward(dropout_p>0): the dropout mask of the forward is not "
                                  "kept, so a recomputed backward would draw another; use "
                                  "usp_hal.LongContextAttention (one autograd graph) or dropout_p=0")
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        o, _ = _basic_ring(process_group, *leaves, softmax_scale, dropout_p, causal, window_size, softcap,
                           alibi_slopes, deterministic, attn_type, None)
        dq, dk, dv = torch.autograd.grad(o, leaves, dout)
    return dq, dk, dv


class RingFlashAttnFunc(torch.autograd.Function):
    """yunchang/ring/ring_flash_attn.py (v0.6.4): ``RingFlashAttnFunc.apply(q, k, v, dropout_p,
    softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_softmax, group,
    attn_type, attn_processor)``: ``out``, or ``(out, lse, None)`` with ``return_softmax``.  A
    subclass that overrides ``forward`` (as xDiT's does) and saves ``(q, k, v, out, lse)`` keeps
    this backward."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, group, attn_type, attn_processor):
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        if alibi_slopes is not None:
            raise YunchangUnsupported("RingFlashAttnFunc with alibi_slopes: yunchang's asserts it is None; "
                                      "use usp_hal.LongContextAttention(...)(..., alibi_slopes=...)")
        out, lse = ring_flash_attn_forward(group, q, k, v, softmax_scale=softmax_scale, dropout_p=dropout_p,
                                           causal=causal, window_size=window_size, softcap=softcap,
                                           alibi_slopes=alibi_slopes, deterministic=False, attn_type=attn_type,
                                           attn_processor=attn_processor)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.dropout_p, ctx.softmax_scale, ctx.causal, ctx.window_size = dropout_p, softmax_scale, causal, window_size
        ctx.softcap, ctx.alibi_slopes, ctx.deterministic = softcap, alibi_slopes, deterministic
        ctx.group, ctx.attn_type, ctx.attn_processor = group, attn_type, attn_processor
        return out if not return_softmax else (out, lse, None)

    @staticmethod
    def backward(ctx, dout, *args):
        if getattr(ctx, "attn_processor", None) is not None:
            raise YunchangUnsupported("RingFlashAttnFunc backward with attn_processor: the processor is a "
                                      "forward-only kernel (as in yunchang); train with attn_processor=None")
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_flash_attn_backward(ctx.group, dout, q, k, v, out, lse, softmax_scale=ctx.softmax_scale,
                                              dropout_p=ctx.dropout_p, causal=ctx.causal,
                                              window_size=ctx.window_size, softcap=ctx.softcap,
                                              alibi_slopes=ctx.alibi_slopes, deterministic=ctx.deterministic,
                                              attn_type=ctx.attn_type)
        return (dq, dk, dv) + (None,) * 11


def _varlen_refused(name: str, tensors: Tuple[str, ...]):
    """A function with the signature of yunchang's ``name`` (``*tensors, cu_seqlens, max_seqlen,
    dropout_p=0.0, ..., group=None``; yunchang/ring/ring_flash_attn_varlen.py and
    zigzag_ring_flash_attn_varlen.py) that refuses every call."""
    def refuse(*args, **kwargs):
        raise NotImplementedError(
            f"{name}: yunchang's varlen ring takes each rank's own cu_seqlens of its local tokens; usp-hal packs "
            "documents with one global cu_seqlens: call usp_hal.LongContextAttention(ring_impl_type='basic' or "
            "'varlen_zigzag', ...)(q, k, v, cu_seqlens=global_boundaries) on inputs sharded with "
            "usp_hal.shard(x, layout=..., cu_seqlens=global_boundaries)")
    P = inspect.Parameter
    params = [P(t, P.POSITIONAL_OR_KEYWORD) for t in (*tensors, "cu_seqlens", "max_seqlen")]
    params += [P(n, P.POSITIONAL_OR_KEYWORD, default=d) for n, d in (
        ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
        ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False), ("group", None))]
    refuse.__signature__ = inspect.Signature(params)        # type: ignore[attr-defined]
    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"yunchang 0.6.4's {name}: refused (its cu_seqlens are per rank; see usp_hal.compat)."
    return refuse


ring_flash_attn_varlen_func = _varlen_refused("ring_flash_attn_varlen_func", ("q", "k", "v"))
ring_flash_attn_varlen_kvpacked_func = _varlen_refused("ring_flash_attn_varlen_kvpacked_func", ("q", "kv"))
ring_flash_attn_varlen_qkvpacked_func = _varlen_refused("ring_flash_attn_varlen_qkvpacked_func", ("qkv",))
zigzag_ring_flash_attn_varlen_func = _varlen_refused("zigzag_ring_flash_attn_varlen_func", ("q", "k", "v"))
zigzag_ring_flash_attn_varlen_qkvpacked_func = _varlen_refused("zigzag_ring_flash_attn_varlen_qkvpacked_func",
                                                               ("qkv",))

#: yunchang/hybrid/utils.py ``RING_IMPL_DICT``
RING_IMPL_DICT = {
    "basic": ring_flash_attn_func,
    "zigzag": zigzag_ring_flash_attn_func,
    "strip": stripe_flash_attn_func,
    "basic_pytorch": ring_pytorch_attn_func,
    "basic_flashinfer": ring_flashinfer_attn_func,
    "basic_npu": ring_npu_flash_attn_func,
}

#: yunchang/hybrid/utils.py ``RING_IMPL_QKVPACKED_DICT``
RING_IMPL_QKVPACKED_DICT = {
    "basic": ring_flash_attn_qkvpacked_func,
    "zigzag": zigzag_ring_flash_attn_qkvpacked_func,
    "strip": stripe_flash_attn_qkvpacked_func,
    "basic_flashinfer": ring_flashinfer_attn_qkvpacked_func,
}

# yunchang/comm/extract_local.py's functions by their names
basic_extract_local = EXTRACT_FUNC_DICT["basic"]
zigzag_extract_local = EXTRACT_FUNC_DICT["zigzag"]
stripe_extract_local = EXTRACT_FUNC_DICT["strip"]

#: the names this module adds to ``usp_hal`` (yunchang 0.6.4's top-level functions and tables)
YUNCHANG_NAMES = (
    "RING_IMPL_DICT", "RING_IMPL_QKVPACKED_DICT", "basic_extract_local", "zigzag_extract_local",
    "stripe_extract_local", "ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func", "ring_flash_attn_varlen_qkvpacked_func",
    "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func", "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func", "zigzag_ring_flash_attn_varlen_qkvpacked_func", "stripe_flash_attn_func",
    "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func", "ring_pytorch_attn_func",
    "ring_flashinfer_attn_func", "ring_flashinfer_attn_kvpacked_func", "ring_flashinfer_attn_qkvpacked_func",
    "ring_npu_flash_attn_func",
)

__all__ = ["mesh_of_group", "processor_backend", "processor_attn_type", *YUNCHANG_NAMES]
