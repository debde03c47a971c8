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
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from . import platform as _platform
from .capabilities import AttnRequest
from .codec import get_codec
from .comm import CommError, all_gather_bytes, all_gather_ints
from .layout import Segment, get_layout, local_lengths, local_positions, ring_segments
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


# ------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class _Shape:
    """What a call's shapes and options fix (cached per spec, lengths and mesh)."""

    heads: HeadPlan
    per_rank: Tuple[Tuple[int, ...], ...]          # [ring rank][ulysses rank] -> local length
    segments: Tuple[Tuple[Segment, ...], ...]      # per ring rank
    ring_lengths: Tuple[int, ...]
    calls: Dict[int, list]                         # per source ring rank: the block plan
    local_only: bool = False                       # packed documents, none across ring ranks: no K/V exchange
    cu: Optional[Tuple[int, ...]] = None           # the document boundaries the plan was made for


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
    straight-through gradient of the quantised forward.

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
                 q_descale=None, k_descale=None, v_descale=None):
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
        self.rotation = self.rotation_cls.name
        self.attn_type = attn_type
        REGISTRY.canonical_name(attn_type)          # unknown names fail here, not mid-run
        self.mesh = mesh
        self.check_ranks = check_ranks
        self.static_shapes = static_shapes
        self.use_pack_qkv = use_pack_qkv              # accepted for compatibility; q/k/v always travel packed
        self.use_sync = use_sync
        fp8 = "fp8" if ulysses_float8 else "identity"
        self.wire = {"q": fp8, "k": "fp8" if (ulysses_float8 and float8_key) else "identity", "v": fp8, "out": fp8}
        self.ring_wire = ("fp8" if (ring_float8 and float8_key) else "identity",
                          "fp8" if ring_float8 else "identity")
        self._wire_name = ",".join(f"{n}={c}" for n, c in self.wire.items()) + \
            ("" if not ring_float8 else f",ring_k={self.ring_wire[0]},ring_v={self.ring_wire[1]}")
        self._backends: dict = {}
        self._shapes: dict = {}
        self._frozen = None
        self.last_backend = None

    # ------------------------------------------------------------------ public call
    def forward(self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                return_attn_probs=False, *args, positions: Optional[torch.Tensor] = None, cu_seqlens=None):
        mesh = self.mesh if self.mesh is not None else get_default_mesh()
        spec, local, err = None, None, None
        try:
            spec, local = self._local(mesh, query, key, value, dropout_p, softmax_scale, causal, window_size,
                                      softcap, alibi_slopes, deterministic, return_attn_probs, positions,
                                      cu_seqlens=cu_seqlens)
        except (ValueError, NotImplementedError, TypeError, RuntimeError) as exc:
            if isinstance(exc, CommError):
                raise
            err = exc
        lengths = self._agree(mesh, spec, err, local["cu_seqlens"] if local else None)
        plan = self._plan(mesh, spec, lengths, local)
        self.last_backend = plan.backend
        if spec.needs_grad:
            out, lse = _USPFunction.apply(query, key, value, plan)
        else:
            with torch.no_grad():
                out, lse, _ = _forward(plan, query, key, value, keep=False)
        return (out, lse) if return_attn_probs else out

    # ------------------------------------------------------------------ validation
    def _local(self, mesh, q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes,
               deterministic, return_lse, positions, cu_seqlens=None):
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
        if R > 1 and not self.layout.contiguous and positional:
            raise NotImplementedError(f"window_size/alibi_slopes with the {self.layout.name} layout and ring_degree > 1 "
                                      "cannot be exact (its shards are not contiguous); use ring_impl_type='basic' or "
                                      "'zigzag'")
        pos_digest = 0
        if positions is not None:
            pos = torch.as_tensor(positions).reshape(-1)
            if pos.numel() != s:
                raise ValueError(f"positions has {pos.numel()} entries, the local sequence {s}")
            pos_digest = digest_ints(pos.tolist())
        # packed documents: the boundaries, checked here; their total against S once the ranks' lengths are known
        cu = as_cu_seqlens(cu_seqlens) if cu_seqlens is not None else None
        docs = digest_ints(cu) if cu is not None else 0
        plan = head_plan(h, hkv, U)
        hq_loc, hk_loc = plan.local_heads(mesh.ulysses_rank)
        device_type = _platform.device_type_of(q.device)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
        spec = CallSpec(batch=b, local_len=s, heads=h, kv_heads=hkv, head_dim=d, v_dim=int(v.shape[3]),
                        dtype=q.dtype, device_type=device_type, causal=bool(causal), window=win, softcap=softcap,
                        scale=scale, alibi=alibi, dropout_p=0.0, deterministic=bool(deterministic),
                        needs_grad=needs_grad, return_lse=bool(return_lse), layout=self.layout.name,
                        rotation=self.rotation, ulysses=U, ring=R, wire=self._wire_name, positions=pos_digest,
                        docs=docs)
        req = AttnRequest(
            dtype=q.dtype, device_type=device_type, head_dim=d, head_dim_v=int(v.shape[3]),
            num_heads=max(hq_loc, 1), num_kv_heads=max(hk_loc, 1), causal=bool(causal), window=win,
            softcap=softcap, alibi=alibi_slopes is not None, dropout_p=0.0, needs_grad=needs_grad,
            needs_lse=R > 1 or bool(return_lse), deterministic=bool(deterministic), key_offset=R > 1,
            compute_capability=_platform.compute_capability(device_type, q.device.index or 0))
        if cu is not None:
            req = req.with_(varlen=True)
        backend = self._backend_for(req)
        return spec, {"backend": backend, "heads": plan, "alibi": alibi_slopes, "device": q.device,
                      "positions": positions, "cu_seqlens": cu}

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
            if cu_seqlens is not None:
                self._check_layout(mesh, spec, [spec.local_len], None, cu_seqlens)
            return [spec.local_len]
        if self.static_shapes and self._frozen is not None and err is None:
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
            meta = error_meta() if err is not None else spec.meta()
        else:
            meta = [1, 0] if err is not None else [0, spec.local_len]
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
        self._check_layout(mesh, spec, lengths, rows if self.check_ranks else None, cu_seqlens)
        if self.static_shapes:
            self._frozen = (spec, lengths)
        return lengths

    def _check_layout(self, mesh, spec: CallSpec, lengths, rows, cu=None) -> None:
        R, U = mesh.ring_degree, mesh.ulysses_degree
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
        key = (id(mesh), spec.heads, spec.kv_heads, spec.causal, spec.window, spec.alibi != 0, tuple(lengths),
               spec.docs)
        shape = self._shapes.get(key)
        if shape is not None and (cu is None or shape.cu == cu):
            return shape
        R, U = mesh.ring_degree, mesh.ulysses_degree
        seqlen = sum(lengths)
        per = tuple(tuple(lengths[mesh.sp_index(r, u)] for u in range(U)) for r in range(R))
        if spec.causal or spec.positional or cu is not None:
            segments = tuple(tuple(ring_segments(self.layout, seqlen, R, r, cu_seqlens=cu)) for r in range(R))
        else:   # positions do not matter: any split works
            starts = [sum(sum(p) for p in per[:r]) for r in range(R)]
            segments = tuple((Segment(starts[r], sum(per[r])),) for r in range(R))
        me = mesh.ring_rank
        calls = {src: plan_blocks(segments[me], segments[src], causal=spec.causal, window=spec.window,
                                  positional=spec.positional, diagonal=src == me, cu_seqlens=cu)
                 for src in range(R)}
        shape = _Shape(heads, per, segments, tuple(sum(p) for p in per), calls,
                       local_only=ring_is_local(segments, cu), cu=cu)
        if len(self._shapes) > 32:
            self._shapes.clear()
        self._shapes[key] = shape
        return shape

    def _head_groups(self, heads: HeadPlan) -> List[HeadPlan]:
        return [heads]

    def _plan(self, mesh, spec: CallSpec, lengths, local) -> CallPlan:
        heads = local["heads"]
        shape = self._shape(mesh, spec, lengths, heads, local.get("cu_seqlens"))
        me_r, me_u = mesh.ring_rank, mesh.ulysses_rank
        codecs = {n: get_codec(c) for n, c in self.wire.items()}
        ring_codecs = tuple(get_codec(c) for c in self.ring_wire)
        stages = []
        for group in self._head_groups(heads):
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
                                alibi_slopes=slopes, deterministic=spec.deterministic)
            stages.append(_Stage(exchange, ring))
        return CallPlan(spec, local["backend"], stages, spec.dtype)

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
