"""Packed sequences: several documents in one sequence, attention kept inside each document.

A packed batch is described by its global document boundaries ``cu_seqlens``: the
cumulative lengths ``[0, l1, l1+l2, ..., S]`` (FlashAttention's convention), as an
integer tensor or a list, the same on every rank and for every batch row.  Queries see
only keys of their own document; causal, window, softcap, alibi and GQA apply inside each
document as they would to that document alone (positions restart at 0 per document, and
every mask depends only on differences of positions, so global positions serve as well).

How the core runs it (no dense mask anywhere):

* the layout gives each ring rank its positions (``usp_hal.layout``); ``varlen_zigzag``
  splits every document zigzag-wise over the ring, the stream layouts (basic, zigzag,
  stripe) split the packed stream as if it were one sequence;
* the block plan (``usp_hal.ring.plan_blocks``) cuts each block's segments at the document
  boundaries (:func:`split_documents`) and pairs only pieces of the same document, so a
  kernel never sees two documents and a (query, key) block pair that shares no document
  costs nothing;
* when no document spans two ring ranks, no ring rank needs another's keys, and the ring
  exchanges nothing at all (:func:`ring_is_local`).

Helpers for models: :func:`document_positions` (position ids for RoPE, restarting at 0 per
document), :func:`document_ids`, and ``mesh.local_position_ids(S, layout, cu_seqlens=...)``.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from .layout import Segment

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


# ----------------------------------------------------------------------------- plan pieces
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


def call_work(calls) -> int:
    """Query-key pairs the calls score per batch row and head: a full call ``Sq*Sk``, a
    causal (square) one ``S*(S+1)/2``, as ``usp-hal run`` counts kernel work."""
    total = 0
    for c in calls:
        nq, nk = c.q_stop - c.q_start, c.k_stop - c.k_start
        total += nq * (nq + 1) // 2 if c.causal else nq * nk
    return total


def _ring_plans(layout, seqlen: int, ring_size: int, causal: bool, cu_seqlens):
    """Per ring rank, per source rank: the block plan (no process group)."""
    from .layout import ring_segments
    from .ring import plan_blocks
    cu = None if cu_seqlens is None else as_cu_seqlens(cu_seqlens, seqlen)
    segs = [ring_segments(layout, seqlen, ring_size, r, cu_seqlens=cu) for r in range(ring_size)]
    return [[plan_blocks(segs[r], segs[s], causal=causal, diagonal=r == s, cu_seqlens=cu) for s in range(ring_size)]
            for r in range(ring_size)], cu


def ring_work(layout, seqlen: int, ring_size: int, *, causal: bool = True,
              cu_seqlens=None) -> List[int]:
    """Per ring rank: the query-key pairs its kernels score over every block of the ring
    (per batch row and head), from the block plan alone (no process group)."""
    plans, _ = _ring_plans(layout, seqlen, ring_size, causal, cu_seqlens)
    return [sum(call_work(calls) for calls in per_src) for per_src in plans]


def ring_calls(layout, seqlen: int, ring_size: int, *, causal: bool = True, cu_seqlens=None,
               packed: bool = False) -> List[int]:
    """Per ring rank: the kernel calls of one forward over every block of the ring, from the
    block plan alone; ``packed``: as a backend with a varlen entry point runs them (each
    step's calls packed per kind, :func:`usp_hal.ring.pack_calls`)."""
    from .ring import pack_calls
    plans, cu = _ring_plans(layout, seqlen, ring_size, causal, cu_seqlens)
    pack = packed and cu is not None
    return [sum(len(pack_calls(calls)) if pack and len(calls) > 1 else len(calls) for calls in per_src)
            for per_src in plans]


def work_balance(work: Sequence[int]) -> float:
    """max / min over ranks (inf when a rank has nothing while another has work)."""
    lo, hi = min(work), max(work)
    if hi == 0:
        return 1.0
    return hi / lo if lo > 0 else float("inf")


# ----------------------------------------------------------------------------- positions
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


def reference_packed_attention(q, k, v, cu_seqlens, **kw):
    """Float64 single-process attention of every document on its own, concatenated:
    the truth a packed USP call is compared against (``usp_hal.reference``, per document).
    ``kw``: the arguments of :func:`usp_hal.reference.reference_attention`."""
    from .reference import reference_attention
    cu = as_cu_seqlens(cu_seqlens, q.shape[1])
    parts = [reference_attention(q[:, a:b], k[:, a:b], v[:, a:b], **kw) for a, b in zip(cu, cu[1:])]
    return torch.cat([o for o, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=2)


__all__ = ["as_cu_seqlens", "cu_seqlens_from_lengths", "equal_documents", "split_documents", "ring_is_local",
           "call_work", "ring_work", "work_balance", "document_ids", "document_positions", "split_by_documents",
           "reference_packed_attention"]
