"""torch.compile support: the whole USP call as one ``torch.library`` custom op.

Under ``torch.compile`` (``torch.compiler.is_compiling()``), ``LongContextAttention.forward``
(and the QKV-packed and async classes, which share it) does nothing but compute a few
numbers and call ``torch.ops.usp_hal.attention``: an opaque op with a fake implementation
(output shapes), so Dynamo traces it without graph breaks (``fullgraph=True`` works) and
the collectives, the metadata check and the backend choice run inside it, eagerly, as in
eager mode.  Its autograd formula calls ``torch.ops.usp_hal.attention_backward``.

The backward op gets the call's inputs, output, log-sum-exp and every rank's length (an
int64 output of the forward op) and rebuilds the plan without any metadata exchange; it
moves q, k, v, the output, its lse and the output gradient to the head layout in one
all-to-all (eager mode keeps the head-layout tensors from the forward instead; a compiled
graph can only save tensors whose shapes it knows, and those depend on the other ranks'
lengths).  With the fp8 wire format the backward then sees the output after its fp8 round
trip (eager: before); the gradient is still the straight-through one.

A module is found from the graph by an integer handle (a weak registry), so a compiled
graph holds no reference to it.
"""
from __future__ import annotations

import itertools
import math
import weakref
from typing import List, Optional, Tuple

import torch

_MODULES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def register_module(module) -> int:
    handle = next(_NEXT)
    _MODULES[handle] = module
    return handle


def _module(handle: int):
    mod = _MODULES.get(handle)
    if mod is None:
        raise RuntimeError(f"usp_hal: the attention module of this compiled graph (handle {handle}) no longer exists")
    return mod


class _JointInfo:
    """What the plan needs of joint tokens once they are part of the rows (no tensors)."""

    def __init__(self, strategy: str, total: int, start: int, count: int):
        self.strategy, self.total, self.start, self.count = strategy, total, start, count


def _joint_info(mod, strategy: str, total: int) -> Optional[_JointInfo]:
    if strategy == "none":
        return None
    from .attention import _share
    from .mesh import get_default_mesh
    mesh = mod.mesh if mod.mesh is not None else get_default_mesh()
    start, count = _share(total, mesh.sp_size, mesh.sp_rank)
    return _JointInfo(strategy, total, start, count)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------ forward op
@torch.library.custom_op("usp_hal::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int, causal: bool, scale: float,
                 window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
                 deterministic: bool, return_lse: bool, need_grad: bool, joint_strategy: str,
                 joint_total: int, sp_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .attention import _forward
    from .mesh import get_default_mesh
    mod = _module(handle)
    mesh = mod.mesh if mod.mesh is not None else get_default_mesh()
    _, plan = mod._prepare(mesh, q, k, v, 0.0, scale, causal, (window_left, window_right), softcap, alibi_slopes,
                           deterministic, return_lse or need_grad, None, _joint_info(mod, joint_strategy, joint_total),
                           needs_grad=need_grad)
    with torch.no_grad():
        out, lse, _ = _forward(plan, q, k, v, keep=False)
    lengths = torch.tensor(_lengths(mod, plan), dtype=torch.int64)
    if lse is None:
        lse = q.new_empty(0, dtype=_lse_dtype(q.dtype))
    out, lse = _unaliased((out, lse), (q, k, v, alibi_slopes))
    return out, lse, lengths


def _unaliased(outputs, inputs):
    """Custom-op outputs may not share memory with inputs or each other: copy those that do
    (e.g. dk/dv of one ring block buffer; the ring's own block is a view in some paths)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor) and t.numel()}
    res = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        if ptr is not None:
            seen.add(ptr)
        res.append(t)
    return tuple(res)


@attention_op.register_fake
def _attention_fake(q, k, v, handle, causal, scale, window_left, window_right, softcap, alibi_slopes, deterministic,
                    return_lse, need_grad, joint_strategy, joint_total, sp_size):
    b, s, h, _ = q.shape
    out = q.new_empty((b, s, h, v.shape[3]))
    lse = q.new_empty((b, h, s) if (return_lse or need_grad) else (0,), dtype=_lse_dtype(q.dtype))
    return out, lse, torch.empty(sp_size, dtype=torch.int64)


def _lengths(mod, plan) -> List[int]:
    """Every rank's local length (sequence-parallel order), as the plan was built from."""
    return list(plan.spec_lengths)


# ------------------------------------------------------------------------------------ backward op
@torch.library.custom_op("usp_hal::attention_backward", mutates_args=())
def attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, lengths: torch.Tensor, handle: int, causal: bool,
                          scale: float, window_left: int, window_right: int, softcap: float,
                          alibi_slopes: Optional[torch.Tensor], deterministic: bool, joint_strategy: str,
                          joint_total: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .attention import LongContextAttention
    from .mesh import get_default_mesh
    from .ring import ring_backward
    mod = _module(handle)
    mesh = mod.mesh if mod.mesh is not None else get_default_mesh()
    _, plan = mod._prepare(mesh, q, k, v, 0.0, scale, causal, (window_left, window_right), softcap, alibi_slopes,
                           deterministic, True, None, _joint_info(mod, joint_strategy, joint_total), needs_grad=True,
                           lengths=[int(x) for x in lengths.tolist()],
                           head_groups=LongContextAttention._head_groups)
    st = plan.stages[0]
    qh, kh, vh, outh, douth, lse_h = st.exchange.saved_to_heads(q, k, v, out, dout, lse)
    dq, dk, dv = ring_backward(st.ring, douth, qh, kh, vh, outh, lse_h)
    return _unaliased(st.exchange.grads_to_seq(dq, dk, dv, q.dtype), (dout, q, k, v, out, lse))


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, lengths, handle, causal, scale, window_left, window_right,
                             softcap, alibi_slopes, deterministic, joint_strategy, joint_total):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_ARGS = ("handle", "causal", "scale", "window_left", "window_right", "softcap", "alibi_slopes", "deterministic")


def _setup_context(ctx, inputs, output):
    q, k, v, handle, causal, scale, wl, wr, softcap, alibi, det, _ret, _need, strategy, total, _sp = inputs
    out, lse, lengths = output
    ctx.save_for_backward(q, k, v, out, lse, lengths)
    ctx.args = (handle, causal, scale, wl, wr, softcap, alibi, det, strategy, total)
    ctx.mark_non_differentiable(lse, lengths)


def _backward(ctx, dout, _dlse, _dlengths):
    q, k, v, out, lse, lengths = ctx.saved_tensors
    handle, causal, scale, wl, wr, softcap, alibi, det, strategy, total = ctx.args
    dq, dk, dv = torch.ops.usp_hal.attention_backward(dout.contiguous(), q, k, v, out, lse, lengths, handle, causal,
                                                      scale, wl, wr, softcap, alibi, det, strategy, total)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------ the traced part
def compiled_forward(mod, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                     deterministic, return_attn_probs, positions, jq, jk, jv, joint_strategy):
    """What ``LongContextAttention.forward`` does under torch.compile: plain Python on
    static values, then the custom op."""
    from .mesh import get_default_mesh
    if dropout_p:
        raise NotImplementedError("dropout_p > 0 is refused in sequence-parallel attention (see the eager error)")
    if positions is not None:
        raise NotImplementedError("positions= is a debugging check of eager mode; drop it under torch.compile")
    mesh = mod.mesh if mod.mesh is not None else get_default_mesh()
    strategy = "none" if joint_strategy in (None, "none") else joint_strategy
    total = 0
    if strategy != "none":
        joint = mod._joint(mesh, q, jq, jk, jv, strategy)
        q, k, v = joint.extend(q, k, v)
        total = joint.total
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    wl, wr = int(window_size[0]), int(window_size[1])
    need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    out, lse, _ = torch.ops.usp_hal.attention(q, k, v, mod._handle, bool(causal), scale, wl, wr, float(softcap),
                                              alibi_slopes, bool(deterministic), bool(return_attn_probs), need_grad,
                                              strategy, total, mesh.sp_size)
    return (out, lse) if return_attn_probs else out
