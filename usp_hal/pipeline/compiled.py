"""torch.compile support: the whole USP call as one ``torch.library`` custom op.

Under ``torch.compile`` (``torch.compiler.is_compiling()``), ``LongContextAttention.forward``
(and the QKV-packed and async classes, which share it) does nothing but compute a few
numbers and call ``torch.ops.usp_hal.attention``: an opaque op with a fake implementation
(output shapes), so Dynamo traces it without graph breaks (``fullgraph=True`` works) and
the collectives, the metadata check and the backend choice run inside it, eagerly, through
the same pipeline as eager mode (:mod:`usp_hal.pipeline`).  Its autograd formula calls
``torch.ops.usp_hal.attention_backward``, which runs the pipeline's one backward loop.  The
lse returned by ``return_lse=True`` stays differentiable so that a gradient reaching it is
refused, as in eager mode, on every rank (:func:`refuse_lse_gradient`), not dropped.

The op's scalar arguments are the call's :class:`~usp_hal.pipeline.CallOptions` as one
string, so a new call option needs no change here.  The backward op gets the call's
inputs, output, log-sum-exp and every rank's length (an int64 output of the forward op)
and rebuilds the plan without any metadata exchange; the backward loop moves q, k, v, the
output, its lse and the output gradient to the head layout in three all-to-alls (q/k/v/out
in one, the output gradient in a second, the lse in a third; one of bytes when their
dtypes or head dims differ: :meth:`~usp_hal.parallel.ulysses.UlyssesExchange.saved_to_heads`) (eager mode
keeps the head-layout tensors from the forward instead; a compiled graph can only save
tensors whose shapes it knows, and those depend on the other ranks' lengths).  With the
fp8 wire format the backward then sees the output after its fp8 round trip (eager:
before); the gradient is still the straight-through one.

A pipeline is found from the graph by an integer handle (a weak registry), so a compiled
graph holds no reference to its module.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import CallOptions, pipeline_of, sink_options
from . import run as _run
from .options import Sinks
from .validate import joint_info

#: The version of the ops' autograd formula, an argument of the forward op: a persistent compile
#: cache (AOTAutograd's, Inductor's) keys a graph by its ops and their arguments, not by the
#: Python that registers an op's backward, so a change of that formula bumps this number and a
#: graph compiled with the former one is not reused.  2: the returned lse's gradient is refused.
FORMULA = 2


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _prepare(handle: int, q, k, v, alibi_slopes, options: str, with_lse: bool, sinks=None, **kw):
    """The call's plan (the backward needs the lse, so a call with gradients computes it)."""
    pipe = pipeline_of(handle)
    mesh = pipe.resolve_mesh()
    opts = CallOptions.decode(options)
    if sinks is not None:     # compared across ranks by value (and whether they take a gradient)
        opts = sink_options(pipe, opts, sinks, opts.sinks == Sinks.GIVEN_GRAD)
    if with_lse and not opts.return_lse:
        opts = opts.with_(return_lse=True)
    joint = joint_info(mesh, opts.joint_strategy, opts.joint_total)
    return pipe.prepare(mesh, q, k, v, opts, alibi_slopes=alibi_slopes, joint=joint, **kw)[1]


# ------------------------------------------------------------------------------------ forward op
@torch.library.custom_op("usp_hal::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: Optional[torch.Tensor],
                 sinks: Optional[torch.Tensor], handle: int, options: str, need_grad: bool, sp_size: int,
                 formula: int
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = _prepare(handle, q, k, v, alibi_slopes, options, need_grad, sinks=sinks, needs_grad=need_grad)
    with torch.no_grad():
        out, lse, _ = _run.forward(plan, q, k, v, keep=False, sinks=sinks)
    lengths = torch.tensor(list(plan.spec_lengths), dtype=torch.int64)
    if lse is None:
        lse = q.new_empty(0, dtype=_lse_dtype(q.dtype))
    out, lse = _unaliased((out.contiguous(), lse.contiguous()), (q, k, v, alibi_slopes, sinks))
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
def _attention_fake(q, k, v, alibi_slopes, sinks, handle, options, need_grad, sp_size, formula):
    b, s, h, _ = q.shape
    with_lse = need_grad or CallOptions.decode(options).return_lse
    out = q.new_empty((b, s, h, v.shape[3]))
    lse = q.new_empty((b, h, s) if with_lse else (0,), dtype=_lse_dtype(q.dtype))
    return out, lse, torch.empty(sp_size, dtype=torch.int64)


# ------------------------------------------------------------------------------------ backward op
def refuse_lse_gradient(handle: int, dlse: torch.Tensor) -> None:
    """Eager's refusal of a gradient through the lse that ``return_lse=True`` returned (the
    backward carries the output's gradient only), on every rank before any collective of the
    backward: this rank reads whether a non-zero gradient reached its lse (one device->host
    read, only in the backward of a compiled call that returns the lse) and the ranks agree
    on it (one small all-gather of integers on the mesh's CPU side group).  A compiled graph
    hands the backward a zero gradient for an lse the loss does not use: that one passes."""
    from ..parallel import comm
    mesh = pipeline_of(handle).resolve_mesh()
    reached = dlse.numel() > 0 and bool(dlse.ne(0).any())       # NaN counts as reached
    comm.agree(RuntimeError(_run.LSE_GRADIENT) if reached else None, mesh.metadata_group,
               what="usp_hal attention backward (gradient of the returned lse)", where=mesh.where("sequence-parallel"),
               ranks=mesh.sp_ranks)


@torch.library.custom_op("usp_hal::attention_backward", mutates_args=())
def attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, lengths: torch.Tensor,
                          alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor], handle: int,
                          options: str, dlse: Optional[torch.Tensor] = None
                          ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from . import one_group
    if dlse is not None:
        refuse_lse_gradient(handle, dlse)
    plan = _prepare(handle, q, k, v, alibi_slopes, options, True, needs_grad=True,
                    lengths=[int(x) for x in lengths.tolist()], head_groups=one_group)
    dsinks = _run.sink_grad_buffer(sinks) if sinks is not None else None
    dq, dk, dv = _run.backward(plan, dout, seq=(q, k, v, out, lse), sinks=sinks, dsinks=dsinks)
    ds = dsinks.to(sinks.dtype) if dsinks is not None and sinks is not None else q.new_empty(0)
    # contiguous, as the fake kernel says: the inputs may be strided views (a model's q taken
    # out of a wider projection), and a kernel's own gradient may come back transposed
    return _unaliased(tuple(t.contiguous() for t in (dq, dk, dv, ds)), (dout, q, k, v, out, lse))


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, lengths, alibi_slopes, sinks, handle, options, dlse=None):
    ds = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), ds


def _setup_context(ctx, inputs, output):
    q, k, v, alibi, sinks, handle, options, _need, _sp, _formula = inputs
    out, lse, lengths = output
    ctx.save_for_backward(q, k, v, out, lse, lengths, sinks)
    ctx.args = (alibi, handle, options)
    ctx.mark_non_differentiable(lengths)
    # the lse the caller gets (return_lse=True) stays differentiable, so that a gradient reaching
    # it is refused as in eager rather than dropped; the one kept for the backward alone is not
    ctx.returns_lse = CallOptions.decode(options).return_lse
    if not ctx.returns_lse:
        ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse, _dlengths):
    q, k, v, out, lse, lengths, sinks = ctx.saved_tensors
    alibi, handle, options = ctx.args
    dlse = dlse if ctx.returns_lse else None
    dq, dk, dv, ds = torch.ops.usp_hal.attention_backward(dout.contiguous(), q, k, v, out, lse, lengths, alibi,
                                                          sinks, handle, options, dlse)
    return dq, dk, dv, None, (ds if sinks is not None else None), None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------ the traced part
def compiled_forward(pipe, q, k, v, opts: CallOptions, alibi_slopes, positions, joint, sinks=None):
    """What ``LongContextAttention.forward`` does under torch.compile: plain Python on
    static values, then the custom op.  ``joint``: the checked joint tokens (or None)."""
    if opts.dropout_p:
        raise NotImplementedError("dropout_p > 0 is refused in sequence-parallel attention (see the eager error)")
    if positions is not None:
        raise NotImplementedError("positions= is a debugging check of eager mode; drop it under torch.compile")
    mesh = pipe.resolve_mesh()
    if joint is not None:
        q, k, v = joint.extend(q, k, v)
        opts = opts.with_(joint_strategy=joint.strategy, joint_total=joint.total)
    opts = opts.literal()
    need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                             or (sinks is not None and sinks.requires_grad))
    if sinks is not None:
        opts = opts.with_(sinks=Sinks.given(True, torch.is_grad_enabled() and sinks.requires_grad))
    out, lse, _ = torch.ops.usp_hal.attention(q, k, v, alibi_slopes, sinks, pipe.handle, opts.encode(), need_grad,
                                              mesh.sp_size, FORMULA)
    return out, (lse if opts.return_lse else None)
