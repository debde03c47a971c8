"""Async Ulysses: overlap the q/k/v all-to-alls with the q/k/v projections.

:func:`async_qkv_attention` takes the hidden states and the three projections and starts
the all-to-all of q while k is projected, k's while v is projected, then runs the ring
and the output all-to-all as :class:`~usp_hal.LongContextAttention` does::

    out = usp_hal.async_qkv_attention(attn, hidden, model.to_q, model.to_k, model.to_v,
                                      heads=24, head_dim=128, causal=False)

Each projection returns ``[B, S_local, heads * head_dim]`` or ``[B, S_local, heads,
head_dim]``.  The result equals ``attn(q, k, v, ...)`` in forward and backward (the
backward's all-to-alls run one after another).

The cross-rank check runs before the first all-to-all, so it checks q and the declared
shapes of k and v (``kv_heads``, ``head_dim``, ``v_head_dim``); a projection that returns
another shape raises on its rank, and its peers stop at the group timeout.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .attention import LongContextAttention, _nan_guard
from .mesh import get_default_mesh
from .ring import ring_backward, ring_forward
from .ulysses import UlyssesExchange


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


class _ToHeads(torch.autograd.Function):
    """Start one tensor's sequence->heads all-to-all; the returned buffer is filled once
    the handle appended to ``pending`` is waited on.  Backward: heads->sequence."""

    @staticmethod
    def forward(ctx, x, exchange: UlyssesExchange, name: str, pending: list):
        kind = "q" if name == "q" else "kv"
        p = exchange.start_heads(x, kind, async_op=True, what="forward, overlapped with the projections", name=name)
        pending.append(p)
        ctx.exchange, ctx.kind, ctx.dtype = exchange, kind, x.dtype
        return p.result

    @staticmethod
    def backward(ctx, g):
        return ctx.exchange.heads_to_seq(g, ctx.kind, ctx.dtype), None, None, None


class _HeadsAttention(torch.autograd.Function):
    """Ring attention on head-layout q/k/v, then the output all-to-all."""

    @staticmethod
    def forward(ctx, qh, kh, vh, plan):
        st = plan.stages[0]
        ex = st.exchange
        kx, vx = ex._expand(qh, kh, vh)[1:]
        guard = _nan_guard(qh)
        out_acc, lse_h = ring_forward(st.ring, qh, kx, vx)
        keep = plan.spec.needs_grad
        lse_h = lse_h + guard.squeeze(-1).transpose(1, 2).to(lse_h.dtype)
        out, lse, outh = ex.out_to_seq(out_acc, plan.dtype, lse_h if plan.spec.return_lse else None, guard,
                                       keep_heads=keep)
        ctx.plan = plan
        ctx.save_for_backward(qh, kx, vx, outh, lse_h)
        if lse is not None:
            ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        plan = ctx.plan
        st = plan.stages[0]
        ex = st.exchange
        qh, kx, vx, outh, lse_h = ctx.saved_tensors
        douth = ex.dout_to_heads(dout)
        dq, dk, dv = ring_backward(st.ring, douth, qh, kx, vx, outh, lse_h)
        exp = ex.plan.kv_expand[ex.rank]
        if exp is not None:   # repeated KV heads: their gradients go back to the received ones
            a, c = ex.plan.kv[ex.rank]
            idx = torch.tensor(exp, dtype=torch.long, device=dk.device)
            dk = dk.new_zeros(dk.shape[0], dk.shape[1], c - a, dk.shape[3]).index_add_(2, idx, dk)
            dv = dv.new_zeros(dv.shape[0], dv.shape[1], c - a, dv.shape[3]).index_add_(2, idx, dv)
        return dq.to(plan.dtype), dk.to(plan.dtype), dv.to(plan.dtype), None


def _params_need_grad(fn) -> bool:
    params = getattr(fn, "parameters", None)
    return callable(params) and any(p.requires_grad for p in params())


def async_qkv_attention(attn: LongContextAttention, hidden: torch.Tensor, q_proj: Callable, k_proj: Callable,
                        v_proj: Callable, *, heads: int, kv_heads: Optional[int] = None,
                        head_dim: Optional[int] = None, v_head_dim: Optional[int] = None, causal: bool = False,
                        softmax_scale=None, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                        deterministic: bool = False, return_attn_probs: bool = False, cu_seqlens=None):
    """Project q, k, v from ``hidden`` and run ``attn`` on them, each all-to-all in flight
    while the next projection computes (see the module doc).  Returns what
    ``attn(q, k, v, ...)`` returns; ``cu_seqlens``: packed documents, as for ``attn``."""
    if not isinstance(attn, LongContextAttention):
        raise TypeError(f"attn must be a usp_hal.LongContextAttention, got {type(attn).__name__}")
    mesh = attn.mesh if attn.mesh is not None else get_default_mesh()
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
              alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs,
              cu_seqlens=cu_seqlens)
    q = _as_heads(q_proj(hidden), heads, head_dim, "q_proj")
    kvh = kv_heads or heads
    d = q.shape[-1]
    dv = v_head_dim or d
    if mesh.ulysses_degree == 1 or type(attn)._head_groups is not LongContextAttention._head_groups:
        # nothing to overlap (or the module pipelines head groups itself): project, then attend
        k = _as_heads(k_proj(hidden), kvh, d, "k_proj")
        v = _as_heads(v_proj(hidden), kvh, dv, "v_proj")
        return attn(q, k, v, **kw)
    b, s = q.shape[0], q.shape[1]
    grad = torch.is_grad_enabled() and (q.requires_grad or hidden.requires_grad or _params_need_grad(k_proj)
                                        or _params_need_grad(v_proj))
    kp = q.new_zeros((), requires_grad=grad).expand(b, s, kvh, d)     # declared shapes, no memory
    vp = q.new_zeros((), requires_grad=grad).expand(b, s, kvh, dv)
    _, plan = attn._prepare(mesh, q, kp, vp, 0.0, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            deterministic, return_attn_probs, None, None, cu_seqlens=cu_seqlens)
    ex = plan.stages[0].exchange
    pending: list = []
    qh = _ToHeads.apply(q, ex, "q", pending)
    k = _as_heads(k_proj(hidden), kvh, d, "k_proj")
    _check_like(k, (b, s, kvh, d), q, "k_proj")
    kh = _ToHeads.apply(k, ex, "k", pending)
    v = _as_heads(v_proj(hidden), kvh, dv, "v_proj")
    _check_like(v, (b, s, kvh, dv), q, "v_proj")
    vh = _ToHeads.apply(v, ex, "v", pending)
    for p in pending:
        p.wait()
    out, lse = _HeadsAttention.apply(qh, kh, vh, plan)
    return (out, lse) if return_attn_probs else out


def _check_like(x: torch.Tensor, shape, q: torch.Tensor, what: str) -> None:
    if tuple(x.shape) != tuple(shape) or x.dtype != q.dtype or x.device != q.device:
        raise ValueError(f"{what} returned {tuple(x.shape)} {x.dtype} on {x.device}; declared "
                         f"{tuple(shape)} {q.dtype} on {q.device} (pass kv_heads/head_dim/v_head_dim that match)")
