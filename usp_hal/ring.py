"""Ring attention templated on a backend object: per-step block plan, float32 merge of
(out, lse), forward and backward over a rotation strategy.

Every kernel call the ring makes is one :class:`BlockCall`: a contiguous range of local
query rows against a contiguous range of the current key block, either full or causal on
a square diagonal, with the global key-minus-query position offset for window/alibi.  The
plan is a pure function of the two blocks' :class:`~usp_hal.layout.Segment` s, so basic,
zigzag and stripe layouts with any (uneven) lengths are all exact::

    causal block, q positions a.., k positions b.. (d = a - b)   x = kernel work
      d = 0, square  -> one causal diagonal          k: 0 1 2 3
                                                  q0   x . . .
                                                  q1   x x . .
      d > 0          -> full rectangle + diagonal q2   x x x .
      d < 0          -> skip rows m < -d, ...     q3   x x x x
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .layout import Segment

NEG_INF = float("-inf")


@dataclass(frozen=True)
class BlockCall:
    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    causal: bool
    key_offset: int          # global position of key k_start minus that of query q_start

    @property
    def rows(self) -> slice:
        return slice(self.q_start, self.q_stop)

    @property
    def cols(self) -> slice:
        return slice(self.k_start, self.k_stop)


def _causal_offset_calls(nq: int, nk: int, d: int, q0: int, k0: int, key_offset) -> List[BlockCall]:
    """Rows m see keys n <= m + d (top-left causal shifted by d), as full + square-causal calls."""
    calls = []
    m0 = max(0, -d)
    m1 = min(nq, nk - d)
    if m1 > m0:
        if m0 + d > 0:   # keys before the diagonal: fully visible to these rows
            calls.append(BlockCall(q0 + m0, q0 + m1, k0, k0 + m0 + d, False, key_offset(m0, 0)))
        calls.append(BlockCall(q0 + m0, q0 + m1, k0 + m0 + d, k0 + m1 + d, True, key_offset(m0, m0 + d)))
    lo = max(m1, m0)
    if nq > lo and nk > 0:
        calls.append(BlockCall(q0 + lo, q0 + nq, k0, k0 + nk, False, key_offset(lo, 0)))
    return calls


def _window_excludes(qpos: int, nq: int, kpos: int, nk: int, window) -> bool:
    """True when no (query, key) pair of the two contiguous ranges lies inside the window."""
    left, right = window
    lo = kpos - (qpos + nq - 1)       # smallest key - query distance
    hi = kpos + nk - 1 - qpos         # largest
    return (left >= 0 and hi < -left) or (right >= 0 and lo > right)


def plan_blocks(q_segs: Sequence[Segment], k_segs: Sequence[Segment], *, causal: bool,
                window=(-1, -1), positional: bool = False, diagonal: bool = False) -> List[BlockCall]:
    """Kernel calls for local queries (``q_segs``) against one key block (``k_segs``).

    ``positional``: window/alibi are in use, so every call needs the true key offset (the
    segments must then be contiguous, step 1).  ``diagonal``: the two blocks are the same
    rank's shard, so causal on local indices *is* global causal (positions are sorted):
    one square causal call covers it when nothing positional is involved.
    """
    nq, nk = sum(s.count for s in q_segs), sum(s.count for s in k_segs)
    if nq == 0 or nk == 0:
        return []
    if not causal and not positional:
        return [BlockCall(0, nq, 0, nk, False, 0)]
    if causal and diagonal and not positional:
        return [BlockCall(0, nq, 0, nk, True, 0)]
    calls: List[BlockCall] = []
    qo = 0
    for qs in q_segs:
        ko = 0
        for ks in k_segs:
            if qs.count and ks.count:
                calls += _pair_calls(qs, qo, ks, ko, causal, window, positional)
            ko += ks.count
        qo += qs.count
    return _merge_calls(calls) if not positional else calls


def _pair_calls(qs: Segment, qo: int, ks: Segment, ko: int, causal: bool, window, positional: bool):
    if qs.step != ks.step and qs.count > 1 and ks.count > 1:
        raise ValueError(f"segments with different steps cannot be paired: {qs} vs {ks}")
    step = qs.step if qs.count > 1 else ks.step
    if positional and step != 1:
        raise ValueError("window/alibi across ring blocks need contiguous segments (basic or zigzag layout)")

    def offset(m: int, n: int) -> int:
        return (ks.start + n * step) - (qs.start + m * step)

    if positional and _window_excludes(qs.start, qs.count, ks.start, ks.count, window):
        return []
    if not causal:
        return [BlockCall(qo, qo + qs.count, ko, ko + ks.count, False, offset(0, 0))]
    # key n visible to query m  <=>  ks.start + n*step <= qs.start + m*step  <=>  n <= m + d
    d = (qs.start - ks.start) // step
    return _causal_offset_calls(qs.count, ks.count, d, qo, ko, offset)


def _merge_calls(calls: List[BlockCall]) -> List[BlockCall]:
    """Fuse full calls that share a key range over adjacent query rows (fewer kernel calls)."""
    out: List[BlockCall] = []
    for c in calls:
        if out and not c.causal and not out[-1].causal:
            p = out[-1]
            if (p.k_start, p.k_stop) == (c.k_start, c.k_stop) and p.q_stop == c.q_start:
                out[-1] = BlockCall(p.q_start, c.q_stop, p.k_start, p.k_stop, False, p.key_offset)
                continue
            if (p.q_start, p.q_stop) == (c.q_start, c.q_stop) and p.k_stop == c.k_start:
                out[-1] = BlockCall(p.q_start, p.q_stop, p.k_start, c.k_stop, False, p.key_offset)
                continue
        out.append(c)
    return out


# --------------------------------------------------------------------------------- merge
def merge_block(acc_out: torch.Tensor, acc_lse: torch.Tensor, rows: slice,
                out: torch.Tensor, lse: torch.Tensor) -> None:
    """Online-softmax merge of a block result into the accumulators, in place.

    ``acc_out`` [B, S, H, D] and ``acc_lse`` [B, H, S] are float32 (float64 for float64
    inputs); ``out`` [B, s, H, D], ``lse`` [B, H, s] cover ``rows``.  Rows whose lse is
    -inf on both sides stay (0, -inf)."""
    a_lse = acc_lse[:, :, rows]
    lse = lse.to(acc_lse.dtype)
    new = torch.logaddexp(a_lse, lse)
    safe = new.masked_fill(new == NEG_INF, 0.0)
    w_old = torch.exp(a_lse - safe).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    acc_out[:, rows].mul_(w_old).addcmul_(out, w_new)
    acc_lse[:, :, rows] = new


def merge_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------- context
@dataclass
class RingContext:
    """Everything the ring needs besides the tensors (built once per call)."""

    backend: object
    ring_size: int
    ring_rank: int
    group: object
    ring_ranks: Tuple[int, ...]
    segments: Tuple[Tuple[Segment, ...], ...]   # per ring rank: its shard's segments
    lengths: Tuple[int, ...]                     # per ring rank: shard length
    softmax_scale: float
    causal: bool
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None
    deterministic: bool = False
    rotation: str = "p2p"

    @property
    def positional(self) -> bool:
        return tuple(self.window) != (-1, -1) or self.alibi_slopes is not None

    def calls(self, src: int) -> List[BlockCall]:
        return plan_blocks(self.segments[self.ring_rank], self.segments[src], causal=self.causal,
                           window=self.window, positional=self.positional, diagonal=src == self.ring_rank)

    def kernel_kwargs(self, call: BlockCall) -> dict:
        return dict(softmax_scale=self.softmax_scale, causal=call.causal, window=tuple(self.window),
                    softcap=self.softcap, alibi_slopes=self.alibi_slopes, key_offset=call.key_offset)


def _rotator(ctx: RingContext):
    from .comm import P2PRotator
    return P2PRotator(ctx.group, ctx.ring_ranks, ctx.ring_rank)


def _block_shape(t: torch.Tensor, length: int, seq_dim: int = 1) -> torch.Size:
    shape = list(t.shape)
    shape[seq_dim] = length
    return torch.Size(shape)


class _Accumulator:
    """Float32 (float64 for float64 inputs) out/lse accumulators for the local queries.

    The first kernel result that covers every row *becomes* the accumulator (no zero
    buffer, no merge); later blocks are merged into it in place."""

    def __init__(self, q: torch.Tensor, dv: int):
        self.q, self.dv = q, dv
        self.mdt = merge_dtype(q.dtype)
        self.out = self.lse = None

    def add(self, call: BlockCall, out: torch.Tensor, lse: torch.Tensor) -> None:
        b, l, h, _ = self.q.shape
        if self.out is None:
            if call.q_start == 0 and call.q_stop == l:
                self.out, self.lse = out.to(self.mdt), lse.to(self.mdt)
                return
            self.out = torch.zeros(b, l, h, self.dv, dtype=self.mdt, device=self.q.device)
            self.lse = torch.full((b, h, l), NEG_INF, dtype=self.mdt, device=self.q.device)
        merge_block(self.out, self.lse, call.rows, out, lse)

    def result(self):
        if self.out is None:   # no key visible to any row (e.g. an empty shard)
            b, l, h, _ = self.q.shape
            return (self.q.new_zeros(b, l, h, self.dv),
                    torch.full((b, h, l), NEG_INF, dtype=self.mdt, device=self.q.device))
        return self.out.to(self.q.dtype), self.lse


def _single_call(ctx: RingContext, q) -> Optional[BlockCall]:
    """With one ring rank and one kernel call over everything, the ring is just the kernel."""
    if ctx.ring_size != 1:
        return None
    calls = ctx.calls(ctx.ring_rank)
    if len(calls) == 1 and calls[0].q_start == 0 and calls[0].q_stop == q.shape[1]:
        return calls[0]
    return None


def ring_forward(ctx: RingContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q [B, L, h, D], k/v [B, L, hk, D] (this ring rank's shard) -> (out, lse)."""
    R, me = ctx.ring_size, ctx.ring_rank
    acc = _Accumulator(q, v.shape[-1])
    if q.shape[2] == 0:   # more ulysses ranks than heads: every member of this ring has none
        return acc.result()
    one = _single_call(ctx, q)
    if one is not None and one.k_start == 0 and one.k_stop == k.shape[1]:
        out, lse = ctx.backend.forward(q, k, v, **ctx.kernel_kwargs(one))
        return out, lse.to(acc.mdt)

    def compute(src, kb, vb):
        for c in ctx.calls(src):
            acc.add(c, *ctx.backend.forward(q[:, c.rows], kb[:, c.cols], vb[:, c.cols], **ctx.kernel_kwargs(c)))

    if R == 1:
        compute(me, k, v)
    elif ctx.rotation == "allgather":
        from .comm import all_gather_blocks
        blocks, work = all_gather_blocks(torch.stack([k, v]), ctx.lengths, ctx.group, seq_dim=2, async_op=True)
        compute(me, k, v)                       # own block while the gather is in flight
        work.wait()
        for step in range(1, R):
            src = (me - step) % R
            blk = blocks[src].narrow(2, 0, ctx.lengths[src])
            compute(src, blk[0], blk[1])
    else:
        rot = _rotator(ctx)
        kb, vb = k.contiguous(), v.contiguous()
        for step in range(R):
            src = (me - step) % R
            if step < R - 1:   # the next block travels while this one computes
                n = ctx.lengths[(src - 1) % R]
                (nk, nv), reqs = rot.start([kb, vb], [_block_shape(kb, n), _block_shape(vb, n)])
            compute(src, kb, vb)
            if step < R - 1:
                rot.wait(reqs)
                kb, vb = nk, nv
    return acc.result()


def ring_backward(ctx: RingContext, dout, q, k, v, out, lse):
    """Gradients of the ring: recompute every block against the global out/lse, sum dq
    locally, and send each block's dK/dV home."""
    R, me = ctx.ring_size, ctx.ring_rank
    mdt = merge_dtype(q.dtype)
    if q.shape[2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def kernel_backward(c, kb, vb):
        return ctx.backend.backward(dout[:, c.rows], q[:, c.rows], kb[:, c.cols], vb[:, c.cols], out[:, c.rows],
                                    lse[:, :, c.rows], deterministic=ctx.deterministic, dropout_p=0.0,
                                    **ctx.kernel_kwargs(c))

    one = _single_call(ctx, q)
    if one is not None and one.k_start == 0 and one.k_stop == k.shape[1]:
        return kernel_backward(one, k, v)
    dq = torch.zeros(q.shape, dtype=mdt, device=q.device)

    def new_dkv(n):
        return torch.zeros((2,) + tuple(_block_shape(k, n)), dtype=mdt, device=k.device)

    def compute(src, kb, vb, dkv):
        for c in ctx.calls(src):
            gq, gk, gv = kernel_backward(c, kb, vb)
            dq[:, c.rows] += gq
            dkv[0][:, c.cols] += gk
            dkv[1][:, c.cols] += gv

    own = new_dkv(k.shape[1])
    if R == 1:
        compute(me, k, v, own)
    elif ctx.rotation == "allgather":
        from .comm import all_gather_blocks, reduce_blocks_to_owners
        blocks, work = all_gather_blocks(torch.stack([k, v]), ctx.lengths, ctx.group, seq_dim=2, async_op=True)
        grads = [None] * R
        grads[me] = own
        compute(me, k, v, own)
        work.wait()
        for step in range(1, R):
            src = (me - step) % R
            grads[src] = new_dkv(ctx.lengths[src])
            compute(src, blocks[src][0].narrow(1, 0, ctx.lengths[src]),
                    blocks[src][1].narrow(1, 0, ctx.lengths[src]), grads[src])
        own = reduce_blocks_to_owners(grads, ctx.lengths, me, ctx.group, seq_dim=2)
    else:
        # Block b's dK/dV is summed along the chain b+1 -> b+2 -> ... -> b+R-1 -> b: each rank
        # adds its part to what arrived from the previous rank and passes it on (R-1 hops); the
        # owner keeps its own part locally.  Every transfer overlaps the next block's compute.
        rot = _rotator(ctx)
        kb, vb = k.contiguous(), v.contiguous()
        incoming = None
        for step in range(R):
            src = (me - step) % R
            n_next = ctx.lengths[(src - 1) % R]
            if step < R - 1:
                (nk, nv), kv_reqs = rot.start([kb, vb], [_block_shape(kb, n_next), _block_shape(vb, n_next)])
            part = own if step == 0 else new_dkv(ctx.lengths[src])
            compute(src, kb, vb, part)
            if step > 0:
                if incoming is not None:   # earlier ranks' part of this block, arrived meanwhile
                    (dkv_in,), reqs = incoming
                    rot.wait(reqs)
                    part += dkv_in
                incoming = rot.start([part], [_block_shape(part, n_next, seq_dim=2)])
            if step < R - 1:
                rot.wait(kv_reqs)
                kb, vb = nk, nv
        (dkv_in,), reqs = incoming   # after the last step: every other rank's part of our block
        rot.wait(reqs)
        own += dkv_in
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)
