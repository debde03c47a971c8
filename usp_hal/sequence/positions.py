"""Pure position code: which global positions each rank holds, and where documents begin.

No process group, no mesh, no kernel: integers and index tensors only, so every other
module (the ring plan, the planner, the mesh, the collectives in ``usp_hal.parallel.sharding``) can
build on it, and it imports nothing of the package.

* :class:`Segment`: an arithmetic progression of global positions (a shard is a list of them);
* document boundaries of a packed sequence (``cu_seqlens``): :func:`as_cu_seqlens`,
  :func:`split_documents` (a block's segments cut at the boundaries), :func:`ring_is_local`,
  :func:`document_ids`, :func:`document_positions`;
* layouts (:class:`Layout`, the ``LAYOUTS`` table, :func:`register_layout`): the split of a
  global sequence over the ring ranks, and inside each ring rank over the Ulysses ranks
  (:func:`local_positions`, :func:`local_lengths`, :func:`ring_segments`); yunchang's
  ``EXTRACT_FUNC_DICT`` over them is :mod:`usp_hal.compat.extract` (it reads the default mesh).

Layouts in detail.  A layout assigns each *ring* rank a shard of the global sequence; inside a ring rank's
shard, the Ulysses ranks hold contiguous, as-even-as-possible parts (like
``torch.tensor_split``).  After the Ulysses all-to-all every ring rank therefore holds its
whole layout shard, in order.

Layouts (R = ring degree, any global length S)::

    basic   rank r holds chunk r of R contiguous chunks
    zigzag  2R chunks; rank r holds chunks r and 2R-1-r (balanced causal work)
    stripe  rank r holds positions r, r+R, r+2R, ... (balanced causal work)
    varlen_zigzag
            packed documents (``cu_seqlens``): every document cut into 2R chunks and
            dealt zigzag-wise, chunk pair (j, 2R-1-j) to one rank (balanced causal
            work per document); see :func:`_varlen_zigzag`

    causal work per rank, R = 2, S = 8 (x = computed score)
    basic:  rank0 q0-3 x 10   rank1 q4-7 x 26
    zigzag: rank0 {0,1,6,7}   rank1 {2,3,4,5}   -> 18 each
    stripe: rank0 {0,2,4,6}   rank1 {1,3,5,7}   -> 16 / 20

A shard is described by :class:`Segment` s (arithmetic progressions of positions); the
ring plan (``usp_hal.sequence.blocks.block_plans``) works on segments, so every layout and every
uneven length is exact.

Packed sequences: every function here takes ``cu_seqlens`` (the global document
boundaries, see docs/varlen.md).  The stream layouts (basic, zigzag, stripe) split the
packed stream as one sequence and ignore the boundaries; a per-document layout
(``varlen_zigzag``) splits each document.  A per-document layout without ``cu_seqlens``
treats the whole sequence as one document.

Where the code lives: the layouts and every position computation are pure functions here
(no process group); :func:`usp_hal.shard` and :func:`usp_hal.unshard` are in
:mod:`usp_hal.parallel.sharding`.
"""
from __future__ import annotations

import functools
from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch


@dataclass(frozen=True)
class Segment:
    """Positions ``start + i * step`` for ``i in range(count)``."""

    start: int
    count: int
    step: int = 1

    def positions(self) -> List[int]:
        return [self.start + i * self.step for i in range(self.count)]


# ------------------------------------------------------------------- document boundaries
CuSeqlens = Tuple[int, ...]


def as_cu_seqlens(cu_seqlens, seqlen: Optional[int] = None) -> CuSeqlens:
    """``cu_seqlens`` (1-D integer tensor, list or tuple) as a tuple of ints, checked:
    at least two entries, starting at 0, non-decreasing (empty documents are allowed),
    and ending at ``seqlen`` when given.  ValueError/TypeError naming the problem.

    A tensor on an accelerator is copied to the host (one small synchronisation); pass a
    list or a CPU tensor to avoid it."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"cu_seqlens must be an integer tensor (int32 or int64), got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D [num_docs + 1], got shape {tuple(cu_seqlens.shape)}")
        values = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, (list, tuple)):
        values = list(cu_seqlens)
        for x in values:
            if isinstance(x, bool) or not isinstance(x, int):
                if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.dtype.is_floating_point:
                    continue
                raise TypeError(f"cu_seqlens entries must be integers, got {x!r} ({type(x).__name__})")
        values = [int(x) for x in values]
    else:
        raise TypeError(f"cu_seqlens must be a 1-D integer tensor or a list of ints, got {type(cu_seqlens).__name__}")
    if len(values) < 2:
        raise ValueError(f"cu_seqlens needs at least two entries [0, ..., S], got {values}")
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 (document boundaries [0, l1, l1+l2, ..., S]), "
                         f"got {_brief(values)}")
    bad = next((i for i in range(1, len(values)) if values[i] < values[i - 1]), None)
    if bad is not None:
        raise ValueError(f"cu_seqlens must be non-decreasing (cumulative document lengths), but entry {bad} "
                         f"({values[bad]}) < entry {bad - 1} ({values[bad - 1]}): {_brief(values)}")
    if seqlen is not None and values[-1] != seqlen:
        raise ValueError(f"cu_seqlens ends at {values[-1]}, but the global sequence has {seqlen} tokens "
                         f"(the last boundary must be the total length S)")
    return tuple(values)


def _brief(values: Sequence[int], n: int = 8) -> str:
    vals = list(values)
    return str(vals) if len(vals) <= n else "[" + ", ".join(map(str, vals[:n])) + f", ... ({len(vals)} entries)]"


def cu_seqlens_from_lengths(lengths: Iterable[int]) -> CuSeqlens:
    """``[l1, l2, ...]`` -> ``(0, l1, l1+l2, ...)``."""
    out, total = [0], 0
    for n in lengths:
        n = int(n)
        if n < 0:
            raise ValueError(f"document lengths must be >= 0, got {n}")
        total += n
        out.append(total)
    return tuple(out)


def equal_documents(seqlen: int, docs: int) -> CuSeqlens:
    """Boundaries of ``docs`` documents of (as) equal (as possible) lengths covering ``seqlen``
    tokens; the first ``seqlen % docs`` get one token more."""
    if docs < 1:
        raise ValueError(f"the number of documents must be >= 1, got {docs}")
    base, extra = divmod(int(seqlen), docs)
    return cu_seqlens_from_lengths(base + (1 if i < extra else 0) for i in range(docs))


def num_documents(cu: CuSeqlens) -> int:
    return len(cu) - 1


def is_single_document(cu: Optional[CuSeqlens]) -> bool:
    """No boundaries, or only empty documents besides one (the plan is then the plain one)."""
    return cu is None or sum(1 for a, b in zip(cu, cu[1:]) if b > a) <= 1


def split_documents(segments: Sequence[Segment], cu: CuSeqlens) -> List[Tuple[int, Segment, int]]:
    """Cut a block's segments at the document boundaries.

    Returns ``(document index, piece, offset)`` for every non-empty piece, in block order,
    where ``offset`` is the piece's first row in the block (the segments' concatenation).
    Pieces keep the segment's step, so stripe segments give stripe pieces::

        cu = (0, 3, 8), segments [Segment(1, 6)] (positions 1..6)
        -> (0, Segment(1, 2), 0), (1, Segment(3, 4), 2)
    """
    out: List[Tuple[int, Segment, int]] = []
    offset = 0
    last_doc = len(cu) - 2
    for seg in segments:
        if seg.count <= 0:
            continue
        step = seg.step
        i = 0                                   # index of the next position of seg to place
        pos = seg.start
        doc = bisect_right(cu, pos) - 1
        while i < seg.count:
            if doc > last_doc or pos >= cu[-1] or pos < 0:
                raise ValueError(f"position {pos} of {seg} lies outside the documents [0, {cu[-1]})")
            end = cu[doc + 1]                   # positions < end belong to this document
            n = min(seg.count - i, -(-(end - pos) // step))
            out.append((doc, Segment(pos, n, step), offset + i))
            i += n
            pos = seg.start + i * step
            if i < seg.count:
                doc = bisect_right(cu, pos) - 1
        offset += seg.count
    return out


def documents_of(segments: Sequence[Segment], cu: CuSeqlens) -> set:
    return {doc for doc, _, _ in split_documents(segments, cu)}


def ring_is_local(segments_per_rank: Sequence[Sequence[Segment]], cu: Optional[CuSeqlens]) -> bool:
    """True when no document has tokens on two ring ranks: then no ring rank needs any
    other's keys, and the ring can skip its K/V exchange (and the dK/dV one) entirely."""
    if cu is None or len(segments_per_rank) <= 1:
        return False
    seen: set = set()
    for segs in segments_per_rank:
        mine = documents_of(segs, cu)
        if mine & seen:
            return False
        seen |= mine
    return True


def document_ids(positions: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """The document index of each global position (same shape, int64)."""
    cu = as_cu_seqlens(cu_seqlens)
    bounds = torch.tensor(cu[1:], dtype=torch.long, device=positions.device)
    pos = positions.to(torch.long)
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= cu[-1]):
        raise ValueError(f"positions must lie in [0, {cu[-1]}) (the packed sequence), got "
                         f"{int(pos.min())}..{int(pos.max())}")
    return torch.bucketize(pos, bounds, right=True)


def document_positions(positions: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """Position of each global position inside its own document (what rotary embeddings
    of a packed batch need: 0, 1, ... restarting at every document boundary)."""
    cu = as_cu_seqlens(cu_seqlens)
    starts = torch.tensor(cu[:-1], dtype=torch.long, device=positions.device)
    return positions.to(torch.long) - starts[document_ids(positions, cu)]


def split_by_documents(x: torch.Tensor, cu_seqlens, dim: int = 1) -> List[torch.Tensor]:
    """A global packed tensor cut into its documents along ``dim`` (views)."""
    cu = as_cu_seqlens(cu_seqlens, x.shape[dim])
    return [x.narrow(dim, a, b - a) for a, b in zip(cu, cu[1:])]


# ------------------------------------------------------------------------------- layouts
def _split_sizes(n: int, parts: int) -> List[int]:
    """Sizes of torch.tensor_split(range(n), parts): the first n % parts get one more."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _split_starts(n: int, parts: int) -> List[int]:
    sizes = _split_sizes(n, parts)
    return [sum(sizes[:i]) for i in range(parts)]


def _basic(seqlen: int, ring_size: int, ring_rank: int) -> List[Segment]:
    starts, sizes = _split_starts(seqlen, ring_size), _split_sizes(seqlen, ring_size)
    return [Segment(starts[ring_rank], sizes[ring_rank])]


def _zigzag(seqlen: int, ring_size: int, ring_rank: int) -> List[Segment]:
    starts, sizes = _split_starts(seqlen, 2 * ring_size), _split_sizes(seqlen, 2 * ring_size)
    a, b = ring_rank, 2 * ring_size - 1 - ring_rank
    return [Segment(starts[a], sizes[a]), Segment(starts[b], sizes[b])]


def _stripe(seqlen: int, ring_size: int, ring_rank: int) -> List[Segment]:
    count = max(0, (seqlen - ring_rank + ring_size - 1) // ring_size)
    return [Segment(ring_rank, count, ring_size)]


def _rows_work(start: int, count: int) -> int:
    """Causal query-key pairs of the rows at document positions start..start+count-1
    (row p sees p + 1 keys)."""
    return count * start + count * (count + 1) // 2


@functools.lru_cache(maxsize=64)
def _varlen_zigzag(cu: Tuple[int, ...], ring_size: int) -> Tuple[Tuple[Segment, ...], ...]:
    """Every ring rank's segments for packed documents ``cu``, zigzag per document.

    Each document is cut into 2R chunks (``tensor_split`` sizes); chunk pair
    ``(j, 2R-1-j)`` goes to one rank, so each rank gets one early and one late chunk of
    every document, as ring-flash-attention's varlen zigzag does.  When every length is a
    multiple of 2R, rank r gets pair r of every document, exactly that layout.  Otherwise
    (any length is allowed) the pairs of a document differ in causal work, and they are
    dealt heaviest first to the ranks with the least work so far, so uneven and tiny
    documents (shorter than 2R, or of length 1) do not pile up on the first ranks::

        cu = (0, 8, 16), R = 2: doc 0 chunks [0,2) [2,4) [4,6) [6,8)
        rank 0: [0,2) [6,8) [8,10) [14,16)     rank 1: [2,4) [4,6) [10,12) [12,14)
    """
    R = ring_size
    load = [0] * R
    per_rank: List[List[Segment]] = [[] for _ in range(R)]
    for a, b in zip(cu, cu[1:]):
        n = b - a
        if n <= 0:
            continue
        sizes = _split_sizes(n, 2 * R)
        starts = [sum(sizes[:i]) for i in range(2 * R)]
        work = [_rows_work(starts[j], sizes[j]) + _rows_work(starts[2 * R - 1 - j], sizes[2 * R - 1 - j])
                for j in range(R)]
        pairs = sorted(range(R), key=lambda j: -work[j])          # stable: equal work keeps pair order
        ranks = sorted(range(R), key=lambda r: load[r])           # stable: equal load keeps rank order
        for j, r in zip(pairs, ranks):
            load[r] += work[j]
            for c in (j, 2 * R - 1 - j):
                if sizes[c]:
                    _append(per_rank[r], Segment(a + starts[c], sizes[c]))
    return tuple(tuple(segs) for segs in per_rank)


def _append(segs: List[Segment], seg: Segment) -> None:
    """Append a step-1 segment, fusing it with the previous one when they touch."""
    if segs and segs[-1].step == 1 and segs[-1].start + segs[-1].count == seg.start:
        segs[-1] = Segment(segs[-1].start, segs[-1].count + seg.count)
    else:
        segs.append(seg)


@dataclass(frozen=True)
class Layout:
    """Which global positions each ring rank holds: a named, pure function of
    ``(seqlen, ring_size, ring_rank)`` returning :class:`Segment` s.

    ``contiguous``: every segment has step 1, so window/alibi offsets between ring blocks
    form a band and positional masks stay exact across blocks.  ``yunchang_name`` is the
    ``ring_impl_type`` / ``EXTRACT_FUNC_DICT`` key yunchang uses for the same layout
    (:mod:`usp_hal.compat.extract`).

    ``per_document``: a layout of packed documents, ``(cu_seqlens, ring_size)`` -> every
    ring rank's segments (``split`` is then unused); without ``cu_seqlens`` the whole
    sequence is one document.  Other layouts split the packed stream as one sequence.
    """

    name: str
    split: Callable[[int, int, int], List[Segment]]
    contiguous: bool = True
    balances_causal: bool = False
    description: str = ""
    yunchang_name: Optional[str] = None
    per_document: Optional[Callable[[Tuple[int, ...], int], Sequence[Sequence[Segment]]]] = None
    #: ``(seqlen, ring_size)`` the layout was made for (``usp_hal.sequence.masks.balanced_layout``), None: any
    fixed: Optional[Tuple[int, int]] = None

    def segments(self, seqlen: int, ring_size: int, ring_rank: int, cu_seqlens=None) -> List[Segment]:
        if not 0 <= ring_rank < ring_size:
            raise ValueError(f"ring_rank={ring_rank} outside 0..{ring_size - 1}")
        if cu_seqlens is not None:
            cu_seqlens = as_cu_seqlens(cu_seqlens, seqlen)
        if ring_size == 1:
            return [Segment(0, seqlen)]
        if self.per_document is not None:
            cu = cu_seqlens if cu_seqlens is not None else (0, seqlen)
            return list(self.per_document(cu, ring_size)[ring_rank])
        return self.split(seqlen, ring_size, ring_rank)

    def __str__(self) -> str:
        return self.name


LAYOUTS: Dict[str, Layout] = {}
"""Every registered layout by name (the CLI's choices and the module's validation read it)."""


def register_layout(layout: Layout, *, override: bool = False) -> Layout:
    """Add a layout to the table: ``LongContextAttention(ring_impl_type=name)``, ``shard``,
    ``unshard``, ``EXTRACT_FUNC_DICT`` and the CLI accept it from then on."""
    if layout.name in LAYOUTS and not override:
        raise ValueError(f"layout {layout.name!r} is already registered (pass override=True to replace it)")
    LAYOUTS[layout.name] = layout
    return layout


#: yunchang 0.6.4's other ``ring_impl_type`` names, as the layout each shards with
#: (yunchang/hybrid/utils.py ``RING_IMPL_DICT``, yunchang/comm/extract_local.py ``EXTRACT_FUNC_DICT``):
#: "strip" is the stripe layout; the ``basic_*`` rings (torch SDPA, FlashInfer, Ascend NPU kernels)
#: shard like "basic" (the kernel is ``attn_type`` here)
LAYOUT_ALIASES: Dict[str, str] = {"strip": "stripe", "basic_pytorch": "basic", "basic_flashinfer": "basic",
                                  "basic_npu": "basic"}


def layout_names(general: bool = True) -> List[str]:
    """The registered layouts; ``general``: only those valid for any length (not a layout made
    for one sequence, such as a ``balanced_layout``)."""
    return [n for n, lay in LAYOUTS.items() if not general or lay.fixed is None]


def get_layout(layout: "Union[str, Layout]") -> Layout:
    """The :class:`Layout` for a name (or the object itself); ValueError listing the valid names."""
    if isinstance(layout, Layout):
        return layout
    name = str(layout)
    try:
        return LAYOUTS[LAYOUT_ALIASES.get(name, name)]
    except KeyError:
        raise ValueError(f"unknown layout / ring_impl_type {layout!r}; valid: {', '.join([*LAYOUTS, *LAYOUT_ALIASES])}"
                         ) from None


def check_layout(layout: "Union[str, Layout]") -> str:
    return get_layout(layout).name


def ring_segments(layout: "Union[str, Layout]", seqlen: int, ring_size: int, ring_rank: int, *,
                  cu_seqlens=None) -> List[Segment]:
    """The segments of global positions held by ``ring_rank`` (before the Ulysses split)."""
    return get_layout(layout).segments(seqlen, ring_size, ring_rank, cu_seqlens)


def shard_lengths(layout: str, seqlen: int, ring_size: int, *, cu_seqlens=None) -> List[int]:
    return [sum(s.count for s in ring_segments(layout, seqlen, ring_size, r, cu_seqlens=cu_seqlens))
            for r in range(ring_size)]


def local_lengths(layout: str, seqlen: int, ring_size: int, ulysses_size: int, *,
                  cu_seqlens=None) -> List[List[int]]:
    """``[ring_rank][ulysses_rank]`` -> number of tokens that rank holds."""
    return [_split_sizes(n, ulysses_size) for n in shard_lengths(layout, seqlen, ring_size, cu_seqlens=cu_seqlens)]


def segments_from_positions(pos: torch.Tensor) -> List[Segment]:
    """``pos`` (global positions in local order) as maximal runs of consecutive positions."""
    p = [int(x) for x in pos.tolist()]
    out: List[Segment] = []
    i = 0
    while i < len(p):
        j = i
        while j + 1 < len(p) and p[j + 1] == p[j] + 1:
            j += 1
        out.append(Segment(p[i], j - i + 1))
        i = j + 1
    return out


def segment_positions(segments: List[Segment]) -> torch.Tensor:
    parts = [torch.arange(s.start, s.start + s.count * s.step, s.step, dtype=torch.long)
             if s.count else torch.zeros(0, dtype=torch.long) for s in segments]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def local_positions(layout: str, seqlen: int, ring_size: int, ulysses_size: int,
                    ring_rank: int, ulysses_rank: int, *, cu_seqlens=None) -> torch.Tensor:
    """Global positions held by (ring_rank, ulysses_rank), in local order."""
    pos = segment_positions(ring_segments(layout, seqlen, ring_size, ring_rank, cu_seqlens=cu_seqlens))
    return torch.tensor_split(pos, ulysses_size)[ulysses_rank]


def permutation(layout: str, seqlen: int, ring_size: int, ulysses_size: int = 1, *, cu_seqlens=None) -> torch.Tensor:
    """Global positions in sequence-rank order (ring-major, then ulysses): the
    concatenation of every rank's local positions.  ``x[:, perm]`` lays a global tensor
    out rank after rank; ``argsort(perm)`` restores it."""
    return torch.cat([local_positions(layout, seqlen, ring_size, ulysses_size, r, u, cu_seqlens=cu_seqlens)
                      for r in range(ring_size) for u in range(ulysses_size)])


register_layout(Layout("basic", _basic, contiguous=True, balances_causal=False,
                       description="rank r holds chunk r of R contiguous chunks", yunchang_name="basic"))
register_layout(Layout("zigzag", _zigzag, contiguous=True, balances_causal=True,
                       description="2R chunks; rank r holds chunks r and 2R-1-r", yunchang_name="zigzag"))
register_layout(Layout("stripe", _stripe, contiguous=False, balances_causal=True,
                       description="rank r holds positions r, r+R, r+2R, ...", yunchang_name="strip"))
register_layout(Layout("varlen_zigzag", _zigzag, contiguous=True, balances_causal=True,
                       description="packed documents (cu_seqlens): each document in 2R chunks, chunk pair "
                                   "(j, 2R-1-j) to one rank, balanced per document",
                       per_document=_varlen_zigzag))
