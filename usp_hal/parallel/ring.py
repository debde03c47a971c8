"""Ring attention templated on a backend object: the per-step kernel calls of the block
plan, float32 merge of (out, lse), forward and backward over a rotation strategy.

The block plan itself (:class:`BlockCall`, :func:`plan_blocks`: which calls every ring rank
makes against every source block) is pure integer code in ``usp_hal.sequence.blocks``, re-exported
here under the names it has always had; this module runs it: :class:`PackedCall` (a
varlen kernel call over several planned calls), :class:`RingContext` (the plan's blocks and
the call's :class:`~usp_hal.dispatch.capabilities.KernelCall`, from which each block call's
value is derived), the merge (:func:`merge_block`, and :func:`merge_partials` for a decode
step's partial results) and the ring's forward and backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..bounded import BoundedCache
from ..dispatch.capabilities import KernelCall
from ..sequence.blocks import BlockCall, pack_groups, plan_blocks  # noqa: F401  (re-exported: the plan's names)
from ..sequence.positions import Segment
from .rotation import Accum

if TYPE_CHECKING:  # pragma: no cover
    from .rotation import Rotation

NEG_INF = float("-inf")


# --------------------------------------------------------------------------------- packed calls
class Packing:
    """Sequence boundaries of one packed kernel call (what a varlen entry point takes):
    ``q_lens``/``k_lens`` per sequence (host ints), ``cu_q``/``cu_k`` their int32 prefix sums
    on the device, ``max_q``/``max_k``.  Built by :class:`PackedCall` and cached."""

    __slots__ = ("q_lens", "k_lens", "cu_q", "cu_k", "max_q", "max_k", "cache")

    def __init__(self, q_lens: Sequence[int], k_lens: Sequence[int], device) -> None:
        self.cache: Dict[Any, Any] = {}      # what an adapter derives from the boundaries, kept with them
        self.q_lens, self.k_lens = tuple(q_lens), tuple(k_lens)
        self.max_q, self.max_k = max(self.q_lens), max(self.k_lens)
        self.cu_q = _prefix(self.q_lens, device)
        self.cu_k = self.cu_q if self.k_lens == self.q_lens else _prefix(self.k_lens, device)

    @property
    def total_q(self) -> int:
        return sum(self.q_lens)

    def flash_kwargs(self) -> dict:
        """The varlen keywords of the FlashAttention entry points (``cu_seqlens_q/k``, ``max_seqlen_q/k``)."""
        return dict(cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k, max_seqlen_q=self.max_q, max_seqlen_k=self.max_k)

    @property
    def total_k(self) -> int:
        return sum(self.k_lens)


def _prefix(lens, device) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32).to(device)


def _span(ranges) -> Optional[Tuple[int, int]]:
    """(a, b) when the ranges, in order, tile [a, b) exactly (gather is a slice), else None."""
    a, b = ranges[0]
    for lo, hi in ranges[1:]:
        if lo != b:
            return None
        b = hi
    return a, b


class PackedCall:
    """Several :class:`BlockCall` s of one kind, all causal squares or all full rectangles,
    run as one call of a kernel's packed-sequence (varlen) entry point: call ``i`` becomes
    sequence ``i`` (queries ``rows``, keys ``cols``).  With a batch of B rows the packed
    order is (batch row, call), so every call's result is a view of the packed output."""

    def __init__(self, calls: Sequence[BlockCall]) -> None:
        self.calls = tuple(calls)
        self.causal = self.calls[0].causal
        self.q_lens = tuple(c.q_stop - c.q_start for c in self.calls)
        self.k_lens = tuple(c.k_stop - c.k_start for c in self.calls)
        offs, o = [], 0
        for n in self.q_lens:
            offs.append(o)
            o += n
        self.q_offsets = tuple(offs)
        self.total_q = o
        self.q_span = _span([(c.q_start, c.q_stop) for c in self.calls])
        self.k_span = _span([(c.k_start, c.k_stop) for c in self.calls])
        ranges = sorted((c.q_start, c.q_stop) for c in self.calls)
        #: no two pieces share a query row (then their results can be copied in one go)
        self.rows_distinct = all(ranges[i][1] <= ranges[i + 1][0] for i in range(len(ranges) - 1))
        self._cache: Dict[Any, Any] = {}

    def packing(self, batch: int, device) -> Packing:
        key = ("packing", batch, str(device))
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = Packing(self.q_lens * batch, self.k_lens * batch, device)
        return got

    def index(self, which: str, device) -> torch.Tensor:
        """Local row (``"q"``) or key (``"k"``) indices of the packed sequences, in order."""
        key = (which, str(device))
        got = self._cache.get(key)
        if got is None:
            spans = [(c.q_start, c.q_stop) if which == "q" else (c.k_start, c.k_stop) for c in self.calls]
            got = self._cache[key] = torch.cat([torch.arange(a, b) for a, b in spans]).to(device)
        return got

    def gather(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """``x`` [B, L, h, D] -> the packed ``[B * total, h, D]`` (a view when the calls tile one range and B == 1)."""
        where = self.where(which, x.device)
        part = x[:, where[0]:where[1]] if isinstance(where, tuple) else x.index_select(1, where)
        return part.reshape(-1, *x.shape[2:])

    def gather_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """``lse`` [B, H, L] -> ``[H, B * total]`` (the packed lse layout), contiguous."""
        part = lse[:, :, self.q_span[0]:self.q_span[1]] if self.q_span is not None else \
            lse.index_select(2, self.index("q", lse.device))
        return part.transpose(0, 1).reshape(lse.shape[1], -1)

    def where(self, which: str, device):
        """Where this call's rows (``"q"``) or keys (``"k"``) lie along dim 1: one
        ``(start, stop)`` range when they tile one, else their index tensor."""
        span = self.q_span if which == "q" else self.k_span
        return span if span is not None else self.index(which, device)

    def scatter_add(self, acc: torch.Tensor, grad: torch.Tensor, which: str) -> None:
        """``acc`` [B, L, h, D] += the packed ``grad`` [B * total, h, D] at this call's rows/keys."""
        b = acc.shape[0]
        g = grad.view(b, -1, *grad.shape[1:]).to(acc.dtype)
        where = self.where(which, acc.device)
        if isinstance(where, tuple):
            acc[:, where[0]:where[1]] += g
        else:
            acc.index_add_(1, where, g)

    def split(self, out: torch.Tensor, lse: torch.Tensor, batch: int):
        """Per call: (call, out [B, n, H, D], lse [B, H, n]), views of the packed results."""
        total = sum(self.q_lens)
        o = out.view(batch, total, *out.shape[1:])
        lv = lse.view(lse.shape[0], batch, total)
        for c, off, n in zip(self.calls, self.q_offsets, self.q_lens):
            yield c, o[:, off:off + n], lv[:, :, off:off + n].transpose(0, 1)


def pack_calls(calls: Sequence[BlockCall], windowed: bool = False) -> List[Union[BlockCall, PackedCall]]:
    """The block plan of one step for a kernel with a varlen entry point: each group of
    :func:`usp_hal.sequence.blocks.pack_groups` (the causal squares, the full rectangles; with a
    ``windowed`` call only the squares of key offset 0) as one :class:`PackedCall`."""
    return [PackedCall(g) if isinstance(g, tuple) else g for g in pack_groups(calls, windowed)]


# --------------------------------------------------------------------------------- merge
def merge_block(acc_out: torch.Tensor, acc_lse: torch.Tensor, rows: slice,
                out: torch.Tensor, lse: torch.Tensor, *, empty_rows: bool = True) -> None:
    """Online-softmax merge of a block result into the accumulators, in place.

    ``acc_out`` [B, S, H, D] and ``acc_lse`` [B, H, S] are float32 (float64 for float64
    inputs); ``out`` [B, s, H, D], ``lse`` [B, H, s] cover ``rows``.  The block's weight
    is ``sigmoid(lse - acc_lse)`` (= exp(lse - new lse)), and ``acc_out`` moves towards
    ``out`` by it (one ``lerp_``); the new lse is ``logaddexp`` of both, written in place.
    A block row whose lse is -inf (it saw no key) leaves its row as it was, an empty row
    included; ``empty_rows=False`` says the block has no such row (no window: every call
    sees at least its diagonal or all its keys), which skips that test.  NaN propagates."""
    a_lse = acc_lse[:, :, rows]
    lse = lse.to(acc_lse.dtype)
    w = torch.sigmoid(lse - a_lse)
    if empty_rows:
        w = w.masked_fill(lse == NEG_INF, 0.0)
    acc_out[:, rows].lerp_(out.to(acc_out.dtype), w.transpose(1, 2).unsqueeze(-1))
    torch.logaddexp(a_lse, lse, out=a_lse)


def merge_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of ``P`` partial attentions over disjoint key sets, by :func:`merge_block`
    (the ring's merge), in the dtype of ``outs``.

    ``outs`` ``[P, B, n, h, D]`` and ``lses`` ``[P, B, h, n]`` (natural log, -inf for a part
    that saw no key) -> ``(out [B, n, h, D], lse [B, h, n])``: ``lse = log sum_p exp(lse_p)``
    and ``out = sum_p exp(lse_p - lse) out_p``.  Rows that no part saw give out 0 and lse
    -inf (never NaN)."""
    out = torch.zeros(outs.shape[1:], dtype=outs.dtype, device=outs.device)
    lse = torch.full(lses.shape[1:], NEG_INF, dtype=outs.dtype, device=outs.device)
    rows = slice(None)
    for p in range(outs.shape[0]):
        merge_block(out, lse, rows, outs[p], lses[p])
    return out, lse


# --------------------------------------------------------------------------------- context
@dataclass
class RingContext:
    """Everything the ring needs besides the tensors (built once per call by the plan):
    ``call``, the call's :class:`~usp_hal.dispatch.capabilities.KernelCall`, from which every
    block's value is derived (:meth:`block_call`), and ``blocks``, the block plan (per source
    ring rank, this rank's calls against that rank's keys)."""

    backend: Any
    ring_size: int
    ring_rank: int
    segments: Tuple[Tuple[Segment, ...], ...]   # per ring rank: its shard's segments
    lengths: Tuple[int, ...]                     # per ring rank: shard length
    call: KernelCall
    rotation: "Rotation"
    blocks: Dict[int, List[BlockCall]]
    #: the packed steps (:meth:`steps`), per source; cached with the plan's shape
    packed: Dict[int, list] = field(default_factory=dict)
    #: document boundaries of a packed call (None: one sequence)
    cu_seqlens: Optional[Tuple[int, ...]] = None
    #: a ``mask=`` call: what it keeps (:class:`usp_hal.sequence.masks.Predicate`; causal, window and
    #: documents folded in), and this stage's global query heads (a head-dependent mask)
    predicate: Optional[Any] = None
    mask_heads: Optional[Tuple[int, int]] = None
    device: Optional[Any] = None        # where the masks of a masked call live

    def calls(self, src: int) -> List[BlockCall]:
        return self.blocks[src]

    @property
    def packs(self) -> bool:
        """Batch each step's per-document calls into varlen calls: packed documents, a backend
        with a varlen entry point, and no alibi (its bias depends on each call's key offset;
        with a window only the calls without one are packed, see :func:`pack_calls`)."""
        return (self.cu_seqlens is not None and self.call.alibi_slopes is None and self.predicate is None
                and getattr(self.backend, "VARLEN_KERNEL", False))

    def steps(self, src: int) -> Sequence[Union[BlockCall, PackedCall]]:
        """The kernel calls against ``src``'s key block: the block plan, or packed (:attr:`packs`)."""
        calls = self.calls(src)
        if len(calls) < 2 or not self.packs:
            return calls
        got = self.packed.get(src)
        if got is None:
            got = self.packed[src] = pack_calls(calls, windowed=self.call.has_window)
        return got

    def block_call(self, c: BlockCall, src: int) -> KernelCall:
        """The value of one block call of the plan, derived from the call's (once per plan):
        its causal flag and key offset; in a masked call causal and the window are part of
        the predicate, and a partial block carries its dense mask."""
        cache = self.__dict__.setdefault("_block_calls", {})
        got = cache.get((c, src))
        if got is None:
            if self.predicate is None:
                got = self.call.with_(causal=c.causal, key_offset=c.key_offset)
            else:
                got = self.call.with_(causal=False, window=(-1, -1), key_offset=c.key_offset,
                                      mask=self.block_mask(src, c) if c.masked else None)
            cache[(c, src)] = got
        return got

    def packed_call(self, pc: PackedCall, batch: int, device) -> KernelCall:
        """The value of one packed call (its sequences' boundaries for ``batch`` rows)."""
        cache = self.__dict__.setdefault("_packed_calls", {})
        key = (pc, batch, str(device))
        got = cache.get(key)
        if got is None:
            got = cache[key] = self.call.with_(causal=pc.causal, packing=pc.packing(batch, device))
        return got

    def block_mask(self, src: int, call: BlockCall) -> torch.Tensor:
        """The dense bool mask of one masked call (computed once per plan, on the backend's device)."""
        cache = self.__dict__.setdefault("_masks", {})
        got = cache.get((src, call))
        if got is None:
            from ..sequence.masks import dense_mask
            heads = range(*self.mask_heads) if self.mask_heads is not None else None
            assert self.predicate is not None
            got = cache[(src, call)] = dense_mask(self.predicate, self.segments[self.ring_rank], self.segments[src],
                                                  call, heads, self.device)
        return got


class _Accumulator:
    """Float32 (float64 for float64 inputs) out/lse accumulators for the local queries.

    The first kernel result that covers every row *becomes* the accumulator (no zero
    buffer, no merge); later blocks are merged into it in place.  A result for rows that
    no earlier call touched is copied, not merged (packed documents: most calls cover
    fresh rows)."""

    def __init__(self, q: torch.Tensor, dv: int, empty_rows: bool = True):
        self.q, self.dv = q, dv
        self.empty_rows = empty_rows     # False: no call has a row that sees no key (no window)
        self.mdt = merge_dtype(q.dtype)
        self.out: Optional[torch.Tensor] = None
        self.lse: Optional[torch.Tensor] = None
        self.touched: Optional[bytearray] = None    # per local row: 1 once a call covered it

    def add(self, call: BlockCall, out: torch.Tensor, lse: torch.Tensor) -> None:
        b, l, h, _ = self.q.shape
        if self.out is None:
            if call.q_start == 0 and call.q_stop == l:
                self.out, self.lse = out.to(self.mdt), lse.to(self.mdt).contiguous()
                return
            self._start_empty()
        assert self.out is not None and self.lse is not None
        if self.touched is not None:
            a, z = call.q_start, call.q_stop
            if self.touched.find(1, a, z) < 0:     # fresh rows: merging into (0, -inf) is a copy
                self.touched[a:z] = b"\x01" * (z - a)
                if self.empty_rows:
                    empty = (lse == NEG_INF).transpose(1, 2).unsqueeze(-1)    # rows that saw no key: out 0
                    out = out.masked_fill(empty, 0.0)
                self.out[:, a:z] = out
                self.lse[:, :, a:z] = lse
                return
            self.touched[a:z] = b"\x01" * (z - a)
        merge_block(self.out, self.lse, call.rows, out, lse, empty_rows=self.empty_rows)

    def add_packed(self, pc: PackedCall, out: torch.Tensor, lse: torch.Tensor) -> None:
        """The results of a packed call (``out`` [B * total, h, D], ``lse`` [h, B * total]).
        When its pieces' rows are distinct and no earlier call touched them, one copy (none
        when they are every row, in order) replaces the per-piece merges; otherwise each piece
        is merged as a single call.  A packed piece always sees its diagonal key (causal or
        windowed squares) or every key (full rectangles), so no row is empty."""
        b, l, h, _ = self.q.shape
        if pc.rows_distinct:
            o = out.view(b, pc.total_q, h, out.shape[-1])
            lv = lse.view(h, b, pc.total_q).transpose(0, 1)
            if self.out is None and pc.q_span == (0, l):
                self.out, self.lse = o.to(self.mdt), lv.to(self.mdt).contiguous()
                return
            if self.out is None:
                self._start_empty()
            touched = self.touched
            if touched is not None and all(touched.find(1, c.q_start, c.q_stop) < 0 for c in pc.calls):
                assert self.out is not None and self.lse is not None
                for c in pc.calls:
                    touched[c.q_start:c.q_stop] = b"\x01" * (c.q_stop - c.q_start)
                if pc.q_span is not None:
                    a, z = pc.q_span
                    self.out[:, a:z] = o
                    self.lse[:, :, a:z] = lv
                else:
                    idx = pc.index("q", self.out.device)
                    self.out.index_copy_(1, idx, o.to(self.mdt))
                    self.lse.index_copy_(2, idx, lv.to(self.mdt))
                return
        for call, oc, lc in pc.split(out, lse, b):
            self.add(call, oc, lc)

    def result(self):
        """(out, lse): out in the merge dtype, or the kernel's own output when one call
        covered everything (the caller converts it once, into its destination)."""
        if self.out is None:   # no key visible to any row (e.g. an empty shard)
            return self._empty()
        return self.out, self.lse

    def _empty(self):
        """(0, -inf) for every local row: what the merge starts from."""
        b, l, h, _ = self.q.shape
        return (torch.zeros(b, l, h, self.dv, dtype=self.mdt, device=self.q.device),
                torch.full((b, h, l), NEG_INF, dtype=self.mdt, device=self.q.device))

    def _start_empty(self) -> None:
        self.out, self.lse = self._empty()
        self.touched = bytearray(self.q.shape[1])


def _single_call(ctx: RingContext, q, k) -> Optional[BlockCall]:
    """With one ring rank and one kernel call over everything, the ring is just the kernel."""
    if ctx.ring_size != 1:
        return None
    calls = ctx.calls(ctx.ring_rank)
    if (len(calls) == 1 and calls[0].q_start == 0 and calls[0].q_stop == q.shape[1]
            and calls[0].k_start == 0 and calls[0].k_stop == k.shape[1]):
        return calls[0]
    return None


def _kernel_call(ctx: RingContext, call: BlockCall, src: int):
    """The forward of one block call of the plan, ``(q, k, v) -> (out, lse)`` on the call's
    rows and keys: the backend's bound call (:meth:`~usp_hal.dispatch.backend.AttentionBackend.bind`,
    validated once per shape, dtype and device; kept on this context, which lives as long
    as its plan), or its ``forward`` where the backend has a forward of its own (an
    adapter, a meter's wrapper) or the call is masked."""
    calls = ctx.__dict__.setdefault("_kernel_calls", BoundedCache(256))
    got = calls.get((id(call), src))
    if got is not None and got[0] is call:
        return got[1]
    backend = ctx.backend
    kc = ctx.block_call(call, src)
    if kc.mask is not None or not backend.binds_forward():
        def fn(q, k, v):
            return backend.forward(q, k, v, kc)
    else:
        cache: BoundedCache = BoundedCache(8)

        def fn(q, k, v):
            if not backend.binds_forward():        # wrapped since (the harness's kernel timer): go through it
                return backend.forward(q, k, v, kc)
            key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device)
            bound = cache.get(key)
            if bound is None:
                bound = cache.put(key, backend.bind(q, k, v, kc))
            return bound(q, k, v)
    calls.put((id(call), src), (call, fn))
    return fn


def ring_forward(ctx: RingContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q [B, L, h, D], k/v [B, L, hk, D] (this ring rank's shard) -> (out, lse).

    ``out`` is the merge-dtype accumulator (or the kernel's own output for a single call);
    ``lse`` [B, h, L] in the merge dtype."""
    if q.shape[2] != 0 and ctx.rotation.codecs is None:
        one = _single_call(ctx, q, k)
        if one is not None:
            out, lse = _kernel_call(ctx, one, ctx.ring_rank)(q, k, v)
            mdt = merge_dtype(q.dtype)
            return out, (lse if lse.dtype == mdt else lse.to(mdt))
    acc = _Accumulator(q, v.shape[-1], empty_rows=ctx.call.has_window or ctx.predicate is not None)
    if q.shape[2] == 0:   # more ulysses ranks than heads: every member of this ring has none
        return acc.result()
    n = q.shape[1]
    for src, kb, vb in ctx.rotation.blocks(k, v):
        for c in ctx.steps(src):
            if isinstance(c, PackedCall):
                b = q.shape[0]
                out, lse = ctx.backend.forward_packed(c.gather(q, "q"), c.gather(kb, "k"), c.gather(vb, "k"),
                                                      ctx.packed_call(c, b, q.device))
                acc.add_packed(c, out, lse)
            else:       # whole tensors where the call spans them (a slice is a dispatch of its own)
                qc = q if c.q_start == 0 and c.q_stop == n else q[:, c.rows]
                if c.k_start == 0 and c.k_stop == kb.shape[1]:
                    acc.add(c, *_kernel_call(ctx, c, src)(qc, kb, vb))
                else:
                    acc.add(c, *_kernel_call(ctx, c, src)(qc, kb[:, c.cols], vb[:, c.cols]))
        del kb, vb      # so the block can go before the next one's hop allocates
    return acc.result()


def ring_backward(ctx: RingContext, dout, q, k, v, out, lse):
    """Gradients of the ring: recompute every block against the global out/lse, sum dq
    locally, and send each block's dK/dV home.  Returns float accumulators (merge dtype,
    or the kernel's own gradients for a single call)."""
    mdt = merge_dtype(q.dtype)
    if q.shape[2] == 0:
        return (torch.zeros(q.shape, dtype=mdt, device=q.device), torch.zeros(k.shape, dtype=mdt, device=k.device),
                torch.zeros(v.shape, dtype=mdt, device=v.device))

    def kernel_backward(c, src, kb, vb):
        return ctx.backend.backward(dout[:, c.rows], q[:, c.rows], kb[:, c.cols], vb[:, c.cols], out[:, c.rows],
                                    lse[:, :, c.rows], ctx.block_call(c, src))

    one = _single_call(ctx, q, k)
    if one is not None and ctx.rotation.codecs is None:
        return kernel_backward(one, ctx.ring_rank, k, v)
    # every accumulator starts empty: a kernel gradient over a whole block becomes it (no
    # zeros, no add); each step's gradients, the K/V block and the sent partial dK/dV are let
    # go as soon as they are used, before the next large allocation
    dq = Accum(q.shape, mdt, q.device)
    rot = ctx.rotation
    b, step = q.shape[0], -1
    for src, kb, vb in rot.blocks(k, v):     # (not enumerate: its cached tuple would keep the block alive)
        step += 1
        part = rot.new_grad(src, k, v, mdt)
        for c in ctx.steps(src):
            if isinstance(c, PackedCall):
                gq, gk, gv = ctx.backend.backward_packed(
                    c.gather(dout, "q"), c.gather(q, "q"), c.gather(kb, "k"), c.gather(vb, "k"), c.gather(out, "q"),
                    c.gather_lse(lse), ctx.packed_call(c, b, q.device))
                dq.add(gq.view(b, -1, *gq.shape[1:]), c.where("q", q.device))
                gq = None
                part.add(gk.view(b, -1, *gk.shape[1:]), gv.view(b, -1, *gv.shape[1:]), c.where("k", k.device))
            else:
                gq, gk, gv = kernel_backward(c, src, kb, vb)
                dq.add(gq, (c.q_start, c.q_stop))
                gq = None
                part.add(gk, gv, (c.k_start, c.k_stop))
            gk = gv = None
        del kb, vb
        rot.add_grad(step, src, part)
        del part
    dk, dv = rot.own_grad()
    return dq.take(), dk, dv
