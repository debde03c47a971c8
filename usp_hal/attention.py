"""LongContextAttention (USP = Ulysses x Ring), and its one-dimensional special cases.

One call, on every rank of the sequence-parallel group:

1. validate the local inputs into a :class:`~usp_hal.spec.CallSpec` and pick the backend
   (nothing communicated yet);
2. one small all-gather of the spec's metadata vector (over a CPU group, so it never
   synchronises an accelerator): every rank learns every rank's length and sees any rank's
   validation error or any cross-rank mismatch, so all ranks raise the same error together
   instead of hanging in a data collective.  With ``static_shapes=True`` a call whose spec
   equals the first checked one skips this exchange;
3. one Ulysses all-to-all of q, k and v together (sequence -> heads), ring attention over
   the ring group, one all-to-all back (heads -> sequence), as one autograd Function (or a
   forward-only path that saves nothing).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import platform as _platform
from .capabilities import AttnRequest
from .codec import get_codec
from .comm import CommError, all_gather_bytes, all_gather_ints
from .layout import Segment, get_layout, local_lengths, local_positions, ring_segments, segments_from_positions
from .mesh import SequenceParallelMesh, get_default_mesh
from .registry import REGISTRY
from .ring import RingContext, merge_dtype, plan_blocks, ring_backward, ring_forward
from .rotation import Rotation, get_rotation
from .spec import CallSpec, compare, digest_ints, digest_tensor, error_meta, field_index
from .ulysses import HeadPlan, UlyssesExchange, head_plan, split_plan
from .varlen import as_cu_seqlens, ring_is_local

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


class USPError(ValueError):
    """A call that cannot run as asked (raised identically on every rank)."""


def _share(total: int, parts: int, i: int) -> Tuple[int, int]:
    """(start, count) of part ``i`` when ``total`` items are split like torch.tensor_split."""
    base, extra = divmod(total, parts)
    return i * base + min(i, extra), base + (1 if i < extra else 0)


def _joint_total(spec: CallSpec) -> int:
    return int(spec.joint.split(":")[1])


@dataclass
class _Joint:
    """Joint (MMDiT) tokens of one call: this rank's share joins its main tokens."""

    strategy: str
    total: int
    start: int
    count: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def extend(self, q, k, v):
        """This rank's rows: its joint share and its main tokens, joint first for "front"."""
        jk = self.k.narrow(1, self.start, self.count)
        jv = self.v.narrow(1, self.start, self.count)
        if self.strategy == "front":
            return torch.cat([self.q, q], 1), torch.cat([jk, k], 1), torch.cat([jv, v], 1)
        return torch.cat([q, self.q], 1), torch.cat([k, jk], 1), torch.cat([v, jv], 1)


# ------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class _Shape:
    """What a call's shapes and options fix (cached per spec, lengths and mesh)."""

    heads: HeadPlan
    per_rank: Tuple[Tuple[int, ...], ...]          # [ring rank][ulysses rank] -> local length
    segments: Tuple[Tuple[Segment, ...], ...]      # per ring rank
    ring_lengths: Tuple[int, ...]
    calls: Dict[int, list]                         # per source ring rank: the block plan
    blocks: frozenset = frozenset()                # (Sq, Sk, causal) of every rank's kernel calls
    local_only: bool = False                       # packed documents, none across ring ranks: no K/V exchange
    cu: Optional[Tuple[int, ...]] = None           # the document boundaries the plan was made for
    packed: Dict[int, list] = field(default_factory=dict)   # per source: the plan packed for varlen kernels


@dataclass
class _Stage:
    """One group of heads: its all-to-alls and its ring."""

    exchange: UlyssesExchange
    ring: RingContext


@dataclass
class CallPlan:
    """Everything one call runs with (built once per call, shared by forward and backward).
    ``stages`` holds one stage, or several head groups whose all-to-alls are pipelined with
    the kernels of their neighbours (:class:`AsyncLongContextAttention`)."""

    spec: CallSpec
    backend: object
    stages: List[_Stage]
    dtype: torch.dtype
    spec_lengths: Tuple[int, ...] = ()     # every rank's local length (sequence-parallel order)

    @property
    def exchange(self) -> UlyssesExchange:
        return self.stages[0].exchange

    @property
    def ring(self) -> RingContext:
        return self.stages[0].ring


class _PlannedRing(RingContext):
    """A RingContext whose block plans were computed once for this shape."""

    def __init__(self, shape: _Shape, **kw):
        super().__init__(**kw)
        self._calls = shape.calls
        self._packed_steps = shape.packed     # the packed steps are cached with the shape

    def calls(self, src: int):
        return self._calls[src]


# ------------------------------------------------------------------------------- compute
def _nan_guard(qh: torch.Tensor) -> torch.Tensor:
    """``[B, S, h, 1]``: 0 for rows whose query is finite, NaN otherwise (some kernels return
    a finite row for a non-finite query; adding this keeps single-device semantics)."""
    return qh.sum(dim=-1, keepdim=True, dtype=torch.float32 if qh.dtype != torch.float64 else torch.float64) * 0


def _forward(plan: CallPlan, q, k, v, keep: bool):
    """Forward of every stage.  With several stages, stage i+1's all-to-all is in flight
    while stage i's kernels run, and stage i's output travels back during stage i+1."""
    spec, stages = plan.spec, plan.stages
    if len(stages) == 1:
        st = stages[0]
        qh, kh, vh = st.exchange.qkv_to_heads(q, k, v)
        guard = _nan_guard(qh)
        out_acc, lse_h = ring_forward(st.ring, qh, kh, vh)
        if keep or spec.return_lse:
            lse_h = lse_h + guard.squeeze(-1).transpose(1, 2).to(lse_h.dtype)
        out, lse, outh = st.exchange.out_to_seq(out_acc, plan.dtype, lse_h if spec.return_lse else None, guard,
                                                keep_heads=keep)
        return out, lse, [(qh, kh, vh, outh, lse_h)]
    b, s = q.shape[0], q.shape[1]
    out = torch.empty((b, s, spec.heads, spec.v_dim), dtype=plan.dtype, device=q.device)
    lse = torch.empty((b, spec.heads, s), dtype=merge_dtype(plan.dtype), device=q.device) \
        if spec.return_lse else None
    saved, sends = [], []
    pending = stages[0].exchange.start_qkv(q, k, v, async_op=True)
    for i, st in enumerate(stages):
        qh, kh, vh = pending.wait()
        if i + 1 < len(stages):
            pending = stages[i + 1].exchange.start_qkv(q, k, v, async_op=True)
        guard = _nan_guard(qh)
        out_acc, lse_h = ring_forward(st.ring, qh, kh, vh)
        if keep or spec.return_lse:
            lse_h = lse_h + guard.squeeze(-1).transpose(1, 2).to(lse_h.dtype)
        sends.append(st.exchange.start_out(out_acc, plan.dtype, lse_h if spec.return_lse else None, guard,
                                           keep_heads=keep, into=out, lse_into=lse, async_op=True))
        saved.append([qh, kh, vh, None, lse_h])
    for i, p in enumerate(sends):
        saved[i][3] = p.wait()[2]
    return out, lse, [tuple(x) for x in saved]


def _backward(plan: CallPlan, dout, saved):
    stages = plan.stages
    if len(stages) == 1:
        qh, kh, vh, outh, lse_h = saved[0]
        ex = stages[0].exchange
        douth = ex.dout_to_heads(dout)
        dq, dk, dv = ring_backward(stages[0].ring, douth, qh, kh, vh, outh, lse_h)
        return ex.grads_to_seq(dq, dk, dv, plan.dtype)
    spec = plan.spec
    b, s = dout.shape[0], dout.shape[1]
    kw = dict(dtype=plan.dtype, device=dout.device)
    into = (torch.zeros((b, s, spec.heads, spec.head_dim), **kw),
            torch.zeros((b, s, spec.kv_heads, spec.head_dim), **kw),
            torch.zeros((b, s, spec.kv_heads, spec.v_dim), **kw))
    sends = []
    pending = stages[0].exchange.start_dout(dout, async_op=True)
    for i, st in enumerate(stages):
        douth = pending.wait()
        if i + 1 < len(stages):
            pending = stages[i + 1].exchange.start_dout(dout, async_op=True)
        qh, kh, vh, outh, lse_h = saved[i]
        dq, dk, dv = ring_backward(st.ring, douth, qh, kh, vh, outh, lse_h)
        sends.append(st.exchange.start_grads(dq, dk, dv, plan.dtype, into=into, async_op=True))
    for p in sends:
        p.wait()
    return into


class _USPFunction(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, plan: CallPlan):
        out, lse, saved = _forward(plan, q, k, v, keep=True)
        fctx.plan = plan
        fctx.n = len(saved)
        fctx.save_for_backward(*[t for st in saved for t in st])
        if lse is not None:
            fctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(fctx, dout, _dlse):
        flat = fctx.saved_tensors
        saved = [flat[5 * i:5 * i + 5] for i in range(fctx.n)]
        dq, dk, dv = _backward(fctx.plan, dout, saved)
        return dq, dk, dv, None


# ------------------------------------------------------------------------------- the module
class LongContextAttention(torch.nn.Module):
    """Unified Sequence Parallel attention: Ulysses over ``mesh.ulysses_group`` and Ring
    over ``mesh.ring_group``; equal to single-device attention in output and gradients.

    Inputs are this rank's part of the sequence, laid out by ``usp_hal.shard(x,
    layout=ring_impl_type)``: q ``[B, S_local, H, D]``, k/v ``[B, S_local, Hkv, D]``.
    Any H, any Hkv dividing H (GQA/MQA), any global length (uneven shards).

    ``attn_type``: "auto", a backend name, a :class:`usp_hal.AttnType` member, or one of
    yunchang's names.  An explicit choice is validated, never replaced.
    ``ring_impl_type``: a registered layout ("basic", "zigzag", "stripe"; zigzag/stripe
    balance causal work).  ``rotation``: "p2p" (next block in flight while this one
    computes) or "allgather".

    ``check_ranks`` (default on): every call exchanges a small metadata vector so that a
    cross-rank mismatch ends in the same error on every rank.  ``static_shapes=True``:
    after the first checked call, a call with the same spec runs no host-side collective
    at all (CUDA-graph friendly); a call whose spec differs raises on the rank that sees it.

    ``ulysses_float8=True``: q, v and the output travel through the Ulysses all-to-all as
    float8_e4m3fn with a scale per token and head (``float8_key=True``: k too; the default
    keeps k exact because softmax(q.k) is the sensitive part); ``ring_float8=True``: the
    ring's V blocks (and K with ``float8_key``) travel as fp8.  Lossy, see docs.  With
    gradients, the backward communicates at full precision and the gradient is the
    straight-through gradient of the quantised forward.  ``wire_codecs`` picks any
    registered codec (``usp_hal.codec.register_codec``) per tensor: keys ``q``, ``k``, ``v``,
    ``out`` (Ulysses) and ``ring_k``, ``ring_v`` (ring blocks), values codec names.

    Note on layouts: lengths alone cannot tell a zigzag shard from a basic one of the same
    size.  Shard inputs with ``usp_hal.shard(x, layout=ring_impl_type)``; to have every call
    verify it, pass ``positions=mesh.local_positions(S, layout)`` (a debugging aid).

    Packed sequences: ``forward(..., cu_seqlens=[0, l1, l1+l2, ..., S])`` (the global
    document boundaries, an integer tensor or list, the same on every rank) keeps attention
    inside each document, causal or not, with window/softcap/alibi/GQA applied per document.
    Shard with ``usp_hal.shard(x, layout=ring_impl_type, cu_seqlens=cu_seqlens)``;
    ``ring_impl_type="varlen_zigzag"`` balances causal work per document.  The boundaries
    are part of the cross-rank check (a digest), so with ``static_shapes=True`` a call with
    other boundaries than the first counts as a different call.  See ``usp_hal.varlen``.
    """

    def __init__(self, scatter_idx: int = 2, gather_idx: int = 1, ring_impl_type: str = "basic",
                 use_pack_qkv: bool = False, use_sync: bool = False, attn_type="auto",
                 attn_processor=None, *, mesh: Optional[SequenceParallelMesh] = None,
                 rotation: str = "p2p", check_ranks: bool = True, static_shapes: bool = False,
                 ulysses_float8: bool = False, float8_key: bool = False, ring_float8: bool = False,
                 q_descale=None, k_descale=None, v_descale=None, wire_codecs: Optional[Dict[str, str]] = None):
        super().__init__()
        if (scatter_idx, gather_idx) != (2, 1):
            raise NotImplementedError(
                f"scatter_idx={scatter_idx}, gather_idx={gather_idx}: only the [B, S, H, D] layout "
                "(scatter_idx=2, gather_idx=1) is supported; transpose your inputs to [B, S, H, D]")
        if attn_processor is not None:
            raise NotImplementedError("attn_processor is not supported; register a backend with "
                                      "usp_hal.register_backend(name, cls) and pass attn_type=name")
        if any(x is not None for x in (q_descale, k_descale, v_descale)):
            raise NotImplementedError("fp8 descale factors are not supported by the USP path "
                                      "(use ulysses_float8=True for an fp8 wire format)")
        self.layout = get_layout(ring_impl_type)
        self.ring_impl_type = self.layout.name
        self.rotation_cls = get_rotation(rotation)
        self.rotation: str = self.rotation_cls.name
        self.attn_type = attn_type
        REGISTRY.canonical_name(attn_type)          # unknown names fail here, not mid-run
        self.mesh = mesh
        self.check_ranks = check_ranks
        self.static_shapes = static_shapes
        self.use_pack_qkv = use_pack_qkv              # accepted for compatibility; q/k/v always travel packed
        self.use_sync = use_sync
        fp8 = "fp8" if ulysses_float8 else "identity"
        self.wire = {"q": fp8, "k": "fp8" if (ulysses_float8 and float8_key) else "identity", "v": fp8, "out": fp8}
        ring_wire = {"ring_k": "fp8" if (ring_float8 and float8_key) else "identity",
                     "ring_v": "fp8" if ring_float8 else "identity"}
        for name, codec in (wire_codecs or {}).items():
            if name not in self.wire and name not in ring_wire:
                raise ValueError(f"wire_codecs key {name!r}; valid: {', '.join([*self.wire, *ring_wire])}")
            codec_name = get_codec(codec).name            # unknown codec names fail here, not mid-run
            (self.wire if name in self.wire else ring_wire)[name] = codec_name
        self.ring_wire = (ring_wire["ring_k"], ring_wire["ring_v"])
        self._wire_name = ",".join(f"{n}={c}" for n, c in self.wire.items())
        if self.ring_wire != ("identity", "identity"):
            self._wire_name += f",ring_k={self.ring_wire[0]},ring_v={self.ring_wire[1]}"
        self._backends: dict = {}
        self._shapes: dict = {}
        self._frozen: Optional[Tuple[CallSpec, list]] = None
        self.last_backend: Any = None
        from .compiled import register_module
        self._handle = register_module(self)   # how a compiled graph finds this module

    # ------------------------------------------------------------------ public call
    def forward(self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                return_attn_probs=False, *args, positions: Optional[torch.Tensor] = None,
                joint_tensor_query: Optional[torch.Tensor] = None, joint_tensor_key: Optional[torch.Tensor] = None,
                joint_tensor_value: Optional[torch.Tensor] = None, joint_strategy: str = "none", cu_seqlens=None):
        """Attention over this rank's part of the sequence (see the class doc).

        Joint (MMDiT) tokens: with ``joint_strategy`` "front" or "rear", the global sequence is
        the joint tokens followed by the main ones ("front") or the main ones followed by the
        joint ones ("rear").  ``joint_tensor_query`` ``[B, J_local, H, D]`` is this rank's
        share of the joint queries (the J joint tokens split over the sequence-parallel ranks
        in rank order, as ``torch.tensor_split`` does); ``joint_tensor_key``/``_value``
        ``[B, J, Hkv, D]`` hold every joint token on every rank.  Each joint token joins the
        attention once.  The output holds this rank's joint rows and its main rows, joint
        rows first ("front") or last ("rear").  Gradients of ``joint_tensor_key``/``_value``
        are this rank's part (its queries' contribution): sum them over the
        sequence-parallel group, as for any tensor every rank holds in full.
        """
        if torch.compiler.is_compiling():
            if cu_seqlens is not None:
                raise NotImplementedError("cu_seqlens under torch.compile: packed documents run eagerly only; wrap "
                                          "the attention call in torch.compiler.disable or compile without them")
            from .compiled import compiled_forward
            return compiled_forward(self, query, key, value, dropout_p, softmax_scale, causal, window_size, softcap,
                                    alibi_slopes, deterministic, return_attn_probs, positions, joint_tensor_query,
                                    joint_tensor_key, joint_tensor_value, joint_strategy)
        mesh = self.mesh if self.mesh is not None else get_default_mesh()
        joint, err = None, None
        try:
            joint = self._joint(mesh, query, joint_tensor_query, joint_tensor_key, joint_tensor_value, joint_strategy)
            if joint is not None and cu_seqlens is not None:
                raise NotImplementedError("cu_seqlens together with joint tokens is not supported; pack the joint "
                                          "tokens into the documents (cu_seqlens) or drop cu_seqlens")
            if joint is not None:
                query, key, value = joint.extend(query, key, value)
        except (ValueError, NotImplementedError, TypeError) as exc:
            err = exc
        spec, plan = self._prepare(mesh, query, key, value, dropout_p, softmax_scale, causal, window_size, softcap,
                                   alibi_slopes, deterministic, return_attn_probs, positions, joint, err=err,
                                   cu_seqlens=cu_seqlens)
        if spec.needs_grad:
            out, lse = _USPFunction.apply(query, key, value, plan)
        else:
            with torch.no_grad():
                out, lse, _ = _forward(plan, query, key, value, keep=False)
        return (out, lse) if return_attn_probs else out

    def _prepare(self, mesh, q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes,
                 deterministic, return_lse, positions, joint, *, err=None, needs_grad=None, lengths=None,
                 head_groups=None, cu_seqlens=None):
        """Validate locally, agree across ranks (unless ``lengths`` are given: a plan is
        rebuilt), and build the call's plan; raises the same error on every rank."""
        spec, local = None, None
        if err is None:
            try:
                spec, local = self._local(mesh, q, k, v, dropout_p, softmax_scale, causal, window, softcap,
                                          alibi_slopes, deterministic, return_lse, positions, joint, needs_grad,
                                          cu_seqlens=cu_seqlens)
            except (ValueError, NotImplementedError, TypeError, RuntimeError) as exc:
                if isinstance(exc, CommError):
                    raise
                err = exc
        if lengths is None:
            lengths = self._agree(mesh, spec, err, local["cu_seqlens"] if local else None)
        elif err is not None:
            raise err
        plan = self._plan(mesh, spec, lengths, local, head_groups)
        self.last_backend = plan.backend
        return spec, plan

    # ------------------------------------------------------------------ validation
    def _joint(self, mesh, q, jq, jk, jv, strategy) -> "Optional[_Joint]":
        if strategy in (None, "none"):
            if any(t is not None for t in (jq, jk, jv)):
                raise ValueError("joint_tensor_query/key/value were given with joint_strategy='none'; pass "
                                 "joint_strategy='front' or 'rear'")
            return None
        if strategy not in ("front", "rear"):
            raise ValueError(f"joint_strategy={strategy!r}; valid: 'none', 'front', 'rear'")
        for name, t in (("joint_tensor_query", jq), ("joint_tensor_key", jk), ("joint_tensor_value", jv)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"joint_strategy={strategy!r} needs {name} as a [B, S, H, D] tensor, got "
                                 f"{type(t).__name__}{'' if not isinstance(t, torch.Tensor) else tuple(t.shape)}")
        J = int(jk.shape[1])
        if jv.shape[:3] != jk.shape[:3]:
            raise ValueError(f"joint_tensor_key {tuple(jk.shape)} and joint_tensor_value {tuple(jv.shape)} differ")
        if not (jq.shape[0] == jk.shape[0] == q.shape[0]) or jq.shape[2:] != q.shape[2:]:
            raise ValueError(f"joint_tensor_query {tuple(jq.shape)} must be [B, J_local, H, D] like the query "
                             f"{tuple(q.shape)}")
        start, count = _share(J, mesh.sp_size, mesh.sp_rank)
        if jq.shape[1] != count:
            raise ValueError(f"joint_tensor_query has {jq.shape[1]} tokens on sequence-parallel rank {mesh.sp_rank}, "
                             f"but the {J} joint tokens split over {mesh.sp_size} ranks in rank order give it {count} "
                             f"(tokens {start}..{start + count - 1}): pass joint queries split like torch.tensor_split")
        return _Joint(strategy, J, start, count, jq, jk, jv)

    def _local(self, mesh, q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes,
               deterministic, return_lse, positions, joint=None, needs_grad=None, cu_seqlens=None):
        for name, t in (("query", q), ("key", k), ("value", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
        b, s, h, d = q.shape
        if k.shape[:2] != (b, s) or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"key/value must share batch and local length with query: query {tuple(q.shape)}, "
                             f"key {tuple(k.shape)}, value {tuple(v.shape)}")
        if k.shape[3] != d:
            raise ValueError(f"key head_dim {k.shape[3]} != query head_dim {d}")
        if not (q.dtype == k.dtype == v.dtype):
            raise ValueError(f"query/key/value dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
        if not (q.device == k.device == v.device):
            raise ValueError(f"query/key/value are on different devices: {q.device}, {k.device}, {v.device}")
        if q.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"dtype {q.dtype} is not supported (use fp64, fp32, bf16 or fp16)")
        hkv = k.shape[2]
        if h < 1 or hkv < 1 or h % hkv:
            raise ValueError(f"query heads ({h}) must be a positive multiple of key/value heads ({hkv})")
        if d < 1 or v.shape[3] < 1:
            raise ValueError("head_dim must be >= 1")
        try:
            win = tuple(int(x) for x in window)
        except (TypeError, ValueError):
            win = ()
        if len(win) != 2 or any(x < -1 for x in win):
            raise ValueError(f"window_size must be (left, right) with -1 for unbounded, got {window}")
        softcap = float(softcap)
        if not softcap >= 0:
            raise ValueError(f"softcap must be >= 0, got {softcap}")
        if dropout_p:
            raise NotImplementedError(
                f"dropout_p={dropout_p}: attention dropout inside sequence-parallel attention is refused, since "
                "no kernel's dropout mask can be reproduced across Ulysses/ring blocks and the backward; "
                "use dropout_p=0.0 (apply dropout to the attention output instead)")
        alibi = 0
        if alibi_slopes is not None:
            if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.shape not in ((h,), (b, h)):
                raise ValueError(f"alibi_slopes must be a tensor of shape ({h},) or ({b}, {h}), got "
                                 f"{tuple(getattr(alibi_slopes, 'shape', ()))}")
            alibi = self._digest(alibi_slopes)
        R, U = mesh.ring_degree, mesh.ulysses_degree
        positional = win != (-1, -1) or alibi_slopes is not None
        if joint is not None and R > 1 and not self.layout.contiguous and (positional or causal):
            raise NotImplementedError(f"joint tokens with causal/window/alibi and the {self.layout.name} layout on "
                                      "a ring are not supported (its shards are not contiguous); use "
                                      "ring_impl_type='basic' or 'zigzag', or causal=False")
        if R > 1 and not self.layout.contiguous and positional:
            raise NotImplementedError(f"window_size/alibi_slopes with the {self.layout.name} layout and "
                                      f"ring_degree > 1 "
                                      "cannot be exact (its shards are not contiguous); use ring_impl_type='basic' or "
                                      "'zigzag'")
        pos_digest = 0
        if positions is not None:
            pos = torch.as_tensor(positions).reshape(-1)
            if joint is not None:
                raise ValueError("positions= is not checked together with joint tokens; drop one of them")
            if pos.numel() != s:
                raise ValueError(f"positions has {pos.numel()} entries, the local sequence {s}")
            pos_digest = digest_ints(pos.tolist())
        # packed documents: the boundaries, checked here; their total against S once the ranks' lengths are known
        cu = as_cu_seqlens(cu_seqlens) if cu_seqlens is not None else None
        docs = digest_ints(cu) if cu is not None else 0
        plan = head_plan(h, hkv, U)
        hq_loc, hk_loc = plan.local_heads(mesh.ulysses_rank)
        device_type = _platform.device_type_of(q.device)
        if needs_grad is None:
            needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
        spec = CallSpec(batch=b, local_len=s, heads=h, kv_heads=hkv, head_dim=d, v_dim=int(v.shape[3]),
                        dtype=q.dtype, device_type=device_type, causal=bool(causal), window=win, softcap=softcap,
                        scale=scale, alibi=alibi, dropout_p=0.0, deterministic=bool(deterministic),
                        needs_grad=needs_grad, return_lse=bool(return_lse), layout=self.layout.name,
                        rotation=self.rotation, ulysses=U, ring=R, wire=self._wire_name, positions=pos_digest,
                        joint="" if joint is None else f"{joint.strategy}:{joint.total}", docs=docs)
        req = AttnRequest(
            dtype=q.dtype, device_type=device_type, head_dim=d, head_dim_v=int(v.shape[3]),
            num_heads=max(hq_loc, 1), num_kv_heads=max(hk_loc, 1), causal=bool(causal), window=win,
            softcap=softcap, alibi=alibi_slopes is not None, dropout_p=0.0, needs_grad=needs_grad,
            needs_lse=R > 1 or bool(return_lse), deterministic=bool(deterministic),
            key_offset=R > 1 or joint is not None,
            compute_capability=_platform.compute_capability(device_type, q.device.index or 0),
            device_model=_platform.device_model(device_type, q.device.index or 0), varlen=cu is not None)
        backend = self._backend_for(req)
        return spec, {"backend": backend, "heads": plan, "alibi": alibi_slopes, "device": q.device,
                      "positions": positions, "request": req, "cu_seqlens": cu}

    def _digest(self, t: torch.Tensor) -> int:
        """Digest of small tensors (alibi slopes), cached per tensor object and version so a
        reused tensor costs no device->host copy after its first call."""
        key = (id(t), t.data_ptr(), getattr(t, "_version", 0), tuple(t.shape), t.dtype)
        cache = self.__dict__.setdefault("_digests", {})
        if key not in cache:
            if len(cache) > 64:
                cache.clear()
            cache[key] = digest_tensor(t)
        return cache[key]

    def _backend_for(self, req: AttnRequest):
        if req not in self._backends:
            self._backends[req] = REGISTRY.select(self.attn_type, req)()
        return self._backends[req]

    def _agree(self, mesh, spec: Optional[CallSpec], err, cu_seqlens=None) -> list:
        """Every rank's local length, after making sure every rank can run this call and all
        agree on it; raises the same error on every rank otherwise.  ``cu_seqlens``: the
        validated document boundaries of a packed call (their digest is in the spec)."""
        n = mesh.sp_size
        if n == 1:
            if err is not None:
                raise err
            assert spec is not None
            if cu_seqlens is not None:
                self._check_layout(mesh, spec, [spec.local_len], None, cu_seqlens)
            return [spec.local_len]
        if self.static_shapes and self._frozen is not None and err is None and spec is not None:
            frozen, lengths = self._frozen
            if spec == frozen:
                return lengths
            diffs = compare([frozen.meta(), spec.meta()], ["frozen", "this call"], spec)
            raise USPError("static_shapes=True: this call differs from the first (checked) one, so it cannot "
                           "run without a metadata exchange; use a module with static_shapes=False for "
                           "changing shapes (this rank only; the other ranks stop at the group timeout):\n  "
                           + "\n  ".join(diffs))
        group = mesh.metadata_group
        where = mesh.where("sequence-parallel")
        if self.check_ranks:
            meta = error_meta() if err is not None or spec is None else spec.meta()
        else:
            meta = [1, 0] if err is not None or spec is None else [0, spec.local_len]
        rows = all_gather_ints(meta, group, what="metadata all-gather of the attention call", where=where)
        bad = [i for i, r in enumerate(rows) if r[0]]
        if bad:
            msgs = [b.decode("utf-8", "replace") for b in all_gather_bytes(
                ("" if err is None else f"{type(err).__name__}: {err}").encode("utf-8"), group,
                what="error message all-gather", where=where)]
            if err is not None:
                raise err
            raise USPError("attention call refused on other rank(s) of the sequence-parallel group:\n"
                           + "\n".join(f"  rank {mesh.sp_ranks[i]}: {msgs[i]}" for i in bad))
        if self.check_ranks:
            diffs = compare(rows, mesh.sp_ranks, spec)
            if diffs:
                raise USPError("ranks of the sequence-parallel group disagree on this attention call "
                               "(every rank must pass the same shapes and options):\n  " + "\n  ".join(diffs))
            lengths = [r[field_index("local_len")] for r in rows]
        else:
            lengths = [r[1] for r in rows]
        assert spec is not None      # no rank flagged an error, so this one has a spec
        self._check_layout(mesh, spec, lengths, rows if self.check_ranks else None, cu_seqlens)
        if self.static_shapes:
            self._frozen = (spec, lengths)
        return lengths

    def _check_layout(self, mesh, spec: CallSpec, lengths, rows, cu=None) -> None:
        R, U = mesh.ring_degree, mesh.ulysses_degree
        if spec.joint:   # the main tokens' lengths follow the layout; the joint shares were checked locally
            total = _joint_total(spec)
            lengths = [n - _share(total, mesh.sp_size, i)[1] for i, n in enumerate(lengths)]
        seqlen = sum(lengths)
        layout = self.layout.name
        per = [[lengths[mesh.sp_index(r, u)] for u in range(U)] for r in range(R)]
        if cu is not None and cu[-1] != seqlen:
            raise USPError(f"cu_seqlens ends at {cu[-1]}, but the ranks hold {seqlen} tokens in all "
                           f"(local lengths {per}, ring x ulysses); the last boundary must be the global length S")
        if spec.causal or spec.positional or cu is not None:
            expect = local_lengths(layout, seqlen, R, U, cu_seqlens=cu)
            if per != expect:
                how = f"layout={layout!r}" + (", cu_seqlens=cu_seqlens" if cu is not None else "")
                raise USPError(f"local sequence lengths {per} (ring x ulysses) do not match the {layout!r} layout "
                               f"for S={seqlen}{' and these documents' if cu is not None else ''} (expected "
                               f"{expect}); shard inputs with usp_hal.shard(x, {how}) (causal/window/alibi and "
                               f"document boundaries depend on positions)")
        if rows is not None and spec.positions:
            idx = field_index("positions")
            wrong = []
            for i, r in enumerate(rows):
                pos = local_positions(layout, seqlen, R, U, mesh.ring_of(i), mesh.ulysses_of(i), cu_seqlens=cu)
                if r[idx] != digest_ints(pos.tolist()):
                    wrong.append(mesh.sp_ranks[i])
            if wrong:
                raise USPError(f"rank(s) {wrong} hold other positions than the {layout!r} layout gives them for "
                               f"S={seqlen} (checked because positions= was passed); shard inputs with "
                               f"usp_hal.shard(x, layout={layout!r})")

    # ------------------------------------------------------------------ plan
    def _shape(self, mesh, spec: CallSpec, lengths, heads: HeadPlan, cu=None) -> _Shape:
        key = (id(mesh), spec.heads, spec.kv_heads, spec.causal, spec.window, spec.alibi != 0, spec.joint,
               tuple(lengths), spec.docs)
        shape = self._shapes.get(key)
        if shape is not None and (cu is None or shape.cu == cu):
            return shape
        R, U = mesh.ring_degree, mesh.ulysses_degree
        seqlen = sum(lengths)
        per = tuple(tuple(lengths[mesh.sp_index(r, u)] for u in range(U)) for r in range(R))
        sorted_ = True
        if (spec.causal or spec.positional) and spec.joint:
            segments, sorted_ = self._joint_segments(mesh, spec, lengths)
        elif spec.causal or spec.positional or cu is not None:
            segments = tuple(tuple(ring_segments(self.layout, seqlen, R, r, cu_seqlens=cu)) for r in range(R))
        else:   # positions do not matter: any split works
            starts = [sum(sum(p) for p in per[:r]) for r in range(R)]
            segments = tuple((Segment(starts[r], sum(per[r])),) for r in range(R))
        me = mesh.ring_rank
        every = {(a, src): plan_blocks(segments[a], segments[src], causal=spec.causal, window=spec.window,
                                       positional=spec.positional, diagonal=src == a and sorted_, cu_seqlens=cu)
                 for a in range(R) for src in range(R)}
        calls = {src: every[(me, src)] for src in range(R)}
        blocks = frozenset((c.q_stop - c.q_start, c.k_stop - c.k_start, c.causal) for cs in every.values() for c in cs)
        shape = _Shape(heads, per, segments, tuple(sum(p) for p in per), calls, blocks,
                       local_only=ring_is_local(segments, cu), cu=cu)
        if len(self._shapes) > 32:
            self._shapes.clear()
        self._shapes[key] = shape
        return shape

    def _joint_segments(self, mesh, spec: CallSpec, lengths):
        """Per ring rank, the global positions its rows hold (joint and main tokens, in local
        order) as segments, and whether every rank's positions are increasing."""
        R, U = mesh.ring_degree, mesh.ulysses_degree
        total = _joint_total(spec)
        front = spec.joint.startswith("front")
        main = [n - _share(total, mesh.sp_size, i)[1] for i, n in enumerate(lengths)]
        S = sum(main)
        segs, ordered = [], True
        for r in range(R):
            rows = []
            for u in range(U):
                i = mesh.sp_index(r, u)
                js, jn = _share(total, mesh.sp_size, i)
                mpos = local_positions(self.layout.name, S, R, U, r, u)
                jpos = torch.arange(js, js + jn)
                rows += ([jpos, mpos + total] if front else [mpos, jpos + S])
            pos = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
            ordered = ordered and bool((pos[1:] > pos[:-1]).all())
            segs.append(tuple(segments_from_positions(pos)))
        return tuple(segs), ordered

    def _head_groups(self, heads: HeadPlan) -> List[HeadPlan]:
        return [heads]

    def _check_blocks(self, shape: _Shape, local) -> None:
        """Every kernel call of every rank's plan must be one the backend accepts (its rules on
        Sq/Sk, e.g. bottom-right windows): checked before any data moves, on every rank
        alike, since every rank plans every rank's blocks."""
        req, backend = local["request"], local["backend"]
        key = (id(shape), type(backend).__name__)
        done = self.__dict__.setdefault("_checked_blocks", set())
        if key in done:
            return
        reasons = []
        for sq, sk, causal in sorted(shape.blocks):
            if sq != sk:
                why = type(backend).not_supported_reasons(req.with_(seqlen_q=sq, seqlen_k=sk, causal=causal))
                reasons += [f"a ring block of {sq} queries x {sk} keys: {w}" for w in why if w not in reasons]
        if reasons:
            raise USPError(f"attn_type={backend.NAME!r} cannot run every block this call needs:\n  - "
                           + "\n  - ".join(dict.fromkeys(reasons)) + "\nuse attn_type='sdpa' or another layout")
        if len(done) > 64:
            done.clear()
        done.add(key)

    def _plan(self, mesh, spec: CallSpec, lengths, local, head_groups=None) -> CallPlan:
        heads = local["heads"]
        shape = self._shape(mesh, spec, lengths, heads, local.get("cu_seqlens"))
        self._check_blocks(shape, local)
        me_r, me_u = mesh.ring_rank, mesh.ulysses_rank
        codecs = {n: get_codec(c) for n, c in self.wire.items()}
        ring_codecs = (get_codec(self.ring_wire[0]), get_codec(self.ring_wire[1]))
        stages = []
        groups = (head_groups or type(self)._head_groups)(self, heads)
        for group in groups:
            exchange = UlyssesExchange(group, mesh.ulysses_group, me_u, shape.per_rank[me_r],
                                       where=mesh.where("ulysses"), codecs=codecs)
            # packed documents that no two ring ranks share: every rank only needs its own keys
            rotation_cls = Rotation if shape.local_only else self.rotation_cls
            rotation = rotation_cls(mesh.ring_group, mesh.ring_ranks, me_r, shape.ring_lengths,
                                    where=mesh.where("ring"), codecs=ring_codecs)
            slopes = None
            if local["alibi"] is not None:
                a, c = group.q[me_u]
                slopes = local["alibi"][..., a:c].to(device=local["device"], dtype=torch.float32)
            ring = _PlannedRing(shape, backend=local["backend"], ring_size=mesh.ring_degree, ring_rank=me_r,
                                segments=shape.segments, lengths=shape.ring_lengths, softmax_scale=spec.scale,
                                causal=spec.causal, rotation=rotation, window=spec.window, softcap=spec.softcap,
                                alibi_slopes=slopes, deterministic=spec.deterministic, cu_seqlens=shape.cu)
            stages.append(_Stage(exchange, ring))
        return CallPlan(spec, local["backend"], stages, spec.dtype, tuple(lengths))

    def extra_repr(self) -> str:
        return f"attn_type={self.attn_type!r}, ring_impl_type={self.ring_impl_type!r}, rotation={self.rotation!r}"


class AsyncLongContextAttention(LongContextAttention):
    """:class:`LongContextAttention` with the Ulysses all-to-alls pipelined against the
    kernels (same constructor and forward arguments, plus ``head_chunks``).

    Each rank's heads are split into ``head_chunks`` groups (whole KV groups where GQA
    runs locally).  The all-to-all of group i+1 is in flight while the ring runs group i,
    and group i's output travels back while group i+1 computes; the backward pipelines
    the output-gradient and dq/dk/dv exchanges the same way.  Results equal the
    synchronous path's.  With one Ulysses rank there is nothing to overlap."""

    def __init__(self, *args, head_chunks: int = 2, **kw):
        super().__init__(*args, **kw)
        if not isinstance(head_chunks, int) or head_chunks < 1:
            raise ValueError(f"head_chunks must be a positive integer, got {head_chunks!r}")
        self.head_chunks = head_chunks

    def _head_groups(self, heads: HeadPlan) -> List[HeadPlan]:
        if heads.size == 1 or self.head_chunks == 1:
            return [heads]
        return split_plan(heads, self.head_chunks)


class UlyssesAttention(LongContextAttention):
    """Ulysses only (ring degree 1): all-to-all over the mesh's Ulysses group."""

    def forward(self, *args, **kw):
        mesh = self.mesh if self.mesh is not None else get_default_mesh()
        if mesh.ring_degree != 1:
            raise ValueError(f"UlyssesAttention needs a mesh with ring_degree=1 (got {mesh.ring_degree}); "
                             "use LongContextAttention for ulysses x ring")
        return super().forward(*args, **kw)


class RingAttention(LongContextAttention):
    """Ring only (ulysses degree 1)."""

    def forward(self, *args, **kw):
        mesh = self.mesh if self.mesh is not None else get_default_mesh()
        if mesh.ulysses_degree != 1:
            raise ValueError(f"RingAttention needs a mesh with ulysses_degree=1 (got {mesh.ulysses_degree}); "
                             "use LongContextAttention for ulysses x ring")
        return super().forward(*args, **kw)


class LongContextAttentionQKVPacked(LongContextAttention):
    """Packed input ``qkv [B, S_local, 3, H, D]`` (yunchang-compatible)."""

    def forward(self, qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                alibi_slopes=None, deterministic=False, return_attn_probs=False, *args, positions=None,
                cu_seqlens=None):
        if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
            raise ValueError(f"qkv must be [batch, seq, 3, heads, head_dim], got {tuple(getattr(qkv, 'shape', ()))}")
        q, k, v = qkv.unbind(2)
        return super().forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_attn_probs, positions=positions, cu_seqlens=cu_seqlens)


__all__ = ["LongContextAttention", "AsyncLongContextAttention", "LongContextAttentionQKVPacked", "UlyssesAttention",
           "RingAttention", "USPError", "CallPlan", "merge_dtype"]
