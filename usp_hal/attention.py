"""LongContextAttention (USP = Ulysses x Ring), and its one-dimensional special cases.

One call, on every rank of the sequence-parallel group:

1. validate the local inputs and pick the backend (nothing communicated yet);
2. one small all-gather of per-rank metadata: every rank learns every rank's lengths and
   sees any rank's validation error or any cross-rank mismatch, so all ranks raise the
   same error together instead of hanging in a data collective;
3. Ulysses all-to-all (sequence -> heads), ring attention over the ring group,
   all-to-all back (heads -> sequence), as one autograd Function (or a forward-only path).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from . import platform as _platform
from .capabilities import AttnRequest
from .comm import UlyssesSpec, all_gather_bytes, all_gather_ints, head_plan, head_to_seq, seq_to_head
from .layout import LAYOUTS, Segment, check_layout, local_lengths, ring_segments
from .mesh import SequenceParallelMesh, get_default_mesh
from .registry import REGISTRY
from .ring import RingContext, ring_backward, ring_forward

ROTATIONS = ("p2p", "allgather")
_DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}
_DEVICE_CODES = {"cpu": 1, "cuda": 2, "rocm": 3, "npu": 4, "xpu": 5}
_META_FIELDS = ("error", "seqlen", "batch", "heads", "kv_heads", "head_dim", "v_dim", "dtype", "device",
                "causal", "window_left", "window_right", "softcap_x1e6", "alibi", "dropout_x1e6", "layout",
                "rotation", "needs_grad", "return_lse", "deterministic", "scale_x1e9")


class USPError(ValueError):
    """A call that cannot run as asked (raised identically on every rank)."""


@dataclass
class _Call:
    """Per-call plan shared by forward and backward."""

    backend: object
    q_spec: UlyssesSpec
    kv_spec: UlyssesSpec
    ring: RingContext
    return_lse: bool


def _positional_request(window, alibi_slopes) -> bool:
    return tuple(window) != (-1, -1) or alibi_slopes is not None


class _USPFunction(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, call: _Call):
        out, lse, saved = _forward_impl(call, q, k, v)
        fctx.call = call
        fctx.save_for_backward(*saved)
        if lse is not None:
            fctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(fctx, dout, _dlse):
        call = fctx.call
        qh, kh, vh, outh, lseh = fctx.saved_tensors
        douth = seq_to_head(dout, call.q_spec)
        dqh, dkh, dvh = ring_backward(call.ring, douth, qh, kh, vh, outh, lseh)
        dq = head_to_seq(dqh, call.q_spec)
        dk = head_to_seq(dkh, call.kv_spec)
        dv = head_to_seq(dvh, call.kv_spec)
        return dq, dk, dv, None


def _forward_impl(call: _Call, q, k, v):
    qh = seq_to_head(q, call.q_spec)
    kh = seq_to_head(k, call.kv_spec)
    vh = seq_to_head(v, call.kv_spec)
    outh, lseh = ring_forward(call.ring, qh, kh, vh)
    out = head_to_seq(outh, call.q_spec)
    lse = None
    if call.return_lse:
        # [B, h, L] -> [B, L, h, 1] -> all-to-all -> [B, S_local, H]
        lse = head_to_seq(lseh.transpose(1, 2).unsqueeze(-1), call.q_spec).squeeze(-1).transpose(1, 2).contiguous()
    return out, lse, (qh, kh, vh, outh, lseh)


class LongContextAttention(torch.nn.Module):
    """Unified Sequence Parallel attention: Ulysses over ``mesh.ulysses_group`` and Ring
    over ``mesh.ring_group``; equal to single-device attention in output and gradients.

    Inputs are this rank's part of the sequence, laid out by ``usp_hal.shard(x,
    layout=ring_impl_type)``: q ``[B, S_local, H, D]``, k/v ``[B, S_local, Hkv, D]``.
    Any H, any Hkv dividing H (GQA/MQA), any global length (uneven shards).

    ``attn_type``: "auto", a backend name, a :class:`usp_hal.AttnType` member, or one of
    yunchang's names.  An explicit choice is validated, never replaced.
    ``ring_impl_type``: "basic" | "zigzag" | "stripe" (the layout; zigzag/stripe balance
    causal work).  ``rotation``: "p2p" (next block in flight while this one computes) or
    "allgather".  ``check_ranks``: exchange metadata each call so a cross-rank mismatch
    ends in the same error on every rank (one tiny all-gather; keep it on).
    """

    def __init__(self, scatter_idx: int = 2, gather_idx: int = 1, ring_impl_type: str = "basic",
                 use_pack_qkv: bool = False, use_sync: bool = False, attn_type="auto",
                 attn_processor=None, *, mesh: Optional[SequenceParallelMesh] = None,
                 rotation: str = "p2p", check_ranks: bool = True, q_descale=None, k_descale=None,
                 v_descale=None):
        super().__init__()
        if (scatter_idx, gather_idx) != (2, 1):
            raise NotImplementedError(
                f"scatter_idx={scatter_idx}, gather_idx={gather_idx}: only the [B, S, H, D] layout "
                "(scatter_idx=2, gather_idx=1) is supported; transpose your inputs to [B, S, H, D]")
        if attn_processor is not None:
            raise NotImplementedError("attn_processor is not supported; register a backend with "
                                      "usp_hal.register_backend(name, cls) and pass attn_type=name")
        if any(x is not None for x in (q_descale, k_descale, v_descale)):
            raise NotImplementedError("fp8 descale factors are not supported by the USP path")
        check_layout(ring_impl_type)
        if rotation not in ROTATIONS:
            raise ValueError(f"rotation={rotation!r}; valid: {', '.join(ROTATIONS)}")
        self.ring_impl_type = ring_impl_type
        self.attn_type = attn_type
        REGISTRY.canonical_name(attn_type)          # unknown names fail here, not mid-run
        self.mesh = mesh
        self.rotation = rotation
        self.check_ranks = check_ranks
        self.use_pack_qkv = use_pack_qkv              # accepted for compatibility; K/V already travel together in the ring
        self.use_sync = use_sync
        self._backends = {}
        self.last_backend = None

    # ------------------------------------------------------------------ public call
    def forward(self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                return_attn_probs=False, *args):
        mesh = self.mesh if self.mesh is not None else get_default_mesh()
        call, err = None, None
        try:
            call = self._prepare_local(mesh, query, key, value, dropout_p, softmax_scale, causal, window_size,
                                       softcap, alibi_slopes, deterministic, return_attn_probs)
        except (ValueError, NotImplementedError, TypeError, RuntimeError) as exc:
            err = exc
        meta = self._metadata(err, query, key, value, dropout_p, softmax_scale, causal, window_size, softcap,
                              alibi_slopes, deterministic, return_attn_probs)
        lengths = self._exchange(mesh, meta, err)
        call = self._finish_plan(mesh, call, lengths, causal, window_size, alibi_slopes)
        self.last_backend = call.backend
        if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
            out, lse = _USPFunction.apply(query, key, value, call)
        else:
            with torch.no_grad():
                out, lse, _ = _forward_impl(call, query, key, value)
        return (out, lse) if return_attn_probs else out

    # ------------------------------------------------------------------ validation
    def _prepare_local(self, mesh, q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes,
                       deterministic, return_lse):
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
        if q.dtype not in _DTYPE_CODES:
            raise ValueError(f"dtype {q.dtype} is not supported (use fp64, fp32, bf16 or fp16)")
        hkv = k.shape[2]
        if h < 1 or hkv < 1 or h % hkv:
            raise ValueError(f"query heads ({h}) must be a positive multiple of key/value heads ({hkv})")
        if d < 1:
            raise ValueError("head_dim must be >= 1")
        window_size = window
        window = window_size_safe(window_size)
        if len(window) != 2 or any(x < -1 for x in window):
            raise ValueError(f"window_size must be (left, right) with -1 for unbounded, got {window_size}")
        if softcap < 0:
            raise ValueError(f"softcap must be >= 0, got {softcap}")
        if dropout_p:
            raise NotImplementedError(
                f"dropout_p={dropout_p}: attention dropout inside sequence-parallel attention is refused, since "
                "no kernel's dropout mask can be reproduced across Ulysses/ring blocks and the backward; "
                "use dropout_p=0.0 (apply dropout to the attention output instead)")
        if alibi_slopes is not None:
            if alibi_slopes.shape not in ((h,), (b, h)):
                raise ValueError(f"alibi_slopes must be ({h},) or ({b}, {h}), got {tuple(alibi_slopes.shape)}")
        R = mesh.ring_degree
        if R > 1 and self.ring_impl_type == "stripe" and _positional_request(window, alibi_slopes):
            raise NotImplementedError("window_size/alibi_slopes with the stripe layout and ring_degree > 1 cannot be "
                                      "exact (stripes are not contiguous); use ring_impl_type='basic' or 'zigzag'")
        plan = head_plan(h, hkv, mesh.ulysses_degree)
        hq_loc, hk_loc = plan.local_heads(mesh.ulysses_rank)
        device_type = _platform.device_type_of(q.device)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        req = AttnRequest(
            dtype=q.dtype, device_type=device_type, head_dim=d, head_dim_v=v.shape[3],
            num_heads=max(hq_loc, 1), num_kv_heads=max(hk_loc, 1), causal=bool(causal), window=window,
            softcap=float(softcap), alibi=alibi_slopes is not None, dropout_p=0.0, needs_grad=needs_grad,
            needs_lse=R > 1 or bool(return_lse), deterministic=bool(deterministic), key_offset=R > 1,
            compute_capability=_platform.compute_capability(device_type, q.device.index or 0))
        backend = self._backend_for(req)
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        slopes = None
        if alibi_slopes is not None:
            a, bnd = plan.q[mesh.ulysses_rank]
            slopes = alibi_slopes[..., a:bnd].to(device=q.device, dtype=torch.float32)
        return dict(backend=backend, plan=plan, scale=float(scale), window=window, softcap=float(softcap),
                    slopes=slopes, deterministic=bool(deterministic), return_lse=bool(return_lse),
                    batch=b, local_len=s)

    def _backend_for(self, req: AttnRequest):
        key = req
        if key not in self._backends:
            self._backends[key] = REGISTRY.select(self.attn_type, req)()
        return self._backends[key]

    def _metadata(self, err, q, k, v, dropout_p, scale, causal, window, softcap, alibi, deterministic, ret):
        def dim(t, i):
            return int(t.shape[i]) if isinstance(t, torch.Tensor) and t.dim() > i else -1
        needs_grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
        w = tuple(window_size_safe(window))
        return [1 if err is not None else 0, dim(q, 1), dim(q, 0), dim(q, 2), dim(k, 2), dim(q, 3), dim(v, 3),
                _DTYPE_CODES.get(getattr(q, "dtype", None), 0),
                _DEVICE_CODES.get(_platform.device_type_of(q.device) if isinstance(q, torch.Tensor) else "", 0),
                int(bool(causal)), w[0], w[1], int(round(float(softcap) * 1e6)), int(alibi is not None),
                int(round(float(dropout_p) * 1e6)), LAYOUTS.index(self.ring_impl_type), ROTATIONS.index(self.rotation),
                int(needs_grad), int(bool(ret)), int(bool(deterministic)),
                int(round(float(scale) * 1e9)) if scale is not None else -1]

    def _exchange(self, mesh, meta, err):
        """All-gather metadata over the sequence-parallel group; raise on every rank alike."""
        n = mesh.sp_size
        if n == 1 or not self.check_ranks:
            if err is not None:
                raise err
            if n == 1:
                return [meta[1]]
            # without the check, lengths still have to be known: gather just those
            rows = _gather_ints(mesh, [meta[1]])
            return [r[0] for r in rows]
        rows = _gather_ints(mesh, meta)
        bad = [i for i, r in enumerate(rows) if r[0]]
        if bad:
            msgs = _gather_text(mesh, "" if err is None else f"{type(err).__name__}: {err}")
            if err is not None:
                raise err
            raise USPError("attention call refused on other rank(s) of the sequence-parallel group:\n"
                           + "\n".join(f"  rank {mesh.sp_ranks[i]}: {msgs[i]}" for i in bad))
        diffs = []
        for j, field in enumerate(_META_FIELDS):
            if field == "seqlen":
                continue
            vals = [r[j] for r in rows]
            if len(set(vals)) > 1:
                diffs.append(f"{field}: " + ", ".join(f"rank {mesh.sp_ranks[i]}={x}" for i, x in enumerate(vals)))
        if diffs:
            raise USPError("ranks of the sequence-parallel group disagree on this attention call "
                           "(every rank must pass the same shapes and options):\n  " + "\n  ".join(diffs))
        return [r[1] for r in rows]

    # ------------------------------------------------------------------ plan
    def _finish_plan(self, mesh, local, lengths, causal, window, alibi_slopes) -> _Call:
        R, U = mesh.ring_degree, mesh.ulysses_degree
        seqlen = sum(lengths)
        per = [[lengths[mesh.sp_index(r, u)] for u in range(U)] for r in range(R)]
        layout = self.ring_impl_type
        positional = bool(causal) or _positional_request(window, alibi_slopes)
        if positional:
            expect = local_lengths(layout, seqlen, R, U)
            if per != expect:
                raise USPError(f"local sequence lengths {per} (ring x ulysses) do not match the {layout!r} layout "
                               f"for S={seqlen} (expected {expect}); shard inputs with "
                               f"usp_hal.shard(x, layout={layout!r}) (causal/window/alibi depend on positions)")
            segments = tuple(tuple(ring_segments(layout, seqlen, R, r)) for r in range(R))
        else:   # positions do not matter: any split works
            starts = [sum(sum(p) for p in per[:r]) for r in range(R)]
            segments = tuple((Segment(starts[r], sum(per[r])),) for r in range(R))
        plan = local["plan"]
        me_r, me_u = mesh.ring_rank, mesh.ulysses_rank
        q_spec = UlyssesSpec(mesh.ulysses_group, me_u, tuple(tuple(range(a, b)) for a, b in plan.q),
                             tuple(per[me_r]), plan.num_heads)
        kv_spec = UlyssesSpec(mesh.ulysses_group, me_u, plan.kv, tuple(per[me_r]), plan.num_kv_heads)
        ring = RingContext(
            backend=local["backend"], ring_size=R, ring_rank=me_r, group=mesh.ring_group,
            ring_ranks=mesh.ring_ranks, segments=segments, lengths=tuple(sum(p) for p in per),
            softmax_scale=local["scale"], causal=bool(causal), window=local["window"], softcap=local["softcap"],
            alibi_slopes=local["slopes"], deterministic=local["deterministic"], rotation=self.rotation)
        return _Call(local["backend"], q_spec, kv_spec, ring, local["return_lse"])

    def extra_repr(self) -> str:
        return f"attn_type={self.attn_type!r}, ring_impl_type={self.ring_impl_type!r}, rotation={self.rotation!r}"


def window_size_safe(window):
    try:
        w = tuple(int(x) for x in window)
        return w if len(w) == 2 else (-9, -9)
    except Exception:
        return (-9, -9)


def _gather_ints(mesh, values):
    return all_gather_ints(values, mesh.sp_group)


def _gather_text(mesh, text: str) -> list:
    """Every rank's message (an error) as text."""
    return [b.decode("utf-8", "replace") for b in all_gather_bytes(text.encode("utf-8"), mesh.sp_group)]


class UlyssesAttention(LongContextAttention):
    """Ulysses only (ring degree 1): all-to-all over the mesh's Ulysses group."""

    def __init__(self, *args, mesh=None, **kw):
        super().__init__(*args, mesh=mesh, **kw)

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
                alibi_slopes=None, deterministic=False, return_attn_probs=False, *args):
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            raise ValueError(f"qkv must be [batch, seq, 3, heads, head_dim], got {tuple(qkv.shape)}")
        q, k, v = qkv.unbind(2)
        return super().forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_attn_probs)
