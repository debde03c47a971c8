"""Step 4 of a call: one forward and one backward loop over the plan's stages (one stage,
or head groups pipelined against each other's kernels), used by every face: the module's
autograd Function, its forward-only path, the compiled custom op and the async paths.

Forward, per stage: the Ulysses all-to-all of q/k/v (the next stage's is in flight while
this one computes), the ring, the output's all-to-all back.  Backward, per stage: the
output gradient to heads, the ring's backward, dq/dk/dv back in one all-to-all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch

from ..parallel.ring import merge_dtype, ring_backward, ring_forward
from ..parallel.ulysses import Done
from .plan import CallPlan

#: Timing hooks (the harness installs one; empty, the loops below pay one ``if`` per step).
#: Each is called as ``hook(step)`` when a step of the loops begins: ``"exchange"`` (the
#: Ulysses all-to-alls with their packing and unpacking), ``"ring"`` (the ring's kernels,
#: merges and rotation), ``None`` (the loop is done).
HOOKS: List[Callable[[Optional[str]], None]] = []


def step(name: Optional[str]) -> None:
    for hook in HOOKS:
        hook(name)


def nan_guard(qh: torch.Tensor) -> torch.Tensor:
    """``[B, S, h, 1]`` in ``qh``'s dtype: 0 for rows whose query is finite, NaN otherwise
    (some kernels return a finite row for a non-finite query; adding this keeps
    single-device semantics).  One launch: the rows times a zero column (``x * 0`` is 0 for
    any finite ``x`` and NaN for NaN or inf; a sum of the row would overflow to inf for
    large finite values)."""
    return torch.matmul(qh, _zeros(qh, 1))


def guard_of(plan: CallPlan, own: bool, keep: bool) -> Optional[str]:
    """How a forward keeps a non-finite query's row non-finite (some kernels return a finite
    row for it): None, no guard (the backend's kernels carry it into the row:
    ``plan.nan_guard`` is False); ``"fold"``, folded into the output in one launch
    (:func:`guard_output`: one Ulysses rank, forward only, no lse returned); ``"add"``, the
    guard column (:func:`nan_guard`) is added to the output in its exchange back and to the
    lse where one is returned or kept."""
    if not plan.nan_guard:
        return None
    return "fold" if own and not (keep or plan.spec.return_lse) else "add"


def guard_output(out: torch.Tensor, qh: torch.Tensor, dtype: torch.dtype):
    """``(out, None)`` with the guard folded into one launch, ``out + q @ 0`` (a new
    ``[B, S, h, Dv]`` tensor in ``dtype``), where ``out`` and ``qh`` are contiguous and in
    ``dtype``; otherwise ``(out, nan_guard(qh))`` for the output's conversion to add."""
    if out.dtype == qh.dtype == dtype and out.is_contiguous() and qh.is_contiguous():
        dv = out.shape[-1]
        return torch.addmm(out.view(-1, dv), qh.view(-1, qh.shape[-1]), _zeros(qh, dv)).view(out.shape), None
    return out, nan_guard(qh)


def _zeros(qh: torch.Tensor, cols: int) -> torch.Tensor:
    key = (qh.shape[-1], cols, qh.dtype, qh.device)
    zero = _ZEROS.get(key)
    if zero is None:
        with torch.inference_mode(False):      # a normal tensor, usable under any grad mode
            zero = _ZEROS[key] = torch.zeros((qh.shape[-1], cols), dtype=qh.dtype, device=qh.device)
    return zero


_ZEROS: dict = {}     # (head dim, columns, dtype, device) -> the zero matrix the guards multiply by


def add_sink(out, lse, sink):
    """A per-head sink logit as one more term of every row's softmax denominator, applied
    once to the ring-merged ``(out [B, S, h, D], lse [B, h, S])``: ``lse' = logaddexp(lse,
    sink)``, ``out' = out * exp(lse - lse')`` (merge dtype).  A row that saw no key keeps out 0."""
    mdt = lse.dtype
    s = sink.to(mdt).view(1, -1, 1)
    new = torch.logaddexp(lse, s)
    w = torch.exp(lse - new)
    return out.to(mdt) * w.transpose(1, 2).unsqueeze(-1), new


def sink_grad(douth, outh, lse, sink):
    """d loss / d sink for one stage's heads: ``-sum over rows of exp(sink - lse') * (dout . out')``."""
    mdt = lse.dtype
    d = (douth.to(mdt) * outh.to(mdt)).sum(-1)                    # [B, S, h]
    p = torch.exp(sink.to(mdt).view(1, 1, -1) - lse.transpose(1, 2))
    return -(p * d).sum((0, 1))


def sink_grad_buffer(sinks):
    """The zeroed merge-dtype buffer :func:`backward` adds each stage's sink gradient into."""
    return torch.zeros(sinks.shape, dtype=merge_dtype(sinks.dtype), device=sinks.device)


@dataclass
class Saved:
    """What one stage's backward needs in the head layout, kept by the forward.  A stage whose
    exchange is one rank's (``own``) keeps only its lse: its q, k, v and output are the
    call's own tensors (views of them), which the autograd node saves (:func:`_local`)."""

    lse: torch.Tensor
    q: Optional[torch.Tensor] = None
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None       # set once the output's exchange back is done

    @property
    def own(self) -> bool:
        return self.q is None

    def heads(self, st, local):
        """``(qh, kh, vh, outh, lse_h)``; ``local``: the call's ``(q, k, v, out)`` for an own stage."""
        if self.own:
            qh, kh, vh = st.exchange.start_qkv(_own_heads(st, local[0]), local[1], local[2]).wait()
            return qh, kh, vh, _own_heads(st, local[3]), self.lse
        return self.q, self.k, self.v, self.out, self.lse


class Received:
    """Stage 0's head-layout q/k/v from all-to-alls the caller already started (the async
    projections path): ``wait()`` waits on each and gives ``(qh, kh, vh)``."""

    def __init__(self, exchange, pendings: Sequence):
        self.exchange, self.pendings = exchange, list(pendings)

    def wait(self):
        q, k, v = (p.wait() for p in self.pendings)
        return self.exchange.expand(q, k, v)


def forward(plan: CallPlan, q, k, v, keep: bool, received: Optional[Received] = None, sinks=None):
    """``(out, lse or None, saved)``; ``saved`` holds per stage what the backward needs
    (a :class:`Saved`) when ``keep``.  ``sinks`` ``[H]``: per-head sink logits
    (:func:`add_sink`, after the ring's merge).

    A ``low_memory`` plan (``plan.sequential``) runs its stages one after another, each
    stage's exchange buffers, K/V blocks and accumulators gone before the next starts, and
    keeps nothing in the head layout: ``saved`` is then ``[lse]`` (full width, for the
    backward's re-exchange) when ``keep``."""
    spec, stages, seq = plan.spec, plan.stages, plan.sequential
    many = len(stages) > 1
    keep_heads = keep and not seq
    want_lse = spec.return_lse or (keep and seq)
    out = lse = None
    if many:   # every stage writes its heads into the full-width results
        b, s = q.shape[0], q.shape[1]
        out = torch.empty((b, s, spec.heads, spec.v_dim), dtype=plan.dtype, device=q.device)
        lse = torch.empty((b, spec.heads, s), dtype=merge_dtype(plan.dtype), device=q.device) \
            if want_lse else None
    saved: List[Saved] = []
    sends: List[Any] = []
    # one Ulysses rank keeps no head-layout copy: its head layout is the rank's own q/k/v and
    # returned output, which the autograd node saves itself (:func:`_local`)
    own = _local(plan)
    guarding = guard_of(plan, own, keep)
    if HOOKS:
        step("exchange")
    pending: Any = received
    for i, st in enumerate(stages):
        if pending is None:
            pending = st.exchange.start_qkv(_own_heads(st, q), k, v, async_op=many and not seq)
        qh, kh, vh = pending.wait()
        pending = None
        if i + 1 < len(stages) and not seq:      # the next stage's q/k/v travel while this one computes
            pending = stages[i + 1].exchange.start_qkv(_own_heads(stages[i + 1], q), k, v, async_op=True)
        guard = nan_guard(qh) if guarding == "add" else None
        if HOOKS:
            step("ring")
        out_acc, lse_h = ring_forward(st.ring, qh, kh, vh)
        if sinks is not None:
            out_acc, lse_h = add_sink(out_acc, lse_h, sinks[st.heads[0]:st.heads[1]])
        if guarding == "fold":
            out_acc, guard = guard_output(out_acc, qh, plan.dtype)
        if HOOKS:
            step("exchange")
        if guard is not None and (keep or spec.return_lse):
            lse_h = lse_h + guard.squeeze(-1).transpose(1, 2).to(lse_h.dtype)
        sent: Any = st.exchange.start_out(out_acc, plan.dtype, lse_h if want_lse else None, guard,
                                          keep_heads=keep_heads and not own, into=out, lse_into=lse,
                                          async_op=many and not seq)
        if seq:       # this stage's buffers go before the next stage's exchange
            sent = Done(sent.wait())
        sends.append(sent)
        if keep_heads:
            saved.append(Saved(lse_h) if own else Saved(lse_h, qh, kh, vh))
        del qh, kh, vh, out_acc, lse_h, guard
    for i, p in enumerate(sends):
        o, l, outh = p.wait()
        if keep_heads and outh is not None:
            saved[i].out = outh
        if not many:
            out, lse = o, l
    if HOOKS:
        step(None)
    if seq:       # low_memory: the full-width lse, for the backward's re-exchange
        return out, (lse if spec.return_lse else None), ([lse] if keep else [])
    return out, lse, saved


def backward(plan: CallPlan, dout, saved=None, seq=None, sinks=None, dsinks=None, local=None):
    """``(dq, dk, dv)`` in the sequence layout.  The head-layout tensors come from the
    forward's ``saved``, or, with ``seq = (q, k, v, out, lse)`` (the compiled op, which can
    only keep sequence-layout tensors), travel to the head layout here with ``dout``.
    With ``sinks``, this rank's part of their gradient is written into ``dsinks`` [H]
    (its rows, its heads: the sequence-parallel group's sum is the whole gradient).
    ``local``: the call's ``(q, k, v, out)``, for stages whose exchange is one rank's."""
    stages = plan.stages
    many = len(stages) > 1
    into = None
    if many:
        spec = plan.spec
        b, s = dout.shape[0], dout.shape[1]
        kw = dict(dtype=plan.dtype, device=dout.device)
        into = (torch.zeros((b, s, spec.heads, spec.head_dim), **kw),
                torch.zeros((b, s, spec.kv_heads, spec.head_dim), **kw),
                torch.zeros((b, s, spec.kv_heads, spec.v_dim), **kw))
    sends = []
    if HOOKS:
        step("exchange")
    pending = stages[0].exchange.start_dout(dout, async_op=many) if seq is None else None
    for i, st in enumerate(stages):
        if seq is None:
            assert pending is not None
            douth = pending.wait()
            pending = stages[i + 1].exchange.start_dout(dout, async_op=True) if i + 1 < len(stages) else None
            qh, kh, vh, outh, lse_h = saved[i].heads(st, local)
            saved[i] = None        # this stage's saved tensors go as soon as its ring backward has run
        else:
            qh, kh, vh, outh, douth, lse_h = _seq_to_heads(st, seq, dout)
        if HOOKS:
            step("ring")
        if sinks is not None and dsinks is not None:
            a, c = st.heads
            dsinks[a:c] += sink_grad(douth, outh, lse_h, sinks[a:c]).to(dsinks.dtype)
        grads = list(ring_backward(st.ring, douth, qh, kh, vh, outh, lse_h))
        del qh, kh, vh, outh, douth, lse_h
        if HOOKS:
            step("exchange")
        # handed over in a list the exchange empties: the head-layout gradients go once packed
        sent: Any = st.exchange.start_grads(grads, dtype=plan.dtype, into=into, async_op=many and not plan.sequential)
        if plan.sequential:       # this group's buffers go before the next group's exchange
            sent = Done(sent.wait())
        sends.append(sent)
    done = [p.wait() for p in sends]
    if HOOKS:
        step(None)
    return into if many else done[0]


def _own_heads(st, x: torch.Tensor, dim: int = 2) -> torch.Tensor:
    """A one-rank exchange sees full-width tensors: the stage's query heads of ``x``
    (``dim`` 2 for ``[B, s, H, D]``, 1 for an lse ``[B, H, s]``); a wider group's exchange
    picks each rank's heads itself."""
    a, c = st.exchange.plan.q[0]
    return x if st.exchange.size != 1 or (a, c) == (0, x.shape[dim]) else x.narrow(dim, a, c - a)


def _seq_to_heads(st, seq, dout):
    """One stage's ``(qh, kh, vh, outh, douth, lse_h)`` from the sequence-layout tensors the
    forward kept: one all-to-all (nothing travels for a one-rank group)."""
    q, k, v, out, lse = seq
    q, out, dout, lse = _own_heads(st, q), _own_heads(st, out), _own_heads(st, dout), _own_heads(st, lse, 1)
    return st.exchange.saved_to_heads(q, k, v, out, dout, lse)


def _keeps_graph() -> bool:
    """The running backward keeps the graph (``retain_graph=True``, ``create_graph=True``, or a
    ``torch.autograd.grad`` that retains it), so the saved tensors must outlive it.  Read as
    torch's compiled autograd functions read it to free theirs early (torch 2.13,
    torch/_functorch/_aot_autograd/runtime_wrappers.py); True (keep) when it cannot be read."""
    get = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if get is None:
        return True
    try:
        return bool(get())
    except RuntimeError:
        return True


def _local(plan: CallPlan) -> bool:
    """Every stage's exchange is one rank's (nothing travels): the backward's head-layout
    tensors are the call's q, k, v and output (views of them), saved by the autograd node."""
    return all(st.exchange.size == 1 for st in plan.stages)


LSE_GRADIENT = ("usp_hal attention: a gradient reached the lse returned by return_lse=True, and the backward "
                "carries only the output's gradient, so it would be dropped. Detach the lse where it is a "
                "statistic (lse.detach()); for gpt-oss-style attention sinks pass sinks= (exact, with its gradient) "
                "instead of rescaling the output by the lse")


class USPFunction(torch.autograd.Function):
    """The call as one autograd node: every rank issues the same collectives in the same
    order in backward too."""

    @staticmethod
    def forward(fctx, q, k, v, sinks, plan: CallPlan, received=None):
        out, lse, saved = forward(plan, q, k, v, keep=True, received=received, sinks=sinks)
        fctx.plan = plan
        if plan.sequential:     # low_memory: sequence-layout tensors only (inputs, output, lse)
            fctx.save_for_backward(q, k, v, out, saved[0])
            saved = None
        elif _local(plan):
            # one Ulysses rank: the head layout is q, k, v and the returned output themselves.
            # Saved through autograd (not on the context: an output held there would be a
            # reference cycle), which also refuses a backward after they were modified in place.
            fctx.save_for_backward(q, k, v, out)
        fctx.sinks = sinks.detach() if sinks is not None else None
        fctx.sinks_grad = sinks is not None and sinks.requires_grad
        # head-layout intermediates (never this node's outputs), kept on the context rather than
        # through save_for_backward so that a backward that does not keep the graph can free each
        # stage's as soon as it is used (:func:`_keeps_graph`)
        fctx.saved = saved
        # the lse stays differentiable so that a gradient reaching it is refused, not dropped (the
        # backward carries only the output's); an lse the caller does not differentiate gets None
        fctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(fctx, dout, dlse):
        if dlse is not None:
            raise RuntimeError(LSE_GRADIENT)
        sinks = fctx.sinks
        dsinks = sink_grad_buffer(sinks) if sinks is not None and fctx.sinks_grad else None
        if fctx.plan.sequential:      # low_memory: the stages move q/k/v/out to the head layout again
            dq, dk, dv = backward(fctx.plan, dout.contiguous(), seq=fctx.saved_tensors, sinks=sinks, dsinks=dsinks)
        else:
            saved = fctx.saved
            if saved is None:
                raise RuntimeError("usp_hal attention: trying to backward through the same call a second time, after "
                                   "its saved tensors were freed; pass retain_graph=True to the first backward")
            if _keeps_graph():      # another backward may follow: this one uses a copy of the list
                saved = list(saved)
            else:
                fctx.saved = None
            local = fctx.saved_tensors if _local(fctx.plan) else None
            dq, dk, dv = backward(fctx.plan, dout, saved, sinks=sinks, dsinks=dsinks, local=local)
            del local
        return dq, dk, dv, (dsinks.to(sinks.dtype) if dsinks is not None else None), None, None


def run_keeping_kv(plan: CallPlan, q, k, v, sinks=None):
    """A forward-only call of a one-stage plan that also hands back this rank's head-layout
    K/V as the call's own Ulysses all-to-all delivers them (what a KV cache's prefill keeps,
    with no extra collective): ``(out, kh, vh)``."""
    kept: list = []

    class Keep:
        def __init__(self, pending):
            self.pending = pending

        def wait(self):
            got = self.pending.wait()
            kept.append(got)
            return got

    with torch.no_grad():
        out, _ = run(plan, q, k, v, Keep(plan.stages[0].exchange.start_qkv(q, k, v)), sinks)  # type: ignore[arg-type]
    _, kh, vh = kept[0]
    return out, kh, vh


def run(plan: CallPlan, q, k, v, received: Optional[Received] = None, sinks=None):
    """``(out, lse or None)``: through the autograd Function when the call needs gradients,
    else the forward alone (nothing saved)."""
    if plan.spec.needs_grad or (sinks is not None and sinks.requires_grad and torch.is_grad_enabled()):
        return USPFunction.apply(q, k, v, sinks, plan, received)
    if not torch.is_grad_enabled():
        return forward(plan, q, k, v, keep=False, received=received, sinks=sinks)[:2]
    with torch.no_grad():
        out, lse, _ = forward(plan, q, k, v, keep=False, received=received, sinks=sinks)
    return out, lse
