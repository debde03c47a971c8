"""The collectives of the public API: :func:`shard` (local) and :func:`unshard` (an
all-gather over the mesh's sequence-parallel group), on top of the pure position code of
``usp_hal.sequence.positions``.

:func:`unshard` validates its arguments on every rank and agrees on them
(``usp_hal.parallel.comm.agree``) before its data collective: a bad argument on any one rank (a
``seq_dim`` out of range, a part of more than 8 dims, ``cu_seqlens`` that do not fit, parts of
different shapes) raises the same ``ValueError`` on every rank, and no rank is left waiting in
the all-gather.
"""
from __future__ import annotations

import zlib
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..sequence.positions import as_cu_seqlens, check_layout, local_lengths, local_positions
from .comm import agree, collective, digest_ints, dtype_code
from .mesh import get_default_mesh

MAX_DIMS = 8
"""The most dims a part given to :func:`unshard` may have (the metadata vector is fixed)."""

# the per-rank vector unshard agrees on: these fields, then MAX_DIMS sizes (-1 beyond ndim)
_FIELDS = ("length", "ndim", "seq_dim", "dtype", "cu_seqlens (digest)", "layout", "reduce_grad")
_WIDTH = len(_FIELDS) + MAX_DIMS


def _mesh(mesh):
    return mesh if mesh is not None else get_default_mesh()


def normalize_dim(dim: int, ndim: int) -> int:
    """``dim`` in ``0..ndim-1``; ValueError when it is out of range for an ``ndim``-D tensor."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"seq_dim must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"seq_dim={dim} is out of range for a {ndim}-D tensor")
    return dim % ndim


def empty_rank_problem(mesh, layout: str, seqlen: int, cu_seqlens=None, what: str = "a sequence") -> Optional[str]:
    """Why a sequence of ``seqlen`` tokens cannot go to a model sharded over ``mesh`` in
    ``layout``: it leaves a rank without a token, which the model's layers cannot take (their
    reshapes to ``[B, S_local, heads, D]``); None when every rank holds one.  The same arithmetic
    on every rank, so every rank that asks refuses alike."""
    if mesh.sp_size == 1:
        return None

    def fewest(n: int, cu=None) -> int:
        return min(min(row) for row in local_lengths(layout, n, mesh.ring_degree, mesh.ulysses_degree,
                                                     cu_seqlens=cu))
    if fewest(seqlen, cu_seqlens) > 0:
        return None
    least = next(n for n in range(mesh.sp_size, 64 * mesh.sp_size + 1) if fewest(n) > 0)
    return (f"{what} of {seqlen} tokens leaves a rank of the {mesh.ulysses_degree} x {mesh.ring_degree} (ulysses x "
            f"ring) group without a token in the {layout!r} layout; sequences need at least {least} tokens here. Run "
            "shorter ones without sequence parallelism (a one-rank mesh), or pad them")


def shard(x: torch.Tensor, layout: str = "basic", mesh=None, seq_dim: int = 1, *, cu_seqlens=None) -> torch.Tensor:
    """This rank's part of a global tensor (every rank passes the same global ``x``).

    ``cu_seqlens``: the document boundaries of a packed ``x`` (``[0, l1, l1+l2, ..., S]``,
    see docs/varlen.md); a per-document layout such as ``"varlen_zigzag"`` splits every
    document, the other layouts split the packed stream and only check the boundaries.
    Pass the same ``cu_seqlens`` to the attention call and to :func:`unshard`.

    Purely local (no collective): a bad argument raises on the rank that passed it only."""
    mesh = _mesh(mesh)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"shard: expected a tensor, got {type(x).__name__}")
    dim = normalize_dim(seq_dim, x.dim())
    pos = local_positions(check_layout(layout), x.shape[dim], mesh.ring_degree, mesh.ulysses_degree,
                          mesh.ring_rank, mesh.ulysses_rank, cu_seqlens=cu_seqlens).to(x.device)
    return x.index_select(dim, pos)


def unshard(local: torch.Tensor, layout: str = "basic", mesh=None, seq_dim: int = 1, *,
            reduce_grad: bool = False, cu_seqlens=None) -> torch.Tensor:
    """Collective inverse of :func:`shard` over the mesh's sequence-parallel group:
    every rank gets the global tensor back (uneven shards included).  A packed tensor
    needs the ``cu_seqlens`` it was sharded with (every rank must pass the same; checked).

    Every rank's arguments are checked locally and then agreed on with one small metadata
    exchange (shape except along ``seq_dim``, dtype, ``seq_dim``, layout, document boundaries
    and the per-rank lengths the layout implies), so any bad or mismatched argument on any
    rank raises the same ``ValueError`` on every rank instead of breaking (or hanging) the
    data collective.

    Differentiable: the backward gives each rank its own slice (in the layout) of the
    gradient of the global tensor.  That is the gradient when every rank computes the same
    function of the gathered tensor (a loss on the full output, the usual case).  When ranks
    compute different functions of it, pass ``reduce_grad=True``: the gradients of the global
    tensor are summed over the group first (one all-reduce).
    """
    mesh = _mesh(mesh)
    problem: Optional[BaseException] = None
    dim, cu, values = 0, None, [0] * _WIDTH
    try:
        name = check_layout(layout)
        if not isinstance(local, torch.Tensor):
            raise TypeError(f"unshard: expected a tensor, got {type(local).__name__}")
        dim = normalize_dim(seq_dim, local.dim())
        if local.dim() > MAX_DIMS:
            raise ValueError(f"unshard: at most {MAX_DIMS} dims are supported, got a {local.dim()}-D part")
        if cu_seqlens is not None:
            cu = as_cu_seqlens(cu_seqlens)
        dims = [int(x) for x in local.shape] + [-1] * (MAX_DIMS - local.dim())
        values = [int(local.shape[dim]), local.dim(), dim, dtype_code(local.dtype),
                  0 if cu is None else digest_ints(cu), zlib.crc32(name.encode()), int(bool(reduce_grad))] + dims
    except (TypeError, ValueError) as exc:
        problem = exc
    if mesh.sp_size == 1:
        if problem is not None:
            raise problem
        if cu is not None:
            as_cu_seqlens(cu, local.shape[dim])
        return local
    rows = agree(problem, mesh.metadata_group, what="unshard", where=mesh.where("sequence-parallel"),
                 values=values, width=_WIDTH, ranks=mesh.sp_ranks,
                 check=lambda rows: _parts_problems(rows, layout, mesh, cu))
    sizes = [r[0] for r in rows]
    return _Unshard.apply(local, check_layout(layout), mesh, dim, bool(reduce_grad), cu, tuple(sizes))


def _parts_problems(rows: List[List[int]], layout: str, mesh, cu) -> List[str]:
    """Why the ranks' parts (their agreed metadata rows) do not make one tensor, if they do
    not; the same on every rank (every rank has the same rows)."""
    ranks = mesh.sp_ranks
    diffs = []
    for idx, label in enumerate(_FIELDS[1:], start=1):
        vals = [r[idx] for r in rows]
        if len(set(vals)) > 1:
            shown = ", ".join(f"rank {ranks[i]}={'<' + format(v & 0xffffffff, '08x') + '>' if idx in (4, 5) else v}"
                              for i, v in enumerate(vals))
            diffs.append(f"{label}: {shown}")
    if not diffs:
        seq_dim = rows[0][2]
        nf = len(_FIELDS)
        other = [tuple(x for j, x in enumerate(r[nf:]) if j != seq_dim) for r in rows]
        if len(set(other)) > 1:
            diffs.append("shape (except seq_dim): " + ", ".join(
                f"rank {ranks[i]}={tuple(x for x in r[nf:] if x >= 0)}" for i, r in enumerate(rows)))
    if diffs:
        return ["the ranks' parts do not fit together (every rank must pass its part of the same tensor, with "
                "the same layout, seq_dim and cu_seqlens):\n  " + "\n  ".join(diffs)]
    sizes = [r[0] for r in rows]
    seqlen = sum(sizes)
    if cu is not None and cu[-1] != seqlen:
        return [f"cu_seqlens ends at {cu[-1]}, but the parts hold {seqlen} tokens in all"]
    expect = _expected_lengths(layout, seqlen, mesh, cu)
    if sizes != expect:
        return [f"per-rank lengths {sizes} do not match layout {layout!r} for S={seqlen} (expected {expect}); were "
                "the parts made with usp_hal.shard?"]
    return []


def _expected_lengths(layout: str, seqlen: int, mesh, cu) -> List[int]:
    table = local_lengths(layout, seqlen, mesh.ring_degree, mesh.ulysses_degree, cu_seqlens=cu)
    return [table[mesh.ring_of(i)][mesh.ulysses_of(i)] for i in range(mesh.sp_size)]


class _Unshard(torch.autograd.Function):
    """The all-gather of :func:`unshard` (arguments already agreed on: ``sizes`` per rank)."""

    @staticmethod
    def forward(ctx, local, layout, mesh, seq_dim, reduce_grad, cu, sizes: Tuple[int, ...]):
        seqlen = sum(sizes)
        width = max(sizes)
        pad = list(local.shape)
        pad[seq_dim] = width - local.shape[seq_dim]
        padded = torch.cat([local, local.new_zeros(pad)], dim=seq_dim).contiguous() if pad[seq_dim] else \
            local.contiguous()
        gathered = [torch.empty_like(padded) for _ in range(mesh.sp_size)]
        collective("unshard all-gather", mesh.where("sequence-parallel"), dist.all_gather, gathered, padded,
                   group=mesh.sp_group)
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
        mesh = ctx.mesh
        if ctx.reduce_grad:
            grad = grad.contiguous().clone()
            collective("unshard gradient all-reduce", mesh.where("sequence-parallel"), dist.all_reduce, grad,
                       group=mesh.sp_group)
        pos = local_positions(ctx.layout, ctx.seqlen, mesh.ring_degree, mesh.ulysses_degree,
                              mesh.ring_rank, mesh.ulysses_rank, cu_seqlens=ctx.cu).to(grad.device)
        return grad.index_select(ctx.seq_dim, pos), None, None, None, None, None, None


__all__ = ["shard", "unshard", "normalize_dim", "MAX_DIMS"]
