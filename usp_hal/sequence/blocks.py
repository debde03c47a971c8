"""Block plans: which kernel calls every ring rank makes against every source block.

Every kernel call the ring makes is one :class:`BlockCall`: a contiguous range of local
query rows against a contiguous range of the current key block, either full or causal on
a square diagonal, with the global key-minus-query position offset for window/alibi.  The
plan is a pure function of the two blocks' :class:`~usp_hal.sequence.positions.Segment` s, so basic,
zigzag and stripe layouts with any (uneven) lengths are all exact::

    causal block, q positions a.., k positions b.. (d = a - b)   x = kernel work
      d = 0, square  -> one causal diagonal          k: 0 1 2 3
                                                  q0   x . . .
                                                  q1   x x . .
      d > 0          -> full rectangle + diagonal q2   x x x .
      d < 0          -> skip rows m < -d, ...     q3   x x x x

Packed documents (``cu_seqlens``): both blocks' segments are cut at the document
boundaries and only pieces of the same document are paired, so calls never cross a
boundary and pairs of pieces from different documents are skipped::

    two documents [0,3) [3,6), one rank, causal     k: 0 1 2 3 4 5
                                                q0   x . . . . .
                                                q1   x x . . . .     two square causal calls;
                                                q2   x x x . . .     the off-diagonal blocks
                                                q3   . . . x . .     are never computed
                                                q4   . . . x x .
                                                q5   . . . x x x

This module is the one home of that plan, pure integer code (no tensors, no process
group): :func:`plan_blocks` (one rank against one block), :func:`pack_groups` (how a
varlen kernel batches one step's calls), and :class:`RingPlan` / :func:`block_plans`
(every ring rank x every source block: the calls, the shard lengths, whether the ring is
local, the work per rank and the set of block shapes), which the call pipeline
(``usp_hal.pipeline.plan``), the packed-sequence summaries, the planner and the harness all read.
``usp_hal.parallel.ring`` runs the plan (and re-exports these names).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

from .positions import Segment, as_cu_seqlens, get_layout, ring_is_local, ring_segments, split_documents


@dataclass(frozen=True)
class BlockCall:
    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    causal: bool
    key_offset: int          # global position of key k_start minus that of query q_start
    masked: bool = False     # a partial block of a ``mask=`` call: the kernel gets its dense mask

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
                window=(-1, -1), positional: bool = False, diagonal: bool = False,
                cu_seqlens: Optional[Sequence[int]] = None) -> List[BlockCall]:
    """Kernel calls for local queries (``q_segs``) against one key block (``k_segs``).

    ``positional``: window/alibi are in use, so every call needs the true key offset (the
    segments must then be contiguous, step 1).  ``diagonal``: the two blocks are the same
    rank's shard, so causal on local indices *is* global causal (positions are sorted):
    one square causal call covers it when nothing positional is involved.
    ``cu_seqlens``: document boundaries (a validated tuple); queries see only keys of their
    own document.
    """
    nq, nk = sum(s.count for s in q_segs), sum(s.count for s in k_segs)
    if nq == 0 or nk == 0:
        return []
    if cu_seqlens is not None and len(cu_seqlens) > 2:
        return _document_calls(q_segs, k_segs, tuple(cu_seqlens), causal, window, positional)
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


def plan_runs(queries: Segment, runs: Sequence[Sequence[int]], *, causal: bool, window=(-1, -1),
              positional: bool = False, first: int = 0) -> List[BlockCall]:
    """Kernel calls for one query segment against keys stored as runs ``[start position,
    count]`` (in storage order, as a KV cache holds them), restricted to the keys at positions
    ``>= first`` (a left-padded prompt's first real token): the columns index the storage.
    Without a cut it is :func:`plan_blocks` over the runs; with one, each run's visible part
    is planned alone and its columns shifted to where that part sits in the storage."""
    if not runs:
        return []
    if first <= min(s for s, _ in runs):
        return plan_blocks([queries], [Segment(s, c) for s, c in runs], causal=causal, window=window,
                           positional=positional)
    calls, at = [], 0
    for start, count in runs:
        lo = max(start, first)
        if lo < start + count:
            skip = at + lo - start
            for c in plan_blocks([queries], [Segment(lo, start + count - lo)], causal=causal, window=window,
                                 positional=positional):
                calls.append(replace(c, k_start=c.k_start + skip, k_stop=c.k_stop + skip))
        at += count
    return calls


def _document_calls(q_segs, k_segs, cu, causal: bool, window, positional: bool) -> List[BlockCall]:
    """Calls for packed documents: pieces of the two blocks paired within each document."""
    keys: dict = {}
    for doc, ks, ko in split_documents(k_segs, cu):
        keys.setdefault(doc, []).append((ks, ko))
    calls: List[BlockCall] = []
    for doc, qs, qo in split_documents(q_segs, cu):
        for ks, ko in keys.get(doc, ()):
            calls += _pair_calls(qs, qo, ks, ko, causal, window, positional)
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



def pack_groups(calls: Sequence[BlockCall], windowed: bool = False) -> List[Union[BlockCall, Tuple[BlockCall, ...]]]:
    """How a kernel with a varlen entry point runs one step's calls: the causal squares as
    one packed call and the full rectangles as another (a tuple of calls; a kind with one
    call stays a plain call).  ``windowed``: a sliding window is in use, which a varlen call
    applies to every sequence from its own corner, so only squares whose key offset is 0
    are packed (for them the kernel's window is the plan's); the other calls stay plain."""
    steps: List[Union[BlockCall, Tuple[BlockCall, ...]]] = []
    if windowed:
        loose = [c for c in calls if c.key_offset != 0 or c.q_stop - c.q_start != c.k_stop - c.k_start]
        if loose:
            steps += loose
            calls = [c for c in calls if c not in loose]
    for causal in (True, False):
        group = [c for c in calls if c.causal == causal]
        if len(group) == 1:
            steps.append(group[0])
        elif group:
            steps.append(tuple(group))
    return steps


# --------------------------------------------------------------------------------- work
def call_work(calls) -> int:
    """Query-key pairs the calls score per batch row and head: a full call ``Sq*Sk``, a
    causal (square) one ``S*(S+1)/2``, as ``usp-hal run`` counts kernel work."""
    total = 0
    for c in calls:
        nq, nk = c.q_stop - c.q_start, c.k_stop - c.k_start
        total += nq * (nq + 1) // 2 if c.causal else nq * nk
    return total


def balance(work: Sequence[float]) -> Optional[float]:
    """max / min over ranks; None when some rank has nothing to do."""
    lo, hi = min(work), max(work)
    return hi / lo if lo > 0 else None


# --------------------------------------------------------------------------------- every rank x source
Block = Tuple[int, int, bool]      # (Sq, Sk, causal) of one kernel call


@dataclass(frozen=True)
class RingPlan:
    """The block plan of a whole ring: per ring rank (``rank``) and source block (``src``),
    the kernel calls of ``rank``'s queries against ``src``'s keys.  Built by
    :func:`block_plans`; every rank can build every rank's plan (no process group)."""

    segments: Tuple[Tuple[Segment, ...], ...]              # per ring rank: its shard's segments
    calls: Tuple[Tuple[Tuple[BlockCall, ...], ...], ...]   # [rank][src]
    cu_seqlens: Optional[Tuple[int, ...]] = None
    windowed: bool = False                                 # a sliding window is in use (packing keeps some apart)
    _memo: Dict[str, object] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def ring_size(self) -> int:
        return len(self.segments)

    @property
    def lengths(self) -> Tuple[int, ...]:
        """Per ring rank: its shard length."""
        return tuple(sum(s.count for s in segs) for segs in self.segments)

    @property
    def local_only(self) -> bool:
        """Packed documents, none across two ring ranks: no rank needs another's keys, so
        the ring exchanges nothing (only ever true for more than one ring rank)."""
        got = self._memo.get("local")
        if got is None:
            got = self._memo["local"] = ring_is_local(self.segments, self.cu_seqlens)
        return bool(got)

    def calls_of(self, rank: int, src: int) -> Tuple[BlockCall, ...]:
        return self.calls[rank][src]

    def step_calls(self, rank: int) -> Tuple[Tuple[BlockCall, ...], ...]:
        """``rank``'s calls per ring step, in rotation order: step ``s`` meets the block of
        ring rank ``(rank - s) mod R`` (its own block first)."""
        R = self.ring_size
        return tuple(self.calls[rank][(rank - s) % R] for s in range(R))

    def step_blocks(self, rank: int) -> Tuple[Tuple[Block, ...], ...]:
        """:meth:`step_calls` as (Sq, Sk, causal) per call."""
        return tuple(tuple(_shape(c) for c in calls) for calls in self.step_calls(rank))

    @property
    def blocks(self) -> FrozenSet[Block]:
        """(Sq, Sk, causal) of every kernel call of every rank (what a backend must accept)."""
        got = self._memo.get("blocks")
        if got is None:
            got = self._memo["blocks"] = frozenset(_shape(c) for per in self.calls for cs in per for c in cs)
        return got      # type: ignore[return-value]

    @property
    def work(self) -> Tuple[int, ...]:
        """Per ring rank: the query-key pairs its kernels score over every block (per batch
        row and head)."""
        return tuple(sum(call_work(cs) for cs in per) for per in self.calls)

    def kernel_calls(self, packed: bool = False) -> Tuple[int, ...]:
        """Per ring rank: the kernel calls of one forward over every block; ``packed``: as a
        backend with a varlen entry point runs them (packed documents only, each step's
        calls grouped by :func:`pack_groups`)."""
        pack = packed and self.cu_seqlens is not None
        return tuple(sum(len(pack_groups(cs, self.windowed)) if pack and len(cs) > 1 else len(cs) for cs in per)
                     for per in self.calls)

    def balance(self) -> Optional[float]:
        """max / min of :attr:`work` over ranks (None: a rank has none)."""
        return balance(self.work)


def _shape(c: BlockCall) -> Block:
    return (c.q_stop - c.q_start, c.k_stop - c.k_start, bool(c.causal))


def plan_ring(segments: Sequence[Sequence[Segment]], *, causal: bool, window=(-1, -1), positional: bool = False,
              cu_seqlens: Optional[Sequence[int]] = None, sorted_positions: bool = True) -> RingPlan:
    """The :class:`RingPlan` of given per-rank segments.  ``sorted_positions``: every rank's
    positions increase along its rows, so a rank's own block is causal on local indices
    (the diagonal shortcut of :func:`plan_blocks`)."""
    segs = tuple(tuple(s) for s in segments)
    cu = None if cu_seqlens is None else tuple(cu_seqlens)
    R = len(segs)
    calls = tuple(tuple(tuple(plan_blocks(segs[a], segs[src], causal=causal, window=window, positional=positional,
                                          diagonal=src == a and sorted_positions, cu_seqlens=cu))
                        for src in range(R)) for a in range(R))
    return RingPlan(segs, calls, cu, windowed=tuple(window) != (-1, -1))


def block_plans(layout, seqlen: int, ring_size: int, *, causal: bool = True, window=(-1, -1),
                positional: bool = False, cu_seqlens=None) -> RingPlan:
    """The :class:`RingPlan` of a layout (a name or a :class:`~usp_hal.sequence.positions.Layout`):
    every ring rank x every source block for a global sequence of ``seqlen`` tokens
    (``cu_seqlens``: packed documents, checked against ``seqlen``).  Cached per arguments."""
    cu = None if cu_seqlens is None else as_cu_seqlens(cu_seqlens, seqlen)
    lay = get_layout(layout)
    return _block_plans(lay, int(seqlen), int(ring_size), bool(causal), tuple(window), bool(positional), cu)


@lru_cache(maxsize=256)
def _block_plans(layout, seqlen: int, ring_size: int, causal: bool, window, positional: bool, cu) -> RingPlan:
    segs = [ring_segments(layout, seqlen, ring_size, r, cu_seqlens=cu) for r in range(ring_size)]
    return plan_ring(segs, causal=causal, window=window, positional=positional, cu_seqlens=cu)


__all__ = ["Block", "BlockCall", "RingPlan", "balance", "block_plans", "call_work", "pack_groups", "plan_blocks",
           "plan_ring", "plan_runs"]


# ------------------------------------------------------------ per-rank summaries of the plans
def ring_work(layout, seqlen: int, ring_size: int, *, causal: bool = True,
              cu_seqlens=None) -> List[int]:
    """Per ring rank: the query-key pairs its kernels score over every block of the ring
    (per batch row and head), from the block plan alone (:func:`usp_hal.sequence.blocks.block_plans`)."""
    return list(block_plans(layout, seqlen, ring_size, causal=causal, cu_seqlens=cu_seqlens).work)


def ring_calls(layout, seqlen: int, ring_size: int, *, causal: bool = True, cu_seqlens=None,
               packed: bool = False) -> List[int]:
    """Per ring rank: the kernel calls of one forward over every block of the ring, from the
    block plan alone; ``packed``: as a backend with a varlen entry point runs them (each
    step's calls packed per kind, :func:`usp_hal.parallel.ring.pack_calls`)."""
    return list(block_plans(layout, seqlen, ring_size, causal=causal, cu_seqlens=cu_seqlens).kernel_calls(packed))


def work_balance(work: Sequence[int]) -> float:
    """max / min over ranks (inf when a rank has nothing while another has work)."""
    if max(work) == 0:
        return 1.0
    got = balance(work)
    return float("inf") if got is None else got
