"""Step 1 of a call: check this rank's tensors and options and freeze them into a
:class:`~usp_hal.pipeline.spec.CallSpec` plus a typed :class:`Local` record (what only this rank
needs: the backend, the head plan, the alibi slopes).  Nothing is communicated here; an
error is raised to the caller, which keeps it for the agreement step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from ..dispatch.capabilities import AttnRequest, KernelCall
from ..parallel.heads import HeadPlan, head_plan
from ..sequence.positions import as_cu_seqlens
from .options import CallOptions
from .spec import CallSpec, digest_ints

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


class USPError(ValueError):
    """A call that cannot run as asked (raised identically on every rank)."""


def share(total: int, parts: int, i: int) -> Tuple[int, int]:
    """(start, count) of part ``i`` when ``total`` items are split like torch.tensor_split."""
    base, extra = divmod(total, parts)
    return i * base + min(i, extra), base + (1 if i < extra else 0)


@dataclass
class JointInfo:
    """Joint (MMDiT) tokens of one call once they are part of the rows: this rank's share
    ``start .. start+count`` of the ``total`` joint tokens."""

    strategy: str
    total: int
    start: int
    count: int


@dataclass
class Joint(JointInfo):
    """Joint tokens with their tensors: this rank's share joins its main tokens."""

    q: Optional[torch.Tensor] = None
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None

    def extend(self, q, k, v):
        """This rank's rows: its joint share and its main tokens, joint first for "front"."""
        assert self.q is not None and self.k is not None and self.v is not None
        jk = self.k.narrow(1, self.start, self.count)
        jv = self.v.narrow(1, self.start, self.count)
        if self.strategy == "front":
            return torch.cat([self.q, q], 1), torch.cat([jk, k], 1), torch.cat([jv, v], 1)
        return torch.cat([q, self.q], 1), torch.cat([k, jk], 1), torch.cat([v, jv], 1)


def joint_info(mesh, strategy: str, total: int) -> Optional[JointInfo]:
    if strategy in (None, "none"):
        return None
    start, count = share(total, mesh.sp_size, mesh.sp_rank)
    return JointInfo(strategy, total, start, count)


def check_joint(mesh, q, jq, jk, jv, strategy) -> Optional[Joint]:
    """The joint tokens of a call (None without), checked against this rank's share."""
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
    start, count = share(J, mesh.sp_size, mesh.sp_rank)
    if jq.shape[1] != count:
        raise ValueError(f"joint_tensor_query has {jq.shape[1]} tokens on sequence-parallel rank {mesh.sp_rank}, "
                         f"but the {J} joint tokens split over {mesh.sp_size} ranks in rank order give it {count} "
                         f"(tokens {start}..{start + count - 1}): pass joint queries split like torch.tensor_split")
    return Joint(strategy, J, start, count, jq, jk, jv)


@dataclass
class Local:
    """What this rank alone needs to plan and run a call (beside the shared spec): its
    backend, its head plan, the call's :class:`KernelCall` (the one value the plan gives the
    ring), the dispatch request, document boundaries and mask."""

    backend: Any
    heads: HeadPlan
    call: KernelCall
    device: torch.device
    request: AttnRequest
    cu_seqlens: Optional[Tuple[int, ...]]
    mask: Any = None          # the call's usp_hal.sequence.masks.Mask, if any


def mask_seqlen(pipe, cu) -> int:
    """The global length a masked call's mask is digested at before the ranks agree: the
    documents' total, else the length of the module's last masked call (the same on every
    rank; 0 before the first: the mask is then digested once the lengths are agreed)."""
    return int(cu[-1]) if cu is not None else int(getattr(pipe, "mask_seqlen", 0))


def mask_digest(pipe, mask, causal: bool, win, cu, batch: int) -> int:
    """What a masked call puts in its spec: the digest of what the mask keeps (its tile
    classification and the bits of its partial tiles, :meth:`usp_hal.sequence.masks.Predicate.digest`)
    at :func:`mask_seqlen`; evaluating the mask here means a mask that fails on this rank
    is a refusal every rank sees in the agreement.  :data:`MASK_UNCHECKED` when no length is
    known yet, or when the mask cannot be evaluated at that length: a mask built for this
    batch's length (a padding mask indexing a ``[B, S]`` tensor) may not reach the last
    call's when the batch is shorter.  The mask is then digested at the agreed length
    (:func:`usp_hal.pipeline.maskcheck.agree_mask`), where a failure is a refusal every rank
    sees."""
    from ..sequence.masks import Predicate
    S = mask_seqlen(pipe, cu)
    if S <= 0:
        return MASK_UNCHECKED
    try:
        return Predicate(mask, causal=causal, window=(int(win[0]), int(win[1])), cu_seqlens=cu,
                         batch=batch).digest(S)
    except Exception:       # e.g. an index past a shorter batch's mask data: checked at the agreed length
        return MASK_UNCHECKED


#: the spec's mask digest when the mask was not digested before the agreement
MASK_UNCHECKED = 1


def validate(pipe, mesh, q, k, v, opts: CallOptions, alibi_slopes=None, positions=None,
             joint: Optional[JointInfo] = None, needs_grad=None, cu_seqlens=None) -> Tuple[CallSpec, Local]:
    """This rank's call, checked: the spec every rank must agree on, and its local record.
    ``pipe`` is the :class:`~usp_hal.pipeline.Pipeline` (layout, rotation, wire, backend cache)."""
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
    R, U = mesh.ring_degree, mesh.ulysses_degree
    if needs_grad is None:
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    # the call's one kernel value (its options checked); the plan hands it to the ring
    call = opts.kernel_call(head_dim=d, heads=h, batch=b, alibi_slopes=alibi_slopes, needs_grad=bool(needs_grad),
                            needs_lse=R > 1 or bool(opts.return_lse) or bool(opts.sinks))
    causal, positional = call.causal, call.positional
    if opts.dropout_p:
        raise NotImplementedError(
            f"dropout_p={opts.dropout_p}: attention dropout inside sequence-parallel attention is refused, since "
            "no kernel's dropout mask can be reproduced across Ulysses/ring blocks and the backward; "
            "use dropout_p=0.0 (apply dropout to the attention output instead)")
    alibi = pipe.digest(alibi_slopes) if alibi_slopes is not None else 0
    layout = pipe.layout
    if joint is not None and R > 1 and not layout.contiguous and (positional or causal):
        raise NotImplementedError(f"joint tokens with causal/window/alibi and the {layout.name} layout on "
                                  "a ring are not supported (its shards are not contiguous); use "
                                  "ring_impl_type='basic' or 'zigzag', or causal=False")
    if R > 1 and not layout.contiguous and positional:
        raise NotImplementedError(f"window_size/alibi_slopes with the {layout.name} layout and ring_degree > 1 "
                                  "cannot be exact (its shards are not contiguous); use ring_impl_type='basic' or "
                                  "'zigzag'")
    mask = opts.mask
    if mask is not None:
        from ..sequence.masks import Mask
        if not isinstance(mask, Mask):
            raise TypeError(f"mask must be a usp_hal.sequence.masks.Mask, got {type(mask).__name__}")
        if R > 1 and not layout.contiguous:
            raise NotImplementedError(f"mask= with the {layout.name} layout and ring_degree > 1 is not supported "
                                      "(its shards are not contiguous); use ring_impl_type='basic', 'zigzag' or "
                                      "usp_hal.sequence.masks.balanced_layout(...)")
        if mask.batch is not None and mask.batch != b:
            raise ValueError(f"the mask was built for batch={mask.batch}, the call has batch {b}")
        if mask.heads is not None and mask.heads != h:
            raise ValueError(f"the mask was built for heads={mask.heads}, the call has {h} query heads")
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
    # what the kernels of this rank will see: its heads after the Ulysses split, key offsets on ring blocks
    req = AttnRequest.of(q, k, v, call, lengths=False, num_heads=max(hq_loc, 1), num_kv_heads=max(hk_loc, 1),
                         key_offset=R > 1 or joint is not None, varlen=cu is not None, mask=mask is not None)
    spec = CallSpec.of(call, batch=b, local_len=s, heads=h, kv_heads=hkv, head_dim=d, v_dim=int(v.shape[3]),
                       dtype=q.dtype, device_type=req.device_type, alibi=alibi, return_lse=bool(opts.return_lse),
                       layout=layout.name, rotation=pipe.rotation, ulysses=U, ring=R, wire=pipe.wire_name,
                       positions=pos_digest, joint="" if joint is None else f"{joint.strategy}:{joint.total}",
                       docs=docs, mask=mask_digest(pipe, mask, causal, call.window, cu, b) if mask is not None else 0,
                       sinks=int(opts.sinks))
    return spec, Local(pipe.backend_for(req), plan, call, q.device, req, cu, mask)


def is_live(mesh) -> bool:
    """The mesh's process groups are registered (not destroyed by ``destroy_process_group``)."""
    group = getattr(mesh, "sp_group", None)
    if group is None:
        return True
    world = getattr(dist.distributed_c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    return pg_map is None or group in pg_map


def check_live(mesh) -> None:
    if not is_live(mesh):
        raise USPError(f"usp_hal: the sequence-parallel mesh of this call ({mesh.ulysses_degree} x "
                       f"{mesh.ring_degree}, ranks {list(mesh.sp_ranks)}) is on process groups that were destroyed "
                       "(torch.distributed.destroy_process_group); build a new mesh with "
                       "usp_hal.init_sequence_parallel(...) after init_process_group and pass it to the module "
                       "(module.mesh = mesh, or a new module), or use the default mesh (mesh=None)")
