"""Async Ulysses: overlap the q/k/v all-to-alls with the q/k/v projections.

:func:`async_qkv_attention` takes the hidden states and the three projections and starts
the all-to-all of q while k is projected, k's while v is projected, then runs the ring
and the output all-to-all as :class:`~usp_hal.LongContextAttention` does::

    out = usp_hal.async_qkv_attention(attn, hidden, model.to_q, model.to_k, model.to_v,
                                      heads=24, head_dim=128, causal=False)

Each projection returns ``[B, S_local, heads * head_dim]`` or ``[B, S_local, heads,
head_dim]``.  The result equals ``attn(q, k, v, ...)`` in forward and backward: the call
is the module's own autograd node (:mod:`usp_hal.pipeline.run`), fed with the all-to-alls
this function started, so its backward is the module's (dq, dk and dv in one all-to-all).

The cross-rank check runs before the first all-to-all, so it checks q and the declared
shapes of k and v (``kv_heads``, ``head_dim``, ``v_head_dim``); a projection that returns
another shape raises on its rank, and its peers stop at the group timeout.
"""
from __future__ import annotations

import inspect
from typing import Callable, Optional, Tuple

import torch

from .attention import LongContextAttention
from .pipeline import CallOptions
from .pipeline import run as _run


def _as_heads(x: torch.Tensor, heads: int, head_dim: Optional[int], what: str) -> torch.Tensor:
    if x.dim() == 4:
        return x
    if x.dim() == 3:
        if head_dim is None:
            if x.shape[-1] % heads:
                raise ValueError(f"{what}: last dim {x.shape[-1]} is not a multiple of heads={heads}")
            head_dim = x.shape[-1] // heads
        return x.view(x.shape[0], x.shape[1], heads, head_dim)
    raise ValueError(f"{what} must return [B, S, H*D] or [B, S, H, D], got shape {tuple(x.shape)}")


def _params_need_grad(fn) -> bool:
    params = getattr(fn, "parameters", None)
    return callable(params) and any(p.requires_grad for p in params())


#: keywords of ``LongContextAttention.forward`` that :meth:`CallOptions.of` takes but this
#: function does not: each needs tensors beside the options that only the module's forward takes
_MODULE_ONLY = ("mask", "sinks", "joint_strategy", "joint_total")


def _call_options(options: dict) -> Tuple[CallOptions, Optional[torch.Tensor]]:
    """``options`` (the call keywords of ``LongContextAttention.forward``) as the call's
    :class:`CallOptions` and its alibi slopes, which travel beside them; an unknown keyword, or
    one that needs the module's own forward, is refused with a TypeError naming it."""
    rest = dict(options)
    alibi_slopes = rest.pop("alibi_slopes", None)
    module_only = [n for n in rest if n in _MODULE_ONLY]
    if module_only:
        raise TypeError(f"async_qkv_attention() does not take {', '.join(module_only)}: each needs tensors that only "
                        "LongContextAttention.forward takes; project q, k and v, then call attn(q, k, v, ...)")
    try:
        return CallOptions.of(**rest), alibi_slopes
    except TypeError as exc:
        takes = [n for n in inspect.signature(CallOptions.of).parameters if n not in _MODULE_ONLY]
        raise TypeError(f"async_qkv_attention(): {exc}; the call options it takes are those of "
                        f"LongContextAttention.forward: {', '.join(sorted(takes + ['alibi_slopes']))}") from None


def async_qkv_attention(attn: LongContextAttention, hidden: torch.Tensor, q_proj: Callable, k_proj: Callable,
                        v_proj: Callable, *, heads: int, kv_heads: Optional[int] = None,
                        head_dim: Optional[int] = None, v_head_dim: Optional[int] = None, cu_seqlens=None,
                        **options):
    """Project q, k, v from ``hidden`` and run ``attn`` on them, each all-to-all in flight
    while the next projection computes (see the module doc).  ``options``: the call keywords
    of ``attn(q, k, v, ...)`` (``LongContextAttention.forward``: ``causal``, ``softmax_scale``,
    ``window_size``, ``alibi_slopes``, ``return_lse``, ...; not ``mask``, ``sinks`` or joint
    tokens), with its defaults.  Returns what ``attn(q, k, v, **options)`` returns;
    ``cu_seqlens``: packed documents, as for ``attn``."""
    if not isinstance(attn, LongContextAttention):
        raise TypeError(f"attn must be a usp_hal.LongContextAttention, got {type(attn).__name__}")
    opts, alibi_slopes = _call_options(options)
    mesh = attn.pipeline.resolve_mesh()
    q = _as_heads(q_proj(hidden), heads, head_dim, "q_proj")
    kvh = kv_heads or heads
    d = q.shape[-1]
    dv = v_head_dim or d
    if mesh.ulysses_degree == 1 or type(attn)._head_groups is not LongContextAttention._head_groups \
            or attn.low_memory:
        # nothing to overlap (or the module pipelines head groups itself, or runs them one after
        # another to save memory): project, then attend
        k = _as_heads(k_proj(hidden), kvh, d, "k_proj")
        v = _as_heads(v_proj(hidden), kvh, dv, "v_proj")
        return attn(q, k, v, **options, cu_seqlens=cu_seqlens)
    b, s = q.shape[0], q.shape[1]
    grad = torch.is_grad_enabled() and (q.requires_grad or hidden.requires_grad or _params_need_grad(k_proj)
                                        or _params_need_grad(v_proj))
    kp = q.new_zeros((), requires_grad=grad).expand(b, s, kvh, d)     # declared shapes, no memory
    vp = q.new_zeros((), requires_grad=grad).expand(b, s, kvh, dv)
    pipe = attn.pipeline
    _, plan = pipe.prepare(mesh, q, kp, vp, opts, alibi_slopes=alibi_slopes, needs_grad=grad,
                           cu_seqlens=cu_seqlens)
    ex = plan.stages[0].exchange
    what = "forward, overlapped with the projections"
    # each all-to-all starts as soon as its projection is done; the call's one autograd
    # node (the same forward and backward as the module's) takes q, k, v with their
    # head-layout copies already in flight
    pending = [ex.start_heads(q, "q", async_op=True, what=what, name="q")]
    k = _as_heads(k_proj(hidden), kvh, d, "k_proj")
    _check_like(k, (b, s, kvh, d), q, "k_proj")
    pending.append(ex.start_heads(k, "kv", async_op=True, what=what, name="k"))
    v = _as_heads(v_proj(hidden), kvh, dv, "v_proj")
    _check_like(v, (b, s, kvh, dv), q, "v_proj")
    pending.append(ex.start_heads(v, "kv", async_op=True, what=what, name="v"))
    out, lse = _run.run(plan, q, k, v, _run.Received(ex, pending))
    return (out, lse) if opts.return_lse else out


def _check_like(x: torch.Tensor, shape, q: torch.Tensor, what: str) -> None:
    if tuple(x.shape) != tuple(shape) or x.dtype != q.dtype or x.device != q.device:
        raise ValueError(f"{what} returned {tuple(x.shape)} {x.dtype} on {x.device}; declared "
                         f"{tuple(shape)} {q.dtype} on {q.device} (pass kv_heads/head_dim/v_head_dim that match)")
