"""Step 3 of a call: the plan every rank runs with, built once per shape and shared by
forward and backward: the head plan split into stages, each stage's Ulysses exchange,
the ring's rotation and the block plan of every ring step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..parallel.codec import get_codec
from ..parallel.heads import HeadPlan
from ..parallel.ring import RingContext
from ..parallel.rotation import Rotation
from ..parallel.ulysses import UlyssesExchange
from ..sequence.blocks import plan_ring
from ..sequence.positions import Segment, local_positions, ring_segments, segments_from_positions
from .agree import joint_total
from .entry import Checked
from .spec import CallSpec
from .validate import Local, USPError, share


@dataclass(frozen=True)
class Shape:
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
    predicate: Optional[object] = None             # a mask= call: what it keeps (usp_hal.sequence.masks.Predicate)


@dataclass
class Stage:
    """One group of heads: its all-to-alls and its ring."""

    exchange: UlyssesExchange
    ring: RingContext
    heads: Tuple[int, int] = (0, 0)        # this rank's global query heads in the stage (sinks, masks)


@dataclass
class CallPlan:
    """Everything one call runs with (built once per shape, shared by forward and backward).
    ``stages`` holds one stage, or several head groups whose all-to-alls are pipelined with
    the kernels of their neighbours (:class:`~usp_hal.AsyncLongContextAttention`)."""

    spec: CallSpec
    backend: Any
    stages: List[Stage]
    dtype: torch.dtype
    spec_lengths: Tuple[int, ...] = ()     # every rank's local length (sequence-parallel order)
    nan_guard: bool = True                 # the backend may hide a non-finite query: add the guard
    #: head groups run one at a time (nothing in flight across groups) and the backward
    #: re-exchanges each group's q/k/v/out from the sequence layout (``low_memory``)
    sequential: bool = False

    @property
    def exchange(self) -> UlyssesExchange:
        return self.stages[0].exchange

    @property
    def ring(self) -> RingContext:
        return self.stages[0].ring


def shape_of(pipe, mesh, spec: CallSpec, lengths, heads: HeadPlan, cu=None, mask=None, backend=None) -> Shape:
    key = (id(mesh), spec.heads, spec.kv_heads, spec.causal, spec.window, spec.alibi != 0, spec.joint,
           tuple(lengths), spec.docs, (id(mask), mask.state()) if mask is not None else 0,
           spec.batch if mask is not None else 0,
           bool(getattr(backend, "RETURNS_LSE", True)) if mask is not None else True)
    shape = pipe.shapes.get(key)
    if shape is not None and (cu is None or shape.cu == cu) and (mask is None or shape.predicate.mask is mask):
        return shape
    R, U = mesh.ring_degree, mesh.ulysses_degree
    seqlen = sum(lengths)
    per = tuple(tuple(lengths[mesh.sp_index(r, u)] for u in range(U)) for r in range(R))
    sorted_ = True
    if (spec.causal or spec.positional or mask is not None) and spec.joint:
        segments, sorted_ = joint_segments(pipe, mesh, spec, lengths)
    elif spec.causal or spec.positional or cu is not None or mask is not None:
        segments = tuple(tuple(ring_segments(pipe.layout, seqlen, R, r, cu_seqlens=cu)) for r in range(R))
    else:   # positions do not matter: any split works
        starts = [sum(sum(p) for p in per[:r]) for r in range(R)]
        segments = tuple((Segment(starts[r], sum(per[r])),) for r in range(R))
    me = mesh.ring_rank
    if mask is not None:
        shape = masked_shape(mesh, spec, heads, per, segments, seqlen, cu, mask, backend)
    else:
        ring = plan_ring(segments, causal=spec.causal, window=spec.window, positional=spec.positional,
                         cu_seqlens=cu, sorted_positions=sorted_)
        calls = {src: list(ring.calls_of(me, src)) for src in range(R)}
        shape = Shape(heads, per, segments, tuple(sum(p) for p in per), calls, ring.blocks,
                      local_only=ring.local_only, cu=cu)
    return pipe.shapes.put(key, shape)


def masked_shape(mesh, spec: CallSpec, heads, per, segments, seqlen: int, cu, mask, backend) -> Shape:
    """The shape of a ``mask=`` call: every ring rank's calls against every block from the
    mask's tile classification (the same on every rank, so every rank checks every rank's
    blocks); a ring whose off-diagonal blocks are all empty exchanges no K/V."""
    from ..sequence.masks import Predicate, masked_ring
    R, me = mesh.ring_degree, mesh.ring_rank
    pred = Predicate(mask, causal=spec.causal, window=(int(spec.window[0]), int(spec.window[1])), cu_seqlens=cu,
                     batch=spec.batch)
    every, local_only = masked_ring(pred, segments, seqlen, split_runs=bool(getattr(backend, "RETURNS_LSE", True)))
    blocks = frozenset((c.q_stop - c.q_start, c.k_stop - c.k_start, False) for per_a in every for cs in per_a
                       for c in cs)
    return Shape(heads, per, segments, tuple(sum(p) for p in per), {src: every[me][src] for src in range(R)},
                 blocks, local_only=local_only, cu=cu, predicate=pred)


def joint_segments(pipe, mesh, spec: CallSpec, lengths):
    """Per ring rank, the global positions its rows hold (joint and main tokens, in local
    order) as segments, and whether every rank's positions are increasing."""
    R, U = mesh.ring_degree, mesh.ulysses_degree
    total = joint_total(spec)
    front = spec.joint.startswith("front")
    main = [n - share(total, mesh.sp_size, i)[1] for i, n in enumerate(lengths)]
    S = sum(main)
    segs, ordered = [], True
    for r in range(R):
        rows = []
        for u in range(U):
            i = mesh.sp_index(r, u)
            js, jn = share(total, mesh.sp_size, i)
            mpos = local_positions(pipe.layout.name, S, R, U, r, u)
            jpos = torch.arange(js, js + jn)
            rows += ([jpos, mpos + total] if front else [mpos, jpos + S])
        pos = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        ordered = ordered and bool((pos[1:] > pos[:-1]).all())
        segs.append(tuple(segments_from_positions(pos)))
    return tuple(segs), ordered


def check_blocks(pipe, shape: Shape, local: Local) -> None:
    """Every kernel call of every rank's plan must be one the backend accepts (its rules on
    Sq/Sk, e.g. bottom-right windows): checked before any data moves, on every rank
    alike, since every rank plans every rank's blocks."""
    req, backend = local.request, local.backend
    key = (id(shape), type(backend).__name__)
    if key in pipe.checked_blocks:
        return
    reasons: list = []
    for sq, sk, causal in sorted(shape.blocks):   # square blocks too: a kernel may have rules on Sk alone
        why = type(backend).not_supported_reasons(req.with_(seqlen_q=sq, seqlen_k=sk, causal=causal))
        what = "a ring block" if shape.ring_lengths[1:] else "a block"
        reasons += [f"{what} of {sq} queries x {sk} keys: {w}" for w in why if w not in reasons]
    if reasons:
        raise USPError(f"attn_type={backend.NAME!r} cannot run every block this call needs:\n  - "
                       + "\n  - ".join(dict.fromkeys(reasons)) + "\nuse attn_type='sdpa' or another layout")
    pipe.checked_blocks.add(key)


def build(pipe, mesh, checked: Checked, lengths, head_groups=None) -> CallPlan:
    """The call's plan for ``checked`` (a call this rank can run) at the agreed ``lengths``:
    one stage per head group (``head_groups``: HeadPlan -> its groups; the pipeline's own
    split by default)."""
    spec, local = checked.spec, checked.local
    assert spec is not None and local is not None
    heads = local.heads
    shape = shape_of(pipe, mesh, spec, lengths, heads, local.cu_seqlens, local.mask, local.backend)
    check_blocks(pipe, shape, local)
    me_r, me_u = mesh.ring_rank, mesh.ulysses_rank
    codecs = {n: get_codec(c) for n, c in pipe.wire.items()}
    ring_codecs = (get_codec(pipe.ring_wire[0]), get_codec(pipe.ring_wire[1]))
    stages = []
    for group in (head_groups or pipe.head_groups)(heads):
        exchange = UlyssesExchange(group, mesh.ulysses_group, me_u, shape.per_rank[me_r],
                                   where=mesh.where("ulysses"), codecs=codecs)
        # packed documents that no two ring ranks share: every rank only needs its own keys
        rotation_cls = Rotation if shape.local_only else pipe.rotation_cls
        rotation = rotation_cls(mesh.ring_group, mesh.ring_ranks, me_r, shape.ring_lengths,
                                where=mesh.where("ring"), codecs=ring_codecs)
        # the call's one value, with this stage's alibi slopes; the ring derives each block's from it
        call = local.call
        qa, qc = group.q[me_u]
        if call.alibi_slopes is not None:
            call = call.with_(alibi_slopes=call.alibi_slopes[..., qa:qc].to(device=local.device, dtype=torch.float32))
        ring = RingContext(local.backend, mesh.ring_degree, me_r, shape.segments, shape.ring_lengths, call, rotation,
                           shape.calls, shape.packed, cu_seqlens=shape.cu, predicate=shape.predicate,
                           mask_heads=(qa, qc), device=local.device)
        stages.append(Stage(exchange, ring, (qa, qc)))
    # a kernel declared to carry a non-finite query into its row (PROPAGATES_NAN: device types) needs no guard
    guard = spec.device_type not in type(local.backend).PROPAGATES_NAN
    return CallPlan(spec, local.backend, stages, spec.dtype, tuple(lengths), nan_guard=guard,
                    sequential=bool(getattr(pipe, "sequential", False)) and len(stages) > 1)
