"""A head-parallel region for any per-head sequence operator (:func:`head_parallel`).

Attention is not the only layer whose heads are independent: a gated DeltaNet or KDA layer,
a Mamba2 (SSD) scan and a depthwise causal convolution all run each head (or channel group)
over the whole sequence on its own.  Under sequence parallelism each rank holds only a shard
of the sequence, so such an operator cannot run where the tokens are.  :func:`head_parallel`
runs it the Ulysses way::

    out = usp_hal.head_parallel(fn, q, k, v, g, beta, grouped=(0, 1), mesh=mesh, layout="zigzag")

* every input is this rank's sequence shard ``[B, S_local, n, ...]`` (as :func:`usp_hal.shard`
  gives it, in ``layout``), where ``n`` is the number of heads ``H`` or, for the inputs listed
  in ``grouped``, of head groups ``G`` (``H % G == 0``; like the KV heads of GQA: the B/C of
  Mamba2, the q/k of a GDN layer with more value heads than key heads);
* one all-to-all per input over the whole sequence-parallel group (all U x R ranks, so every
  split works) gives each rank all ``S`` tokens of its heads, in *global* token order whatever
  the layout (basic, zigzag, stripe, varlen_zigzag);
* ``fn`` runs on them: ``fn(*tensors)`` with ``[B, S, h, ...]`` tensors (``h`` heads of this
  rank; grouped inputs carry the groups those heads use) and returns ``[B, S, h, ...]``;
* one all-to-all brings its result back to the sequence shards: ``[B, S_local, H, ...]``.

Heads are dealt as for attention (:func:`usp_hal.parallel.ulysses.head_plan`): contiguous ranges, as
even as possible, any ``H`` (ranks beyond ``H`` hold none and skip ``fn``); where a range cuts
a group, the rank receives the groups it needs and repeats them per head (``fn`` then sees as
many groups as heads), and their gradients are summed back.  Backward is the same exchanges
reversed; parameters ``fn`` slices per head (``with_heads=True`` passes ``heads=range(a, b)``,
this rank's global heads) get each rank's share of the gradient, which the usual sum of
gradients over the group (``sync_gradients``) completes.

``cu_seqlens``: global document boundaries of a packed sequence; the layout uses them and
``fn`` gets them (``fn(*tensors, cu_seqlens=...)``) to reset its state at document starts.

Cost per call, per input of ``E`` elements per rank: one all-to-all moving ``E (P-1)/P``
elements out of each rank (the same forward and backward), one gather into global order on
the receiving side and one copy back; one small metadata all-gather of ints on the CPU group
(no device sync).

Why not :class:`usp_hal.parallel.ulysses.UlyssesExchange`: that exchange serves attention
over the Ulysses group only (the ring keeps its shard), packs q, k and v per destination into
one wire buffer and leaves tokens in layout order, which the ring's block plan expects.  A
mixer needs every token of the whole U x R group in *global* order for one tensor of any
trailing shape, so its exchange (``_to_heads`` / ``_to_sequence``) is a plain
variable-split ``all_to_all_single`` per input over the whole group, plus the reorder.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["head_parallel"]


def _head_plan(num_heads: int, num_groups: int, size: int):
    from ..parallel.heads import head_plan
    return head_plan(num_heads, num_groups, size)


# ------------------------------------------------------------------------------ global order
_ORDERS: "OrderedDict[tuple, Tuple[torch.Tensor, torch.Tensor]]" = OrderedDict()
_ORDERS_MAX = 32


def _orders(mesh, layout: str, seqlen: int, cu, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(perm, inv)`` on ``device``: ``perm[i]`` is the global position of the i-th token of the
    sequence laid out rank after rank (group order); ``inv = argsort(perm)``."""
    key = (layout, seqlen, mesh.ring_degree, mesh.ulysses_degree, mesh.use_ulysses_low, cu, str(device))
    got = _ORDERS.get(key)
    if got is None:
        from ..sequence.positions import local_positions
        perm = torch.cat([local_positions(layout, seqlen, mesh.ring_degree, mesh.ulysses_degree, mesh.ring_of(i),
                                          mesh.ulysses_of(i), cu_seqlens=cu) for i in range(mesh.sp_size)])
        got = (perm.to(device), torch.argsort(perm).to(device))
        _ORDERS[key] = got
        if len(_ORDERS) > _ORDERS_MAX:
            _ORDERS.popitem(last=False)
    else:
        _ORDERS.move_to_end(key)
    return got


# ------------------------------------------------------------------------------ the exchanges
def _all_to_all(recv: torch.Tensor, send: torch.Tensor, out_splits: List[int], in_splits: List[int], mesh,
                what: str) -> None:
    from ..parallel.comm import collective
    collective(what, mesh.where("sequence-parallel"), dist.all_to_all_single, recv, send, out_splits, in_splits,
               group=mesh.sp_group)


def _to_heads(x: torch.Tensor, ranges, me: int, sizes, perm_inv, mesh) -> torch.Tensor:
    """``x [B, s_me, n, *r]`` (this rank's tokens, all heads) -> ``[B, S, h_me, *r]`` (every
    token in global order, the heads ``ranges[me]``)."""
    b, rest = x.shape[0], tuple(x.shape[3:])
    inner = b * int(torch.Size(rest).numel())
    s_me = x.shape[1]
    seq_major = x.transpose(0, 1)                                   # [s, B, n, *r] (a view)
    send = torch.cat([seq_major[:, :, a:e].reshape(-1) for a, e in ranges])
    a_me, e_me = ranges[me]
    recv = x.new_empty(sum(sizes) * (e_me - a_me) * inner)
    _all_to_all(recv, send, [s * (e_me - a_me) * inner for s in sizes],
                [s_me * (e - a) * inner for a, e in ranges], mesh, "head-parallel all-to-all (to heads)")
    full = recv.view(sum(sizes), b, e_me - a_me, *rest)             # sources in group order = layout order
    return full.index_select(0, perm_inv[1]).transpose(0, 1)       # global token order, [B, S, h, *r]


def _to_sequence(y: torch.Tensor, ranges, me: int, sizes, perm_inv, mesh, total: int,
                 accumulate: bool) -> torch.Tensor:
    """Inverse of :func:`_to_heads`: ``y [B, S, h_me, *r]`` -> ``[B, s_me, total, *r]``; with
    ``accumulate`` the parts of heads that several ranks hold are summed (gradients of groups)."""
    b, rest = y.shape[0], tuple(y.shape[3:])
    inner = b * int(torch.Size(rest).numel())
    a_me, e_me = ranges[me]
    ranked = y.transpose(0, 1).index_select(0, perm_inv[0])         # [S, B, h, *r] in group (layout) order
    send = ranked.reshape(-1)
    s_me = sizes[me]
    recv = y.new_empty(s_me * inner * sum(e - a for a, e in ranges))
    _all_to_all(recv, send, [s_me * (e - a) * inner for a, e in ranges],
                [s * (e_me - a_me) * inner for s in sizes], mesh, "head-parallel all-to-all (to sequence)")
    parts, off = [], 0
    for a, e in ranges:
        n = s_me * (e - a) * inner
        parts.append(recv[off:off + n].view(s_me, b, e - a, *rest))
        off += n
    if not accumulate:
        out = torch.cat(parts, dim=2)
    else:
        out = y.new_zeros(s_me, b, total, *rest)
        for (a, e), part in zip(ranges, parts):
            out[:, :, a:e] += part
    return out.transpose(0, 1)


class _ToHeads(torch.autograd.Function):
    """Every input's exchange to heads in one autograd node: its backward runs the reverse
    exchanges once, in the same order on every rank (separate nodes could be reached in a
    different order on a rank whose operator differs, e.g. one that holds no head)."""

    @staticmethod
    def forward(ctx, spec, *xs):
        ranges, accumulate, me, sizes, perm_inv, mesh = spec
        ctx.spec, ctx.totals = spec, [x.shape[2] for x in xs]
        return tuple(_to_heads(x, r, me, sizes, perm_inv, mesh) for x, r in zip(xs, ranges))

    @staticmethod
    def backward(ctx, *grads):
        ranges, accumulate, me, sizes, perm_inv, mesh = ctx.spec
        return (None,) + tuple(_to_sequence(g.contiguous(), r, me, sizes, perm_inv, mesh, n, acc)
                               for g, r, n, acc in zip(grads, ranges, ctx.totals, accumulate))


class _ToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, ranges, me, sizes, perm_inv, mesh, total):
        ctx.args = (ranges, me, sizes, perm_inv, mesh)
        return _to_sequence(y.contiguous(), ranges, me, sizes, perm_inv, mesh, total, False)

    @staticmethod
    def backward(ctx, grad):
        ranges, me, sizes, perm_inv, mesh = ctx.args
        return _to_heads(grad.contiguous(), ranges, me, sizes, perm_inv, mesh), None, None, None, None, None, None


# ------------------------------------------------------------------------------ the region
def _local_problem(tensors, grouped) -> Tuple[Optional[str], int, int, int, int]:
    """``(problem, S_local, H, G, B)`` from this rank's inputs."""
    if not tensors:
        return "no input tensors", 0, 0, 0, 0
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() < 3:
            return (f"input {i} is not a [B, S_local, heads, ...] tensor "
                    f"({tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__})"), 0, 0, 0, 0
    b, s = int(tensors[0].shape[0]), int(tensors[0].shape[1])
    if any(int(t.shape[0]) != b or int(t.shape[1]) != s for t in tensors):
        return ("the inputs differ in batch or sequence length: "
                f"{[tuple(t.shape[:2]) for t in tensors]}"), s, 0, 0, b
    bad = [i for i in grouped if not 0 <= i < len(tensors)]
    if bad:
        return f"grouped={tuple(grouped)} names inputs that do not exist ({len(tensors)} inputs)", s, 0, 0, b
    heads = {int(t.shape[2]) for i, t in enumerate(tensors) if i not in grouped}
    groups = {int(t.shape[2]) for i, t in enumerate(tensors) if i in grouped}
    if len(heads) != 1:
        return (f"the per-head inputs have different head counts {sorted(heads)} (or there is none; "
                "at least one input must be per head)"), s, 0, 0, b
    h = heads.pop()
    g = groups.pop() if len(groups) == 1 else (h if not groups else -1)
    if g < 1 or h % g:
        return (f"the grouped inputs' group counts {sorted(groups) or [g]} do not divide the {h} heads "
                "(every grouped input must have the same G, with H % G == 0)"), s, h, 0, b
    return None, s, h, g, b


# ------------------------------------------------------------------------------ the agreement
#: the sequence mixers that move data across the group, as their code in :func:`agree_mixer`
MIXERS = ("head_parallel", "halo_causal_conv", "state_passing")
_MIXER_WHAT = "usp_hal sequence mixer"   # one label for all: ranks at different mixers meet in it
_SHAPE_WIDTH = 6


def _mesh_layout_documents(mesh, layout: str, cu_seqlens):
    """The mixer's mesh (the default one when not given), its checked layout and document
    boundaries, and what is wrong with them (kept, to be refused on every rank together)."""
    from ..parallel.mesh import get_default_mesh
    from ..sequence.positions import as_cu_seqlens, check_layout

    mesh = mesh if mesh is not None else get_default_mesh()
    cu, problem = None, None
    try:
        layout = check_layout(layout)
        if cu_seqlens is not None:
            cu = as_cu_seqlens(cu_seqlens)
    except (TypeError, ValueError) as exc:
        problem = str(exc)
    return mesh, layout, cu, problem


def agree_mixer(mesh, mode: str, problem, local_len: int, batch: int, shape: Sequence[int],
                shape_names: Sequence[str], layout: str, cu=None, seqlen: Optional[int] = None,
                settings: str = "") -> List[int]:
    """Every rank's local length, after one small all-gather (ints, on the CPU metadata
    group) in which every rank of ``mesh`` shows how it runs this sequence mixer: ``mode``
    (one of :data:`MIXERS`: which exchange it is about to make), its local length and batch,
    its ``shape`` (up to six integers the mixer's exchanges depend on: heads, groups,
    channels, kernel width, state sizes, a dtype code; ``shape_names`` label them), its
    layout and document boundaries, and the global length it was given (``seqlen``).  Any
    local ``problem``, another mode, batch, shape, layout or boundaries on any rank, or
    per-rank lengths that are not the layout's, raise the same error on every rank before any
    data moves.  All mixers share one label, so ranks that reach different mixers (another
    ``recurrence=`` or conv exchange on one rank) meet in this exchange and are told so.

    ``settings``: a text naming the mixer's kernel and every argument it runs with (state
    passing's kernel and keywords): its digest travels with the rest, and when it differs
    every rank exchanges the texts (a second all-gather, only then) and raises the same error
    showing each rank's."""
    from ..parallel.comm import agree, all_gather_bytes, digest_ints
    from ..sequence.positions import local_lengths
    shape = [int(x) for x in shape][:_SHAPE_WIDTH]
    shape += [0] * (_SHAPE_WIDTH - len(shape))
    code = MIXERS.index(mode) + 1
    lay = digest_ints(list(layout.encode())) if isinstance(layout, str) else 0
    cud = digest_ints([int(c) for c in cu]) if cu is not None else 0
    sett = digest_ints(list(settings.encode("utf-8", "replace"))) if settings else 0
    names = mesh.sp_ranks
    where = mesh.where("sequence-parallel")

    def per_rank(rows, j, show=str):
        return ", ".join(f"rank {names[i]}: {show(r[j])}" for i, r in enumerate(rows))

    def mode_name(c):
        return MIXERS[c - 1] if 1 <= c <= len(MIXERS) else f"code {c}"

    def check(rows) -> Optional[str]:
        if len({r[0] for r in rows}) > 1:
            return ("the ranks run this layer's sequence mixing differently (" + per_rank(rows, 0, mode_name)
                    + "); every rank must make the same choice: pass the same recurrence= and conv exchange on "
                    "every rank")
        if len({r[-1] for r in rows}) > 1:
            # every rank sees the same rows, so every rank makes this second exchange
            texts = all_gather_bytes(settings.encode("utf-8", "replace"), mesh.metadata_group,
                                     what=f"{_MIXER_WHAT}: kernel settings", where=where)
            shown = "; ".join(f"rank {names[i]}: {t.decode('utf-8', 'replace') or '(none)'}"
                              for i, t in enumerate(texts))
            return (f"the ranks run this layer's kernel with different settings ({shown}); the kernel and every "
                    "argument it takes change what each rank computes: pass the same kernel= and keywords on every "
                    "rank")
        if len({r[2] for r in rows}) > 1:
            return ("the ranks hold different batch sizes (" + per_rank(rows, 2) + "); every rank of the "
                    "sequence-parallel group must hold the same batch (shard one batch over the group with "
                    "usp_hal.integrations.transformers.shard_batch or usp_hal.shard)")
        if len({tuple(r[3:3 + _SHAPE_WIDTH]) for r in rows}) > 1:
            shown = "; ".join(f"rank {names[i]}: " + ", ".join(f"{n}={v}" for n, v in zip(shape_names, r[3:]))
                              for i, r in enumerate(rows))
            return f"the ranks' inputs differ in shape or dtype ({shown}); every rank must run the same layer"
        k = 3 + _SHAPE_WIDTH
        if len({r[k] for r in rows}) > 1:
            return "the ranks pass different layouts; pass the same layout= on every rank"
        if len({r[k + 1] for r in rows}) > 1:
            return "the ranks pass different document boundaries (cu_seqlens); pass the same ones on every rank"
        sizes = [r[1] for r in rows]
        total = sum(sizes)
        given = {r[k + 2] for r in rows}
        if len(given) > 1 or (given != {-1} and given != {total}):
            return (f"the global length given (seqlen: {per_rank(rows, k + 2)}; -1: none) is not the ranks' "
                    f"{total} tokens")
        if cu is not None and int(cu[-1]) != total:
            return f"cu_seqlens ends at {int(cu[-1])}, but the ranks hold {total} tokens"
        table = local_lengths(layout, total, mesh.ring_degree, mesh.ulysses_degree, cu_seqlens=cu)
        expect = [table[mesh.ring_of(i)][mesh.ulysses_of(i)] for i in range(mesh.sp_size)]
        if sizes != expect:
            return (f"per-rank lengths {sizes} are not the {layout!r} layout's for S={total} ({expect}); shard "
                    "the inputs with usp_hal.shard(x, layout, mesh)")
        return None

    values = [code, int(local_len), int(batch), *shape, lay, cud, -1 if seqlen is None else int(seqlen), sett]
    rows = agree(f"usp_hal.{mode}: {problem}" if problem else None, mesh.metadata_group, what=_MIXER_WHAT,
                 where=where, values=[] if problem else values, width=len(values), ranks=names, check=check)
    return [r[1] for r in rows]


# eager under torch.compile (a graph break): every rank runs its collectives from the same eager code
# (tests/test_hybrid_compile.py: kimi_linear under Inductor failed across ranks without it)
@torch.compiler.disable
def head_parallel(fn: Callable, *tensors: torch.Tensor, grouped: Sequence[int] = (), mesh=None,
                  layout: str = "zigzag", cu_seqlens=None, with_heads: bool = False, out_like: Optional[int] = None):
    """Run a per-head sequence operator on sequence-sharded tensors (see the module doc).

    ``fn(*tensors[, heads=range][, cu_seqlens=...])`` gets ``[B, S, h, ...]`` tensors (the full
    sequence, global order, this rank's heads; grouped inputs: their groups, or one per head
    where this rank's heads cut a group) and returns one ``[B, S, h, ...]`` tensor.  Returns
    ``[B, S_local, H, ...]`` in ``layout``.  ``out_like``: the input whose trailing dims and
    dtype the output has (default: the first per-head input); a rank that holds no head
    (``H`` below the group size) makes its empty share of the result from it.
    """
    from ..parallel.comm import digest_ints, dtype_code

    grouped = tuple(int(i) for i in grouped)
    problem, s_local, h, g, b = _local_problem(tensors, grouped)
    mesh, layout, cu, arg_problem = _mesh_layout_documents(mesh, layout, cu_seqlens)
    problem = problem or arg_problem
    if out_like is None:
        out_like = next((i for i in range(len(tensors)) if i not in grouped), 0)
    kw: dict = {"cu_seqlens": cu} if cu is not None else {}
    if mesh.sp_size == 1:
        if problem:
            raise ValueError(f"usp_hal.head_parallel: {problem}")
        if with_heads:
            kw["heads"] = range(h)
        return fn(*tensors, **kw)

    shape = [h, g, len(tensors), digest_ints(sorted(grouped)),
             digest_ints([dtype_code(t.dtype) for t in tensors] + [int(t.dim()) for t in tensors]) if not problem
             else 0, int(with_heads)]
    sizes = tuple(agree_mixer(mesh, "head_parallel", problem, s_local, b, shape,
                              ("H", "G", "inputs", "grouped (digest)", "dtypes and ranks (digest)", "with_heads"),
                              layout, cu))
    seqlen = sum(sizes)
    me = mesh.sp_rank
    plan = _head_plan(h, g, mesh.sp_size)
    orders = _orders(mesh, layout, seqlen, cu, tensors[0].device)
    heads, groups = tuple(plan.q), tuple(plan.kv)
    expand = plan.kv_expand[me]
    spec = (tuple(groups if i in grouped else heads for i in range(len(tensors))),
            tuple(i in grouped for i in range(len(tensors))), me, sizes, orders, mesh)
    local = list(_ToHeads.apply(spec, *tensors))
    if expand is not None:              # this rank's heads cut a group: one group per head
        index = torch.tensor(expand, device=tensors[0].device)
        local = [x.index_select(2, index) if i in grouped else x for i, x in enumerate(local)]
    a_me, e_me = heads[me]
    like = tensors[out_like]
    if e_me > a_me:
        if with_heads:
            kw["heads"] = range(a_me, e_me)
        out = fn(*local, **kw)
        if not isinstance(out, torch.Tensor) or out.dim() < 3 or tuple(out.shape[:3]) != (b, seqlen, e_me - a_me):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"usp_hal.head_parallel: fn returned {got}, expected [B={b}, S={seqlen}, "
                             f"h={e_me - a_me}, ...]")
    else:
        # no head here: an empty share shaped like out_like's, still joined to the graph so the
        # backward exchange runs on every rank
        out = like.new_zeros(b, seqlen, 0, *like.shape[3:]) + sum(x.sum() * 0 for x in local)
    return _ToSequence.apply(out, heads, me, sizes, orders, mesh, h)


# ------------------------------------------------------------------------------ conv halo
_HALOS: "OrderedDict[tuple, tuple]" = OrderedDict()


def _halo_plan(mesh, layout: str, seqlen: int, cu, width: int):
    """:func:`_make_halo_plan`, kept for the last few shapes (host work of O(S) per new shape)."""
    key = (layout, seqlen, mesh.ring_degree, mesh.ulysses_degree, mesh.use_ulysses_low, mesh.sp_rank, cu, width)
    got = _HALOS.get(key)
    if got is None:
        got = _HALOS[key] = _make_halo_plan(mesh, layout, seqlen, cu, width)
        if len(_HALOS) > _ORDERS_MAX:
            _HALOS.popitem(last=False)
    else:
        _HALOS.move_to_end(key)
    return got


def _make_halo_plan(mesh, layout: str, seqlen: int, cu, width: int):
    """For a causal window of ``width`` positions (kernel - 1 before each token): per rank, the
    positions it needs from others, and per (owner, needer) pair the owner's local indices.
    Returns ``(send_idx per peer, recv_pos per peer, own positions, extended positions)`` for
    this rank; the same computation on every rank (from the layout alone)."""
    from ..sequence.positions import document_ids, local_positions
    pos = [local_positions(layout, seqlen, mesh.ring_degree, mesh.ulysses_degree, mesh.ring_of(i),
                           mesh.ulysses_of(i), cu_seqlens=cu) for i in range(mesh.sp_size)]
    owner = torch.empty(seqlen, dtype=torch.long)
    index = torch.empty(seqlen, dtype=torch.long)
    for i, p in enumerate(pos):
        owner[p] = i
        index[p] = torch.arange(p.numel())
    doc = document_ids(torch.arange(seqlen), cu) if cu is not None else torch.zeros(seqlen, dtype=torch.long)

    def needed(i):
        p = pos[i]
        cand = (p.view(-1, 1) - torch.arange(1, width + 1).view(1, -1)).flatten()
        keep = cand >= 0
        cand = cand[keep]
        same_doc = doc[cand] == doc[p.view(-1, 1).expand(-1, width).flatten()[keep]]
        cand = torch.unique(cand[same_doc])
        return cand[owner[cand] != i]

    me = mesh.sp_rank
    send_idx, recv_pos = [], []
    mine_needed = needed(me)
    for j in range(mesh.sp_size):
        theirs = needed(j)
        send_idx.append(index[theirs[owner[theirs] == me]])
        recv_pos.append(mine_needed[owner[mine_needed] == j])
    return send_idx, recv_pos, pos[me], doc


class _Halo(torch.autograd.Function):
    """Send each peer the tokens of this rank its causal window needs (their positions come
    from the layout); backward sends their gradients home and adds them."""

    @staticmethod
    def forward(ctx, x, send_idx, recv_counts, mesh):
        b, rest = x.shape[0], tuple(x.shape[2:])
        inner = b * int(torch.Size(rest).numel())
        send = torch.cat([x.index_select(1, i.to(x.device)).transpose(0, 1).reshape(-1) for i in send_idx])
        recv = x.new_empty(sum(recv_counts) * inner)
        _all_to_all(recv, send, [n * inner for n in recv_counts], [int(i.numel()) * inner for i in send_idx], mesh,
                    "conv halo exchange")
        ctx.args = (send_idx, recv_counts, mesh, x.shape)
        return recv.view(sum(recv_counts), b, *rest).transpose(0, 1)

    @staticmethod
    def backward(ctx, grad):
        send_idx, recv_counts, mesh, shape = ctx.args
        b, rest = shape[0], tuple(shape[2:])
        inner = b * int(torch.Size(rest).numel())
        send = grad.transpose(0, 1).contiguous().reshape(-1)
        back = grad.new_empty(sum(int(i.numel()) for i in send_idx) * inner)
        _all_to_all(back, send, [int(i.numel()) * inner for i in send_idx], [n * inner for n in recv_counts], mesh,
                    "conv halo exchange (backward)")
        out = grad.new_zeros(shape)
        idx = torch.cat(send_idx).to(grad.device) if send_idx else torch.zeros(0, dtype=torch.long)
        out.index_add_(1, idx, back.view(-1, b, *rest).transpose(0, 1))
        return out, None, None, None


# eager under torch.compile (a graph break): every rank runs its collectives from the same eager code
# (tests/test_hybrid_compile.py: kimi_linear under Inductor failed across ranks without it)
@torch.compiler.disable
def halo_causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, mesh=None,
                     layout: str = "zigzag", cu_seqlens=None, _halo_width: Optional[int] = None) -> torch.Tensor:
    """Depthwise causal convolution over the *global* sequence of sequence-sharded ``x``
    ``[B, S_local, C]`` (weight ``[C, K]``, bias ``[C]``): ``y_t = sum_j w[:, j] x_{t-K+1+j}``
    (zero before the sequence and before each document of ``cu_seqlens``).  Each rank receives
    only the ``K - 1`` tokens before each of its runs of consecutive positions from the ranks
    that hold them (one all-to-all; for basic and zigzag layouts at most ``2 (K-1)`` tokens a
    rank, whatever ``S``) and convolves locally.  Backward sends those tokens' gradients home."""
    from ..parallel.comm import dtype_code

    mesh, layout, cu, problem = _mesh_layout_documents(mesh, layout, cu_seqlens)
    if not (isinstance(x, torch.Tensor) and x.dim() == 3):
        problem = problem or (f"x must be a [B, S_local, C] tensor, got "
                              f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    elif not (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == x.shape[2]
              and weight.shape[1] >= 1):
        problem = problem or (f"weight must be [C={x.shape[2]}, K], got "
                              f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    ksize = int(weight.shape[-1]) if isinstance(weight, torch.Tensor) and weight.dim() >= 1 else 0
    width = ksize - 1 if _halo_width is None else _halo_width
    if mesh.sp_size > 1:
        ok = problem is None
        shape = [int(x.shape[2]) if ok else 0, ksize, width, dtype_code(x.dtype) if ok else 0,
                 int(bias is not None)]
        seqlen = sum(agree_mixer(mesh, "halo_causal_conv", problem, int(x.shape[1]) if ok else 0,
                                 int(x.shape[0]) if ok else 0, shape,
                                 ("C", "K", "halo width", "dtype (code)", "bias"), layout, cu))
    elif problem:
        raise ValueError(f"usp_hal.halo_causal_conv: {problem}")
    else:
        seqlen = int(x.shape[1])
    from ..sequence.positions import local_positions
    if mesh.sp_size > 1:
        send_idx, recv_pos, own, doc = _halo_plan(mesh, layout, seqlen, cu, width)
        halo = _Halo.apply(x, send_idx, [int(p.numel()) for p in recv_pos], mesh)
        recv = torch.cat(recv_pos) if recv_pos else torch.zeros(0, dtype=torch.long)
    else:
        own = local_positions(layout, seqlen, 1, 1, 0, 0, cu_seqlens=cu)
        halo, recv = x[:, :0], torch.zeros(0, dtype=torch.long)
        from ..sequence.positions import document_ids
        doc = document_ids(torch.arange(seqlen), cu) if cu is not None else torch.zeros(seqlen, dtype=torch.long)
    ext = torch.cat([x, halo, x.new_zeros(x.shape[0], 1, *x.shape[2:])], dim=1)   # last row: zeros
    where = torch.full((seqlen,), ext.shape[1] - 1, dtype=torch.long)
    where[own] = torch.arange(own.numel())
    where[recv] = torch.arange(own.numel(), own.numel() + recv.numel())
    out = None
    for j in range(ksize):
        lag = ksize - 1 - j
        src = own - lag
        ok = src >= 0
        src = src.clamp(min=0)
        ok &= doc[src] == doc[own]
        idx = torch.where(ok, where[src], torch.full_like(src, ext.shape[1] - 1)).to(x.device)
        term = ext.index_select(1, idx) * weight[:, j]
        out = term if out is None else out + term
    assert out is not None
    return out if bias is None else out + bias
