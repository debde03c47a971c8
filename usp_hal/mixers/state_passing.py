"""Recurrences over a sequence-sharded timeline, by passing state.

A linear recurrence (gated DeltaNet, KDA, Mamba2's SSD, linear attention) needs the whole
timeline, but not the whole timeline's *tokens*: what one stretch of the sequence hands the
next is a state.  Here every rank keeps its own tokens and all heads, and only states travel
(LASP-2's scheme):

1. each rank runs every contiguous piece of the sequence it holds from a zero state, and also
   learns the piece's *transition*: the recurrences here are linear in their state, column by
   column (``S_t = A_t S_{t-1} + k_t u_t^T``, ``u_t`` linear in ``S_{t-1}`` and the value), so
   ``final(S_0) = P S_0 + final(0)``.  ``P`` comes from the same kernel call: the value gets
   ``dk`` zero columns more and the initial state is ``[0 | I]``, so the extra columns of the
   final state are ``P``;
2. one all-gather over the sequence-parallel group of every piece's ``[P | final(0)]``
   (``H dk (dk + dv)`` numbers per piece: independent of the sequence length);
3. each rank scans the pieces in global order (an exclusive prefix: ``S_in(c+1) = P_c S_in(c)
   + final_c(0)``, reset to 0 at every document start) and runs each of its pieces again from
   the state it receives.  A piece that starts a document (or the sequence) keeps its first
   run's output.

Pieces are the maximal runs of consecutive global positions a rank holds, cut at document
boundaries: one per rank for ``basic``, two for ``zigzag`` (a scan over 2R chunks), more for
packed documents.  Backward is autograd through the kernel and the all-gather (whose
backward sums each piece's gradient back to its owner): gradients flow to every rank whose
state another used.

(The short causal convolutions beside these layers need no state, only a halo of
``kernel_size - 1`` tokens: :func:`usp_hal.mixers.head_parallel.halo_causal_conv`.)

Kernels are passed in: ``kernel(q, k, v, g, beta, initial_state=..., output_final_state=True)
-> (out, final_state)`` in the layout of transformers' ``torch_chunk_gated_delta_rule`` and
FLA's ``chunk_gated_delta_rule`` (``[B, T, H, d]`` tensors, state ``[B, H, dk, dv]``), and
``ssd_kernel(x, dt, A, B, C, initial_state=...) -> (y, final_state)`` (state ``[B, H, N, P]``).
:func:`delta_rule_reference`, :func:`ssd_chunked` and :func:`ssd_reference` are plain torch
ones.
"""
from __future__ import annotations

import functools
import hashlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

__all__ = ["Piece", "pieces", "state_passing", "gated_delta_rule", "ssd", "delta_rule_reference", "ssd_reference",
           "ssd_chunked", "state_bytes", "kernel_settings"]


# ----------------------------------------------------------------------------- the piece plan
@dataclass(frozen=True)
class Piece:
    rank: int           # position in the sequence-parallel group
    local: int          # first local index on that rank
    start: int          # first global position
    length: int
    doc_start: bool     # starts the sequence or a document: its incoming state is zero


def _runs(pos: Sequence[int], cuts: set) -> List[Tuple[int, int, int]]:
    """(local index, global start, length) of each run of consecutive positions, cut at ``cuts``."""
    out: List[Tuple[int, int, int]] = []
    for i, p in enumerate(pos):
        if out and p == out[-1][1] + out[-1][2] and p not in cuts:
            li, st, n = out[-1]
            out[-1] = (li, st, n + 1)
        else:
            out.append((i, p, 1))
    return out


def pieces(mesh, seqlen: int, layout: str, cu_seqlens: Optional[Sequence[int]] = None) -> List[Piece]:
    """Every rank's pieces, in global order (pure: every rank computes the same list)."""
    from ..sequence.positions import check_layout, local_positions
    layout = check_layout(layout)
    cu = tuple(int(c) for c in cu_seqlens) if cu_seqlens is not None else None
    cuts = set(cu) if cu else {0}
    found = []
    for i in range(mesh.sp_size):
        pos = local_positions(layout, seqlen, mesh.ring_degree, mesh.ulysses_degree, mesh.ring_of(i),
                              mesh.ulysses_of(i), cu_seqlens=cu).tolist()
        for li, st, n in _runs(pos, cuts):
            found.append(Piece(i, li, st, n, st in cuts))
    return sorted(found, key=lambda p: p.start)


def _mine(plan: List[Piece], me: int) -> List[Tuple[int, Piece]]:
    return [(j, p) for j, p in enumerate(plan) if p.rank == me]


def state_bytes(num_heads: int, dk: int, dv: int, pieces_per_rank: int, elem: int = 4) -> int:
    """Bytes each rank sends for one state-passing call: its pieces' ``[P | S]``."""
    return pieces_per_rank * num_heads * dk * (dk + dv) * elem


# ----------------------------------------------------------------------------- the kernel's settings
def _callable_name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return (f"partial({_callable_name(fn.func)}, " + ", ".join(_value_text(a) for a in fn.args)
                + "".join(f", {k}={_value_text(v)}" for k, v in sorted(fn.keywords.items())) + ")")
    mod = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{mod}.{name}"


#: a tensor argument's value digest by id(tensor): (a weak reference to it, its version, its
#: data pointer, the digest); a steady argument (a parameter between optimizer steps) is read
#: to the host once, and an entry counts only while its weak reference is that same tensor
_TENSOR_DIGESTS: Dict[int, Tuple[Any, int, int, str]] = {}


def _tensor_text(t: torch.Tensor) -> str:
    version, ptr = int(getattr(t, "_version", 0)), t.data_ptr() if t.layout == torch.strided else 0
    seen = _TENSOR_DIGESTS.get(id(t))
    if seen is not None and seen[0]() is t and seen[1:3] == (version, ptr):
        digest = seen[3]
    else:
        data = t.detach()
        data = data.to_local() if hasattr(data, "to_local") else data     # a DTensor: this rank's shard
        raw = data.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
        digest = hashlib.blake2b(raw, digest_size=8).hexdigest()
        if len(_TENSOR_DIGESTS) > 256:
            for key in [k for k, e in _TENSOR_DIGESTS.items() if e[0]() is None]:
                del _TENSOR_DIGESTS[key]
        _TENSOR_DIGESTS[id(t)] = (weakref.ref(t), version, ptr, digest)
    return f"tensor(shape={list(t.shape)}, dtype={str(t.dtype).replace('torch.', '')}, values={digest})"


def _value_text(v: Any) -> str:
    """An argument as text that is equal on two ranks exactly when the argument is (floats by
    their repr, which round-trips; tensors by shape, dtype and a digest of their values;
    functions by qualified name).  Another object shows only its type: its value is not
    compared."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return repr(v)
    if isinstance(v, torch.Tensor):
        return _tensor_text(v)
    if isinstance(v, (torch.dtype, torch.device)):
        return str(v)
    if isinstance(v, (list, tuple)):
        inner = ", ".join(_value_text(x) for x in v)
        return f"[{inner}]" if isinstance(v, list) else f"({inner})"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{k!r}: {_value_text(x)}" for k, x in sorted(v.items(), key=lambda kv: str(kv[0])))\
            + "}"
    if callable(v):
        return _callable_name(v)
    return f"<{type(v).__module__}.{type(v).__qualname__}>"


def kernel_settings(kernel: Any, kwargs: Mapping[str, Any]) -> str:
    """What a state-passing call's kernel computes with, as text for the cross-rank agreement:
    the kernel (a name, or a callable's qualified name) and every keyword with its value, e.g.
    ``fla.naive_chunk_gated_delta_rule(scale=0.2)``.  Two ranks whose texts differ compute
    different recurrences; every rank then refuses the call (:func:`state_passing`)."""
    head = kernel if isinstance(kernel, str) else _callable_name(kernel)
    return f"{head}(" + ", ".join(f"{k}={_value_text(v)}" for k, v in sorted(kwargs.items())) + ")"


# ----------------------------------------------------------------------------- the exchange
class _Gather(torch.autograd.Function):
    """Every rank's ``x`` stacked ``[size, ...]``; backward: the sum of every rank's gradient
    for this rank's part (an all-reduce of the small stacked gradient)."""

    @staticmethod
    def forward(ctx, x, group, size, where):
        from ..parallel.comm import all_gather_single, collective
        x = x.contiguous()
        out = x.new_empty(size * x.shape[0], *x.shape[1:])
        collective("all-gather of recurrence states", where, all_gather_single, out, x, group=group)
        ctx.group, ctx.where = group, where
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        from ..parallel.comm import collective
        grad = grad.contiguous().clone()
        collective("all-reduce of recurrence state gradients", ctx.where, dist.all_reduce, grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None, None, None


class _Tie(torch.autograd.Function):
    """``y`` unchanged, made to depend on ``dep``: every rank's backward then reaches the
    gather's backward collective, also a rank whose own result did not use another's state
    (else that rank would skip the collective and the others would wait for it)."""

    @staticmethod
    def forward(ctx, y, dep):
        ctx.dep = (dep.shape, dep.dtype, dep.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.dep
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _all_gather(x: torch.Tensor, mesh) -> torch.Tensor:
    """Every rank's ``x`` (equal shapes) stacked in group order, differentiable."""
    if mesh.sp_size == 1:
        return x.unsqueeze(0)
    return _Gather.apply(x, mesh.sp_group, mesh.sp_size, mesh.where("sequence-parallel"))


def _tie(y: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    if not (torch.is_grad_enabled() and gathered.requires_grad):
        return y
    return _Tie.apply(y, gathered)


def _slot_table(plan: List[Piece], size: int) -> Tuple[int, List[Tuple[int, int]]]:
    """Pieces per rank (the padded count every rank sends) and, per global piece, its
    (rank, slot) in the gathered tensors."""
    count = [0] * size
    where = []
    for p in plan:
        where.append((p.rank, count[p.rank]))
        count[p.rank] += 1
    return max(count), where


# ----------------------------------------------------------------------------- recurrences
def _carry_in(finals: torch.Tensor, plan: List[Piece], where, dv: int) -> List[Optional[torch.Tensor]]:
    """The state each piece starts from, in global order: the exclusive prefix over the
    gathered ``[P | S]`` (``P`` acting on the state's rows), zero at document starts."""
    states: List[Optional[torch.Tensor]] = []
    carry: Optional[torch.Tensor] = None
    for j, p in enumerate(plan):
        if p.doc_start:
            carry = None
        states.append(carry)
        r, s = where[j]
        ps = finals[r][s]                       # [B, H, dk, dv + dk]
        S, P = ps[..., :dv], ps[..., dv:]
        carry = S if carry is None else S + P @ carry
    return states


def state_passing(kernel: Callable, inputs: Sequence[torch.Tensor], *, value_index: int, key_dim: int, mesh,
                  layout: str = "basic", cu_seqlens=None, seq_dim: int = 1, seqlen: Optional[int] = None,
                  settings: Optional[str] = None, problem: Optional[str] = None) -> torch.Tensor:
    """Run a column-separable linear recurrence over the group's sequence-sharded timeline.

    ``kernel(*inputs, initial_state=state or None) -> (out, final_state)`` runs the recurrence
    on one contiguous stretch (the inputs sliced along ``seq_dim``); its state is ``[B, H,
    key_dim, dv]`` and ``inputs[value_index]`` is ``[B, T, H, dv]``, the value whose columns
    the state's columns follow.  ``seqlen``: the global length, if known (checked against the
    ranks' lengths).  One small all-gather of ints on the metadata group first agrees on
    the call across the ranks (:func:`usp_hal.mixers.head_parallel.agree_mixer`): with it ``settings``
    (default: :func:`kernel_settings` of ``kernel``; pass the kernel's name and every
    argument it runs with, which must be equal on every rank) and ``problem`` (this rank's
    reason to refuse the call, found before it: every rank then raises it together).
    Returns this rank's output, in local order."""
    me = mesh.sp_rank
    if settings is None:
        settings = kernel_settings(kernel, {})
    total = _agree(inputs, value_index, key_dim, mesh, layout, cu_seqlens, seq_dim, seqlen, settings, problem)
    plan = pieces(mesh, total, layout, cu_seqlens)
    mine = _mine(plan, me)
    per_rank, where = _slot_table(plan, mesh.sp_size)
    v = inputs[value_index]
    B, _, H, dv = v.shape
    sdt = torch.promote_types(v.dtype, torch.float32)     # states in float32 at least
    outs: List[torch.Tensor] = []
    finals: List[torch.Tensor] = []
    first: List[torch.Tensor] = []
    for _, p in mine:
        part = [x.narrow(seq_dim, p.local, p.length) for x in inputs]
        va = part[value_index]
        part[value_index] = torch.cat([va, va.new_zeros(*va.shape[:-1], key_dim)], dim=-1)
        eye = torch.eye(key_dim, dtype=sdt, device=va.device).expand(B, H, key_dim, key_dim)
        init = torch.cat([torch.zeros(B, H, key_dim, dv, dtype=sdt, device=va.device), eye], dim=-1)
        out, final = kernel(*part, initial_state=init)
        first.append(out[..., :dv])
        finals.append(final.to(sdt))
    pad = per_rank - len(finals)
    ref = finals[0] if finals else torch.zeros(B, H, key_dim, dv + key_dim, dtype=sdt, device=v.device)
    stacked = torch.stack(finals + [ref.new_zeros(ref.shape)] * pad) if per_rank else ref.new_zeros(0)
    if not mine:
        # a rank that holds no token (a sequence shorter than the group): its zero states and
        # its empty output still hang off its (empty) inputs, so its backward reaches the
        # gather's collective as the other ranks' do; only such a rank pays these empty sums
        stacked = stacked + _nothing_of(inputs).to(sdt)
    gathered = _all_gather(stacked, mesh)
    starts = _carry_in(gathered, plan, where, dv)
    for (j, p), out0 in zip(mine, first):
        s_in = starts[j]
        if s_in is None:
            outs.append(out0)
            continue
        part = [x.narrow(seq_dim, p.local, p.length) for x in inputs]
        out, _ = kernel(*part, initial_state=s_in)
        outs.append(out)
    order = sorted(range(len(mine)), key=lambda i: mine[i][1].local)
    out = torch.cat([outs[i] for i in order], dim=seq_dim) if outs else v.new_zeros(v.shape) + _nothing_of(inputs)
    return _tie(out, gathered)


def _nothing_of(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """A zero that depends on every floating input (the empty inputs of a rank that holds no
    token), so autograd reaches that rank's collectives as it reaches the others'."""
    zero = torch.zeros((), dtype=inputs[0].dtype if inputs[0].is_floating_point() else torch.float32,
                       device=inputs[0].device)
    for x in inputs:
        if x.is_floating_point():
            zero = zero + x.sum().to(zero.dtype) * 0
    return zero


def _agree(inputs, value_index: int, key_dim: int, mesh, layout, cu_seqlens, seq_dim: int,
           seqlen: Optional[int], settings: str = "", problem: Optional[str] = None) -> int:
    """The global length, after every rank showed how it runs this recurrence (one small
    all-gather of ints on the metadata group, no device sync: :func:`usp_hal.mixers.head_parallel.agree_mixer`):
    the batch, heads, state sizes, dtype, layout, document boundaries and per-rank lengths
    must agree, and the kernel's ``settings``; else every rank raises the same error before
    the states move."""
    from ..parallel.comm import digest_ints, dtype_code
    from ..sequence.positions import check_layout
    from .head_parallel import agree_mixer
    lay = layout
    try:
        lay = check_layout(layout)
    except (TypeError, ValueError) as exc:
        problem = problem or str(exc)
    v = inputs[value_index] if 0 <= value_index < len(inputs) else None
    if not (isinstance(v, torch.Tensor) and v.dim() == 4):
        problem = problem or (f"the value (input {value_index}) must be [B, T, H, dv], got "
                              f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
    elif any(not isinstance(x, torch.Tensor) or x.dim() <= seq_dim or x.shape[seq_dim] != v.shape[seq_dim]
             or x.shape[0] != v.shape[0] for x in inputs):
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in inputs]
        problem = problem or f"the inputs differ in batch or length: {shapes}"
    if problem is None and v is not None:
        batch, length, heads, dv, dt = int(v.shape[0]), int(v.shape[seq_dim]), int(v.shape[2]), int(v.shape[3]), \
            dtype_code(v.dtype)
        shapes_digest = digest_ints([int(d) for x in inputs for d in (x.dim(), *x.shape[2:])])
    else:
        batch = length = heads = dv = dt = shapes_digest = 0
    if mesh.sp_size == 1:
        if problem:
            raise ValueError(f"usp_hal.mixers.state_passing: {problem}")
        return length if seqlen is None else int(seqlen)
    shape = [heads, int(key_dim), dv, dt, len(inputs), shapes_digest]
    cu = tuple(int(c) for c in cu_seqlens) if cu_seqlens is not None else None
    sizes = agree_mixer(mesh, "state_passing", problem, length, batch, shape,
                        ("H", "key dim", "value dim", "dtype (code)", "inputs", "input shapes (digest)"),
                        lay, cu, seqlen, settings=settings)
    return sum(sizes)


# eager under torch.compile (a graph break): every rank runs its collectives from the same eager code
# (tests/test_hybrid_compile.py: kimi_linear under Inductor failed across ranks without it)
@torch.compiler.disable
def gated_delta_rule(q, k, v, g, beta, *, mesh, layout: str = "basic", cu_seqlens=None, kernel=None,
                     seqlen: Optional[int] = None, **kernel_kwargs) -> torch.Tensor:
    """Gated DeltaNet over the group: ``q, k [B, T, Hk, dk]``, ``v [B, T, Hv, dv]``, ``g, beta [B, T,
    Hv]`` (this rank's tokens); ``kernel`` as transformers' ``torch_chunk_gated_delta_rule``
    (default :func:`delta_rule_reference`).  Returns ``[B, T, Hv, dv]``.

    KDA (Kimi delta attention, kimi_linear) is the same call with ``g [B, T, H, dk]``, a decay
    per key channel (``S_t = diag(e^{g_t}) S_{t-1} + ...``), and its kernel (transformers'
    ``chunk_kimi_delta_attention`` or FLA's ``chunk_kda``): each value column of the state
    still follows the same linear map, so the same ``[P | S]`` pieces pass it.

    The kernel (its qualified name) and ``kernel_kwargs`` (their values) are part of the
    cross-rank agreement: a rank with another kernel or argument refuses with the others."""
    kern = kernel or delta_rule_reference

    def run(q, k, v, g, beta, initial_state=None):
        return kern(q, k, v, g, beta, initial_state=initial_state, output_final_state=True, **kernel_kwargs)
    return state_passing(run, [q, k, v, g, beta], value_index=2, key_dim=k.shape[-1], mesh=mesh, layout=layout,
                         cu_seqlens=cu_seqlens, seqlen=seqlen, settings=kernel_settings(kern, kernel_kwargs))


# eager under torch.compile (a graph break): every rank runs its collectives from the same eager code
# (tests/test_hybrid_compile.py: kimi_linear under Inductor failed across ranks without it)
@torch.compiler.disable
def ssd(x, dt, A, B, C, *, mesh, layout: str = "basic", cu_seqlens=None, kernel=None,
        seqlen: Optional[int] = None) -> torch.Tensor:
    """Mamba2's SSD scan over the group: ``x [B, T, H, P]``, ``dt [B, T, H]`` (after softplus),
    ``A [H]``, ``B, C [B, T, G, N]`` (heads share groups as in GQA).  Returns ``y [B, T, H, P]``
    (without the ``D x`` skip, which is per token)."""
    kern = kernel or ssd_chunked

    def run(x, dt, B, C, initial_state=None):
        return kern(x, dt, A, B, C, initial_state=initial_state)
    return state_passing(run, [x, dt, B, C], value_index=0, key_dim=B.shape[-1], mesh=mesh, layout=layout,
                         cu_seqlens=cu_seqlens, seqlen=seqlen, settings=kernel_settings(kern, {}))


# ----------------------------------------------------------------------------- plain kernels
def delta_rule_reference(q, k, v, g, beta, initial_state=None, output_final_state=True, scale=None, **_):
    """The gated delta rule token by token, in the inputs' dtype (float64 for references):
    ``S_t = e^{g_t} S_{t-1} + k_t (beta_t (v_t - e^{g_t} S_{t-1}^T k_t))^T``, ``o_t = S_t^T q_t
    * scale`` (``scale`` default ``dk^-1/2``), as transformers' ``torch_recurrent_gated_delta_rule``
    computes it without its fp32 cast.  q/k heads repeat over value heads (``Hv % Hk == 0``).
    ``g [B, T, Hv, dk]`` (a decay per key channel, ``e^{g_t}`` then scales the state's rows):
    KDA, as transformers' ``recurrent_kimi_delta_attention`` computes it."""
    Bsz, T, Hk, dk = k.shape
    Hv, dv = v.shape[-2:]
    if Hk != Hv:
        q, k = (t.repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
    scale = dk ** -0.5 if scale is None else scale
    per_channel = g.dim() == 4
    S = (initial_state.to(v.dtype) if initial_state is not None else v.new_zeros(Bsz, Hv, dk, dv))
    outs = []
    for t in range(T):
        qt, kt, vt = q[:, t] * scale, k[:, t], v[:, t]
        S = S * (g[:, t].exp()[..., None] if per_channel else g[:, t].exp()[..., None, None])
        pred = (S * kt.unsqueeze(-1)).sum(-2)
        delta = (vt - pred) * beta[:, t].unsqueeze(-1)
        S = S + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((S * qt.unsqueeze(-1)).sum(-2))
    out = torch.stack(outs, dim=1) if outs else v.new_zeros(Bsz, 0, Hv, dv)
    return out, (S if output_final_state else None)


def _expand_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[2], dim=2) if t.shape[2] != heads else t


def ssd_reference(x, dt, A, B, C, initial_state=None):
    """Mamba2's SSD token by token: ``h_t = e^{dt_t A} h_{t-1} + dt_t B_t x_t^T``, ``y_t = h_t^T
    C_t`` (state ``[B, H, N, P]``), in the inputs' dtype."""
    Bsz, T, H, P = x.shape
    Bh, Ch = _expand_groups(B, H), _expand_groups(C, H)
    N = Bh.shape[-1]
    h = initial_state.to(x.dtype) if initial_state is not None else x.new_zeros(Bsz, H, N, P)
    ys = []
    for t in range(T):
        h = h * (dt[:, t] * A).exp()[..., None, None] + (dt[:, t, :, None, None] * Bh[:, t, :, :, None]
                                                        * x[:, t, :, None, :])
        ys.append((h * Ch[:, t, :, :, None]).sum(-2))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(Bsz, 0, H, P)
    return y, h


def ssd_chunked(x, dt, A, B, C, initial_state=None, chunk: int = 64):
    """The same scan in chunks (quadratic inside a chunk, a state between chunks), in the
    inputs' dtype: what a long sequence needs on the CPU."""
    Bsz, T, H, P = x.shape
    Bh, Ch = _expand_groups(B, H), _expand_groups(C, H)
    N = Bh.shape[-1]
    h = initial_state.to(x.dtype) if initial_state is not None else x.new_zeros(Bsz, H, N, P)
    ys = []
    for s in range(0, T, chunk):
        xs, ds, bs, cs = x[:, s:s + chunk], dt[:, s:s + chunk], Bh[:, s:s + chunk], Ch[:, s:s + chunk]
        L = xs.shape[1]
        a = torch.cumsum(ds * A, dim=1)                              # [B, L, H] log decay from the chunk start
        diff = a.unsqueeze(2) - a.unsqueeze(1)                       # [B, Lt, Ls, H]
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        decay = torch.where(causal[None, :, :, None], diff, torch.full_like(diff, float("-inf"))).exp()
        scores = torch.einsum("bthn,bshn->btsh", cs, bs) * decay * ds.unsqueeze(1)
        y = torch.einsum("btsh,bshp->bthp", scores, xs)
        y = y + torch.einsum("bthn,bhnp->bthp", cs * a.exp().unsqueeze(-1), h)
        to_end = (a[:, -1:] - a).exp() * ds                           # [B, L, H]
        h = h * a[:, -1].exp()[..., None, None] + torch.einsum("bsh,bshn,bshp->bhnp", to_end, bs, xs)
        ys.append(y)
    y = torch.cat(ys, dim=1) if ys else x.new_zeros(Bsz, 0, H, P)
    return y, h
