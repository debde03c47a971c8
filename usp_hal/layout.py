"""Sequence layouts: which global positions each rank holds.

A layout assigns each *ring* rank a shard of the global sequence; inside a ring rank's
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
ring plan (``usp_hal.ring.plan_blocks``) works on segments, so every layout and every
uneven length is exact.

Packed sequences: every function here takes ``cu_seqlens`` (the global document
boundaries, see ``usp_hal.varlen``).  The stream layouts (basic, zigzag, stripe) split the
packed stream as one sequence and ignore the boundaries; a per-document layout
(``varlen_zigzag``) splits each document.  A per-document layout without ``cu_seqlens``
treats the whole sequence as one document.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch


@dataclass(frozen=True)
class Segment:
    """Positions ``start + i * step`` for ``i in range(count)``."""

    start: int
    count: int
    step: int = 1

    def positions(self) -> List[int]:
        return [self.start + i * self.step for i in range(self.count)]


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
    ``ring_impl_type`` / ``EXTRACT_FUNC_DICT`` key yunchang uses for the same layout.

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

    def segments(self, seqlen: int, ring_size: int, ring_rank: int, cu_seqlens=None) -> List[Segment]:
        if not 0 <= ring_rank < ring_size:
            raise ValueError(f"ring_rank={ring_rank} outside 0..{ring_size - 1}")
        if cu_seqlens is not None:
            from .varlen import as_cu_seqlens
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
    EXTRACT_FUNC_DICT[layout.yunchang_name or layout.name] = _yunchang_extract(layout.name)
    return layout


def layout_names() -> List[str]:
    return list(LAYOUTS)


def get_layout(layout: "Union[str, Layout]") -> Layout:
    """The :class:`Layout` for a name (or the object itself); ValueError listing the valid names."""
    if isinstance(layout, Layout):
        return layout
    try:
        return LAYOUTS[str(layout)]
    except KeyError:
        raise ValueError(f"unknown layout / ring_impl_type {layout!r}; valid: {', '.join(LAYOUTS)}") from None


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


# --------------------------------------------------------------------------- public helpers
def _mesh_coords(mesh):
    from .mesh import get_default_mesh
    mesh = mesh if mesh is not None else get_default_mesh()
    return mesh


def shard(x: torch.Tensor, layout: str = "basic", mesh=None, seq_dim: int = 1, *, cu_seqlens=None) -> torch.Tensor:
    """This rank's part of a global tensor (every rank passes the same global ``x``).

    ``cu_seqlens``: the document boundaries of a packed ``x`` (``[0, l1, l1+l2, ..., S]``,
    see ``usp_hal.varlen``); a per-document layout such as ``"varlen_zigzag"`` splits every
    document, the other layouts split the packed stream and only check the boundaries.
    Pass the same ``cu_seqlens`` to the attention call and to :func:`unshard`."""
    mesh = _mesh_coords(mesh)
    pos = local_positions(check_layout(layout), x.shape[seq_dim], mesh.ring_degree, mesh.ulysses_degree,
                          mesh.ring_rank, mesh.ulysses_rank, cu_seqlens=cu_seqlens).to(x.device)
    return x.index_select(seq_dim, pos)


def unshard(local: torch.Tensor, layout: str = "basic", mesh=None, seq_dim: int = 1, *,
            reduce_grad: bool = False, cu_seqlens=None) -> torch.Tensor:
    """Collective inverse of :func:`shard` over the mesh's sequence-parallel group:
    every rank gets the global tensor back (uneven shards included).  A packed tensor
    needs the ``cu_seqlens`` it was sharded with (every rank must pass the same; checked).

    Every rank's shape (except along ``seq_dim``), dtype and length are checked against the
    layout first, with one small metadata exchange, so a mismatch raises the same
    ``ValueError`` on every rank instead of breaking the data collective.

    Differentiable: the backward gives each rank its own slice (in the layout) of the
    gradient of the global tensor.  That is the gradient when every rank computes the same
    function of the gathered tensor (a loss on the full output, the usual case).  When ranks
    compute different functions of it, pass ``reduce_grad=True``: the gradients of the global
    tensor are summed over the group first (one all-reduce).
    """
    mesh = _mesh_coords(mesh)
    check_layout(layout)
    if not isinstance(local, torch.Tensor):
        raise TypeError(f"unshard: expected a tensor, got {type(local).__name__}")
    if mesh.sp_size == 1:
        if cu_seqlens is not None:
            from .varlen import as_cu_seqlens
            as_cu_seqlens(cu_seqlens, local.shape[_normalize_dim(seq_dim, local.dim())])
        return local
    cu = None
    if cu_seqlens is not None:
        from .varlen import as_cu_seqlens
        cu = as_cu_seqlens(cu_seqlens)
    return _Unshard.apply(local, layout, mesh, _normalize_dim(seq_dim, local.dim()), bool(reduce_grad), cu)


def _normalize_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"seq_dim={dim} is out of range for a {ndim}-D tensor")
    return dim % ndim


_MAX_DIMS = 8


def _unshard_check(local: torch.Tensor, layout: str, mesh, seq_dim: int, cu=None) -> list:
    """Per-rank lengths after checking every rank's dims/dtype (and document boundaries)
    against this rank's."""
    from .comm import all_gather_ints, dtype_code
    from .spec import digest_ints
    if local.dim() > _MAX_DIMS:
        raise ValueError(f"unshard: at most {_MAX_DIMS} dims are supported, got {local.dim()}")
    dims = [int(x) for x in local.shape] + [-1] * (_MAX_DIMS - local.dim())
    docs = 0 if cu is None else digest_ints(cu)
    meta = [int(local.shape[seq_dim]), local.dim(), seq_dim, dtype_code(local.dtype), docs] + dims
    rows = all_gather_ints(meta, mesh.sp_group)
    sizes = [r[0] for r in rows]
    diffs = []
    for label, idx in (("ndim", 1), ("seq_dim", 2), ("dtype", 3), ("cu_seqlens (digest)", 4)):
        vals = [r[idx] for r in rows]
        if len(set(vals)) > 1:
            diffs.append(f"{label}: " + ", ".join(f"rank {mesh.sp_ranks[i]}={v}" for i, v in enumerate(vals)))
    if not diffs:
        other = [tuple(x for j, x in enumerate(r[5:]) if j != seq_dim) for r in rows]
        if len(set(other)) > 1:
            diffs.append("shape (except seq_dim): " + ", ".join(
                f"rank {mesh.sp_ranks[i]}={tuple(x for x in r[5:] if x >= 0)}" for i, r in enumerate(rows)))
    if diffs:
        raise ValueError("unshard: the ranks' parts do not fit together (every rank must pass its part of the "
                         "same tensor):\n  " + "\n  ".join(diffs))
    seqlen = sum(sizes)
    if cu is not None and cu[-1] != seqlen:
        raise ValueError(f"unshard: cu_seqlens ends at {cu[-1]}, but the parts hold {seqlen} tokens in all")
    expect = [local_lengths(layout, seqlen, mesh.ring_degree, mesh.ulysses_degree,
                            cu_seqlens=cu)[mesh.ring_of(i)][mesh.ulysses_of(i)]
              for i in range(mesh.sp_size)]
    if sizes != expect:
        raise ValueError(f"unshard: per-rank lengths {sizes} do not match layout {layout!r} for S={seqlen} "
                         f"(expected {expect}); were the parts made with usp_hal.shard?")
    return sizes


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, layout, mesh, seq_dim, reduce_grad, cu=None):
        import torch.distributed as dist
        sizes = _unshard_check(local, layout, mesh, seq_dim, cu)
        seqlen = sum(sizes)
        width = max(sizes)
        pad = list(local.shape)
        pad[seq_dim] = width - local.shape[seq_dim]
        padded = torch.cat([local, local.new_zeros(pad)], dim=seq_dim).contiguous() if pad[seq_dim] else \
            local.contiguous()
        gathered = [torch.empty_like(padded) for _ in range(mesh.sp_size)]
        dist.all_gather(gathered, padded, group=mesh.sp_group)
        out_shape = list(local.shape)
        out_shape[seq_dim] = seqlen
        out = local.new_empty(out_shape)
        for i, part in enumerate(gathered):
            pos = local_positions(layout, seqlen, mesh.ring_degree, mesh.ulysses_degree,
                                  mesh.ring_of(i), mesh.ulysses_of(i), cu_seqlens=cu).to(local.device)
            out.index_copy_(seq_dim, pos, part.narrow(seq_dim, 0, sizes[i]))
        ctx.layout, ctx.mesh, ctx.seq_dim, ctx.reduce_grad, ctx.seqlen = layout, mesh, seq_dim, reduce_grad, seqlen
        ctx.cu = cu
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        mesh = ctx.mesh
        if ctx.reduce_grad:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=mesh.sp_group)
        pos = local_positions(ctx.layout, ctx.seqlen, mesh.ring_degree, mesh.ulysses_degree,
                              mesh.ring_rank, mesh.ulysses_rank, cu_seqlens=ctx.cu).to(grad.device)
        return grad.index_select(ctx.seq_dim, pos), None, None, None, None, None


def _yunchang_extract(layout: str):
    def extract(value, rank, world_size, rd, ud, *args, cu_seqlens=None, **kwargs):
        """yunchang-compatible: ``value`` is global along dim 1; ``rank`` is the rank inside the
        sequence-parallel group with Ulysses ranks contiguous (``use_ulysses_low=True``).
        ``cu_seqlens``: document boundaries of a packed ``value``."""
        if rd * ud != world_size:
            raise ValueError(f"ring degree {rd} x ulysses degree {ud} != world size {world_size}")
        ring_rank, ulysses_rank = divmod(rank, ud)
        pos = local_positions(layout, value.shape[1], rd, ud, ring_rank, ulysses_rank,
                              cu_seqlens=cu_seqlens).to(value.device)
        return value.index_select(1, pos).detach().clone()
    extract.__name__ = f"{layout}_extract_local"
    return extract


EXTRACT_FUNC_DICT: Dict[str, Callable] = {}

register_layout(Layout("basic", _basic, contiguous=True, balances_causal=False,
                       description="rank r holds chunk r of R contiguous chunks", yunchang_name="basic"))
register_layout(Layout("zigzag", _zigzag, contiguous=True, balances_causal=True,
                       description="2R chunks; rank r holds chunks r and 2R-1-r", yunchang_name="zigzag"))
register_layout(Layout("stripe", _stripe, contiguous=False, balances_causal=True,
                       description="rank r holds positions r, r+R, r+2R, ...", yunchang_name="stripe"))
register_layout(Layout("varlen_zigzag", _zigzag, contiguous=True, balances_causal=True,
                       description="packed documents (cu_seqlens): each document in 2R chunks, chunk pair "
                                   "(j, 2R-1-j) to one rank, balanced per document",
                       per_document=_varlen_zigzag))
