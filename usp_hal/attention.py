"""LongContextAttention (USP = Ulysses x Ring), and its one-dimensional special cases: thin
faces over the call pipeline (:mod:`usp_hal.pipeline`).

A module checks its constructor arguments (yunchang's keywords included) into a
:class:`~usp_hal.pipeline.Pipeline` and hands every call to it: validate, agree across the
ranks (one small all-gather), plan, run.  Under ``torch.compile`` the call is one custom
op (:mod:`usp_hal.pipeline.compiled`) over the same pipeline.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

import torch

from .bounded import BoundedCache
from .dispatch.registry import REGISTRY
from .parallel.codec import get_codec
from .parallel.heads import HeadPlan, most_groups, split_plan
from .parallel.mesh import SequenceParallelMesh, mesh_of_group
from .parallel.ring import merge_dtype
from .parallel.rotation import get_rotation
from .pipeline import CallOptions, CallPlan, Pipeline, USPError
from .pipeline.compiled import compiled_forward
from .pipeline.options import Sinks, check_mode
from .pipeline.validate import check_joint
from .sequence.positions import get_layout


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

    ``check_ranks``: ``"every_call"`` (the default) exchanges a small metadata vector on
    every call (on the CPU side group), so that a cross-rank mismatch ends in the same error
    on every rank.  ``"first_call"`` (or ``static_shapes=True``): after the first checked
    call, a call with the same spec runs no host-side collective at all (CUDA-graph
    friendly); a call that differs (or that this rank refuses) raises
    :class:`~usp_hal.parallel.comm.OutOfStepError` on the rank that sees it and ends the use of the
    mesh's groups there (every later call on them raises it before communicating; a rank
    that went on fails at the group timeout).  ``"off"``: every call exchanges only the
    local lengths (and any rank's refusal) and compares no option: a rank-different call
    is wrong, hangs or aborts (docs/architecture.md).  True and False are
    aliases of ``"every_call"`` and ``"off"``.

    ``ulysses_float8=True``: q, v and the output travel through the Ulysses all-to-all as
    float8_e4m3fn with a scale per token and head (``float8_key=True``: k too; the default
    keeps k exact because softmax(q.k) is the sensitive part); ``ring_float8=True``: the
    ring's V blocks (and K with ``float8_key``) travel as fp8.  Lossy, see docs.  With
    gradients, the backward communicates at full precision and the gradient is the
    straight-through gradient of the quantised forward.  ``wire_codecs`` picks any
    registered codec (``usp_hal.parallel.codec.register_codec``) per tensor: keys ``q``, ``k``, ``v``,
    ``out`` (Ulysses) and ``ring_k``, ``ring_v`` (ring blocks), values codec names.

    ``low_memory``: trade time for a smaller per-rank peak.  The heads are split into
    groups (``True``: as many as the heads allow, one KV group per rank and group; an int:
    that many) that run one after another, each group's exchange buffers, K/V blocks and
    accumulators gone before the next starts; the forward keeps only sequence-layout
    tensors (its inputs, its output and the lse), and the backward moves each group's
    q/k/v/out/dout to the head layout again.  Same results; more collectives and kernel
    calls (one set per group), and with Ulysses the backward moves q/k/v/out again.  See
    docs/performance.md for what it saves and costs.

    Note on layouts: lengths alone cannot tell a zigzag shard from a basic one of the same
    size.  Shard inputs with ``usp_hal.shard(x, layout=ring_impl_type)``; to have every call
    verify it, pass ``positions=mesh.local_positions(S, layout)`` (a debugging aid).

    Packed sequences: ``forward(..., cu_seqlens=[0, l1, l1+l2, ..., S])`` (the global
    document boundaries, an integer tensor or list, the same on every rank) keeps attention
    inside each document, causal or not, with window/softcap/alibi/GQA applied per document.
    Shard with ``usp_hal.shard(x, layout=ring_impl_type, cu_seqlens=cu_seqlens)``;
    ``ring_impl_type="varlen_zigzag"`` balances causal work per document.  The boundaries
    are part of the cross-rank check (a digest), so with ``static_shapes=True`` a call with
    other boundaries than the first counts as a different call.  See docs/varlen.md.
    """

    def __init__(self, scatter_idx: int = 2, gather_idx: int = 1, ring_impl_type: str = "basic",
                 use_pack_qkv: bool = False, use_sync: bool = False, attn_type="auto",
                 attn_processor=None, *, mesh: Optional[SequenceParallelMesh] = None,
                 rotation: str = "p2p", check_ranks: Union[str, bool] = "every_call", static_shapes: bool = False,
                 ulysses_float8: bool = False, float8_key: bool = False, ring_float8: bool = False,
                 q_descale=None, k_descale=None, v_descale=None, wire_codecs: Optional[Dict[str, str]] = None,
                 low_memory: Union[bool, int] = False):
        super().__init__()
        self.low_memory = low_memory_groups(low_memory)
        if (scatter_idx, gather_idx) != (2, 1):
            raise NotImplementedError(
                f"scatter_idx={scatter_idx!r}, gather_idx={gather_idx!r}: only scatter_idx=2, gather_idx=1 (yunchang's "
                "default: q/k/v [B, S_local, H, D], heads scattered, sequence gathered) is supported"
                + ("; UlyssesAttention takes its process group first, LongContextAttention takes none (build the "
                   "mesh with set_seq_parallel_pg or init_sequence_parallel, or pass mesh=)"
                   if not isinstance(scatter_idx, int) else ""))
        if attn_processor is not None:           # yunchang's user kernel (usp_hal.dispatch.processor)
            from .dispatch.processor import processor_attn_type
            attn_type = processor_attn_type(attn_processor, attn_type)
        self.attn_processor = attn_processor
        if any(x is not None for x in (q_descale, k_descale, v_descale)):
            raise NotImplementedError("fp8 descale factors are not supported by the USP path "
                                      "(use ulysses_float8=True for an fp8 wire format)")
        layout = get_layout(ring_impl_type)
        rotation_cls = get_rotation(rotation)
        REGISTRY.canonical_name(attn_type)          # unknown names fail here, not mid-run
        fp8 = "fp8" if ulysses_float8 else "identity"
        wire = {"q": fp8, "k": "fp8" if (ulysses_float8 and float8_key) else "identity", "v": fp8, "out": fp8}
        ring_wire = {"ring_k": "fp8" if (ring_float8 and float8_key) else "identity",
                     "ring_v": "fp8" if ring_float8 else "identity"}
        for name, codec in (wire_codecs or {}).items():
            if name not in wire and name not in ring_wire:
                raise ValueError(f"wire_codecs key {name!r}; valid: {', '.join([*wire, *ring_wire])}")
            codec_name = get_codec(codec).name            # unknown codec names fail here, not mid-run
            (wire if name in wire else ring_wire)[name] = codec_name
        self._pipe = Pipeline(layout=layout, rotation_cls=rotation_cls, attn_type=attn_type, wire=wire,
                              ring_wire=(ring_wire["ring_k"], ring_wire["ring_v"]), check_ranks=check_ranks,
                              static_shapes=static_shapes, mesh=mesh, head_groups=self._head_groups,
                              sequential=self.low_memory != 0)
        self.layout = layout
        self.ring_impl_type = layout.name
        self.rotation_cls = rotation_cls
        self.rotation: str = rotation_cls.name
        self.attn_type = attn_type
        self.use_pack_qkv = use_pack_qkv              # accepted for compatibility; q/k/v always travel packed
        self.use_sync = use_sync
        self.wire = self._pipe.wire
        self.ring_wire = self._pipe.ring_wire
        self._wire_name = self._pipe.wire_name
        self._options: BoundedCache[Any, CallOptions] = BoundedCache(64)

    # the pipeline's settings, readable and settable on the module ----------------------
    @property
    def mesh(self) -> Optional[SequenceParallelMesh]:
        return self._pipe.mesh

    @mesh.setter
    def mesh(self, value) -> None:
        self._pipe.mesh = value

    @property
    def check_ranks(self) -> str:
        """``"every_call"``, ``"first_call"`` or ``"off"`` (set on every rank alike; True and
        False are taken as ``"every_call"`` and ``"off"``)."""
        return self._pipe.check_ranks

    @check_ranks.setter
    def check_ranks(self, value: Union[str, bool]) -> None:
        self._pipe.check_ranks = check_mode(value)
        self._pipe.frozen = None

    @property
    def static_shapes(self) -> bool:
        """``check_ranks == "first_call"`` (setting True selects it, False ``"every_call"``)."""
        return self._pipe.check_ranks == "first_call"

    @static_shapes.setter
    def static_shapes(self, value: bool) -> None:
        if bool(value) != self.static_shapes:
            self._pipe.check_ranks = "first_call" if value else "every_call"
            self._pipe.frozen = None

    @property
    def last_backend(self) -> Any:
        """The backend instance of the last call (None before the first)."""
        return self._pipe.last_backend

    @property
    def pipeline(self) -> Pipeline:
        return self._pipe

    # ------------------------------------------------------------------ public call
    def forward(self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                return_attn_probs=False, *args, return_lse: bool = False, positions: Optional[torch.Tensor] = None,
                joint_tensor_query: Optional[torch.Tensor] = None, joint_tensor_key: Optional[torch.Tensor] = None,
                joint_tensor_value: Optional[torch.Tensor] = None, joint_strategy: str = "none", cu_seqlens=None,
                mask=None, sinks: Optional[torch.Tensor] = None):
        """Attention over this rank's part of the sequence (see the class doc).

        Returns the output ``[B, S_local, H, D]``; with ``return_lse=True``, ``(out, lse)``
        (lse ``[B, H, S_local]``, float32).  The lse carries no gradient: a backward that reaches
        it raises rather than dropping it, in eager mode and under torch.compile (there on every
        rank, after one host read of the lse's gradient); for attention sinks pass ``sinks=``.
        ``return_attn_probs`` is accepted for yunchang's signature and, as there, changes nothing:
        yunchang 0.6.4's ``LongContextAttention``,
        ``LongContextAttentionQKVPacked`` and ``UlyssesAttention`` return the output tensor
        alone whatever it is (yunchang/hybrid/attn_layer.py, yunchang/ulysses/attn_layer.py).

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

        ``mask``: which keys each query sees, over global positions (and'ed with ``causal``,
        ``window_size`` and ``cu_seqlens``): a :class:`usp_hal.sequence.masks.Mask`, a FlexAttention-style
        ``mask_mod(b, h, q_idx, kv_idx)``, or Magi-style slices ``[((q0, q1), (k0, k1), kind)]``
        (see :mod:`usp_hal.sequence.masks`).  Empty blocks are skipped, full ones run without a mask.
        A row that sees no key has output 0 and lse -inf (gradient 0).  ``sinks`` ``[H]``:
        per-head sink logits (gpt-oss ``s_aux``): each adds ``exp(sink)`` to its head's softmax
        denominator, once per row; the returned lse includes it; its gradient on each rank is
        that rank's part (sum it over the sequence-parallel group, as ``sync_gradients`` does).
        """
        cast = _autocast_dtype(query)
        if cast is not None:    # as torch's SDPA under autocast: q, k, v in its dtype, gradients in theirs
            with torch.autocast(query.device.type, enabled=False):
                return self.forward(*_to(cast, query, key, value), dropout_p, softmax_scale, causal, window_size,
                                    softcap, alibi_slopes, deterministic, return_attn_probs, *args,
                                    positions=positions, joint_tensor_query=_to(cast, joint_tensor_query)[0],
                                    joint_tensor_key=_to(cast, joint_tensor_key)[0],
                                    joint_tensor_value=_to(cast, joint_tensor_value)[0], joint_strategy=joint_strategy,
                                    cu_seqlens=cu_seqlens, mask=mask, sinks=sinks)
        pipe = self._pipe
        # anything that fails while this rank prepares its call (options, the mask, argument
        # types) is a refusal carried into the agreement, so every rank raises it together
        err: Optional[Exception] = None
        try:
            # the same keywords give the same options: one dict lookup per call, keyed by every
            # keyword passed here (CallOptions.cached)
            opts = CallOptions.cached(None if torch.compiler.is_compiling() else self._options, dropout_p=dropout_p,
                                      softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                      softcap=softcap, deterministic=deterministic, return_lse=return_lse)
            if mask is not None or sinks is not None:
                if torch.compiler.is_compiling():
                    from .sequence.masks import Mask
                    if mask is not None and not isinstance(mask, Mask):
                        raise TypeError("under torch.compile pass mask= as a usp_hal.sequence.masks.Mask built "
                                        "outside the compiled function (Mask.from_mod / from_slices), not a bare "
                                        "mask_mod or list")
                    opts = opts.with_(mask=mask, sinks=Sinks.given(sinks is not None))
                else:
                    opts = self._with_mask(opts, mask, Sinks.given(sinks is not None))
        except Exception as exc:
            if torch.compiler.is_compiling():
                raise
            err, opts = exc, CallOptions()
        mesh = pipe.resolve_mesh()
        joint = None
        if err is None and (joint_tensor_query is not None or joint_tensor_key is not None
                            or joint_tensor_value is not None or joint_strategy not in (None, "none")):
            try:
                joint = check_joint(mesh, query, joint_tensor_query, joint_tensor_key, joint_tensor_value,
                                    joint_strategy)
                if joint is not None and cu_seqlens is not None:
                    raise NotImplementedError("cu_seqlens together with joint tokens is not supported; pack the "
                                              "joint tokens into the documents (cu_seqlens) or drop cu_seqlens")
            except Exception as exc:
                if torch.compiler.is_compiling():
                    raise
                err = exc
        if torch.compiler.is_compiling():
            if cu_seqlens is not None:
                raise NotImplementedError("cu_seqlens under torch.compile: packed documents run eagerly only; wrap "
                                          "the attention call in torch.compiler.disable or compile without them")
            out, lse = compiled_forward(pipe, query, key, value, opts, alibi_slopes, positions, joint, sinks)
            return (out, lse) if return_lse else out
        if joint is not None:
            query, key, value = joint.extend(query, key, value)
        out, lse = _eager(pipe, mesh, query, key, value, opts, alibi_slopes=alibi_slopes, positions=positions,
                          joint=joint, err=err, cu_seqlens=cu_seqlens, sinks=sinks)
        return (out, lse) if return_lse else out

    def _with_mask(self, opts: CallOptions, mask, sinks: int) -> CallOptions:
        """``opts`` with the call's mask and sinks flag, cached per (options, mask object, sinks):
        a bare mask_mod or slice list becomes one :class:`~usp_hal.sequence.masks.Mask` per object, so
        its tile classification is computed once."""
        cache = self.__dict__.setdefault("_mask_options", BoundedCache(16))
        key = (opts, id(mask), sinks)
        got = cache.get(key)
        if got is None or got[0] is not mask:      # the object itself: an id may be reused
            from .sequence.masks import Mask
            got = cache.put(key, (mask, opts.with_(mask=Mask.of(mask) if mask is not None else None, sinks=sinks)))
        return got[1]

    def _head_groups(self, heads: HeadPlan) -> List[HeadPlan]:
        if self.low_memory:
            return split_plan(heads, most_groups(heads) if self.low_memory < 0 else self.low_memory)
        return [heads]

    def extra_repr(self) -> str:
        return f"attn_type={self.attn_type!r}, ring_impl_type={self.ring_impl_type!r}, rotation={self.rotation!r}"


def _autocast_dtype(query) -> Optional[torch.dtype]:
    """The dtype torch.autocast gives attention inputs on ``query``'s device (None: autocast off)."""
    if not isinstance(query, torch.Tensor) or not query.is_floating_point() or \
            not torch.is_autocast_enabled(query.device.type):
        return None
    return torch.get_autocast_dtype(query.device.type)


def _to(dtype: torch.dtype, *ts):
    """Floating tensors cast to ``dtype`` (autograd carries each gradient back in its own dtype)."""
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in ts)


def _eager(pipe, *args, **kwargs):
    """The eager pipeline call (a compiled caller reaches it through a graph break)."""
    return pipe(*args, **kwargs)


if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
    # Dynamo before torch 2.13 traces on into the pipeline after that graph break and fails
    # inside it with an internal error (seen with torch 2.9.1 and 2.11.0: the ring's bytearray
    # row bookkeeping); there the eager call is kept out of tracing.  From 2.13 it is called as is.
    _eager = torch.compiler.disable(_eager)


def low_memory_groups(value) -> int:
    """``low_memory`` as a group count: 0 off, -1 as many groups as the heads allow, n >= 2."""
    if value is True:
        return -1
    if value is False or value is None:
        return 0
    if isinstance(value, int) and value >= 0:
        return 0 if value <= 1 else value
    raise ValueError(f"low_memory must be True, False or a number of head groups (0 or 1: off), got {value!r}")


class AsyncLongContextAttention(LongContextAttention):
    """:class:`LongContextAttention` with the Ulysses all-to-alls pipelined against the
    kernels (same constructor and forward arguments, plus ``head_chunks``).

    Each rank's heads are split into ``head_chunks`` groups (whole KV groups where GQA
    runs locally).  The all-to-all of group i+1 is in flight while the ring runs group i,
    and group i's output travels back while group i+1 computes; the backward pipelines
    the output-gradient and dq/dk/dv exchanges the same way.  Results equal the
    synchronous path's.  With one Ulysses rank there is nothing to overlap."""

    def __init__(self, scatter_idx: int = 2, gather_idx: int = 1, ring_impl_type: str = "basic", *args,
                 head_chunks: int = 2, **kw):
        if not isinstance(head_chunks, int) or head_chunks < 1:
            raise ValueError(f"head_chunks must be a positive integer, got {head_chunks!r}")
        if kw.get("low_memory"):
            raise ValueError("AsyncLongContextAttention keeps head groups in flight together to overlap them; "
                             "low_memory runs them one after another: use LongContextAttention(low_memory=...) "
                             "for the smaller peak, or this class without low_memory for the overlap")
        self.head_chunks = head_chunks
        super().__init__(scatter_idx, gather_idx, ring_impl_type, *args, **kw)

    def _head_groups(self, heads: HeadPlan) -> List[HeadPlan]:
        if heads.size == 1 or self.head_chunks == 1:
            return [heads]
        return split_plan(heads, self.head_chunks)


class UlyssesAttention(LongContextAttention):
    """Ulysses only (ring degree 1): all-to-all over ``sequence_process_group``.

    yunchang's signature (yunchang/ulysses/attn_layer.py, 0.6.4): the group first, then
    ``scatter_idx``, ``gather_idx``, ``use_sync``, ``attn_type``, positional or keyword.  The
    module works from the group it is given (None: the default process group), with no mesh
    set up first; ``mesh=`` (a mesh with ring degree 1) instead of a group is usp-hal's own
    way, and the other keywords of :class:`LongContextAttention` are accepted by keyword."""

    def __init__(self, sequence_process_group=None, scatter_idx: int = 2, gather_idx: int = 1,
                 use_sync: bool = False, attn_type="auto", *, mesh: Optional[SequenceParallelMesh] = None, **kw):
        if mesh is not None and sequence_process_group is not None:
            raise ValueError("UlyssesAttention: pass sequence_process_group or mesh=, not both")
        if isinstance(sequence_process_group, int):
            raise TypeError(f"UlyssesAttention's first argument is the sequence_process_group (yunchang's "
                            f"signature), got the int {sequence_process_group}; pass scatter_idx= by keyword")
        if mesh is None and (sequence_process_group is not None or dist_ready()):
            mesh = mesh_of_group(sequence_process_group, "ulysses")
        super().__init__(scatter_idx, gather_idx, use_sync=use_sync, attn_type=attn_type, mesh=mesh, **kw)
        self.spg = sequence_process_group

    def forward(self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *args, **kw):
        mesh = self._pipe.resolve_mesh()
        if mesh.ring_degree != 1:
            raise ValueError(f"UlyssesAttention needs a mesh with ring_degree=1 (got {mesh.ring_degree}); "
                             "use LongContextAttention for ulysses x ring")
        return super().forward(query, key, value, dropout_p, softmax_scale, causal, window_size, softcap,
                               alibi_slopes, deterministic, return_attn_probs, *args, **kw)


def dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class RingAttention(LongContextAttention):
    """Ring only (ulysses degree 1)."""

    def forward(self, *args, **kw):
        mesh = self._pipe.resolve_mesh()
        if mesh.ulysses_degree != 1:
            raise ValueError(f"RingAttention needs a mesh with ulysses_degree=1 (got {mesh.ulysses_degree}); "
                             "use LongContextAttention for ulysses x ring")
        return super().forward(*args, **kw)


class LongContextAttentionQKVPacked(LongContextAttention):
    """Packed input ``qkv [B, S_local, 3, H, D]``, yunchang's signature
    (yunchang/hybrid/attn_layer.py, 0.6.4): ``scatter_idx=3`` (the heads dim of the packed
    tensor), ``gather_idx=1``, ``ring_impl_type``, ``use_sync``, ``attn_type``; the other
    keywords of :class:`LongContextAttention` by keyword."""

    def __init__(self, scatter_idx: int = 3, gather_idx: int = 1, ring_impl_type: str = "basic",
                 use_sync: bool = False, attn_type="auto", **kw):
        if (scatter_idx, gather_idx) not in ((3, 1), (2, 1)):
            raise NotImplementedError(
                f"scatter_idx={scatter_idx}, gather_idx={gather_idx}: packed qkv is [B, S, 3, H, D], scattered on "
                "its heads (scatter_idx=3, yunchang's default) and gathered on the sequence (gather_idx=1)")
        super().__init__(2, 1, ring_impl_type, use_sync=use_sync, attn_type=attn_type, **kw)

    def forward(self, qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                alibi_slopes=None, deterministic=False, return_attn_probs=False, *args, return_lse=False,
                positions=None, cu_seqlens=None):
        """The output ``[B, S_local, H, D]``; ``(out, lse)`` with ``return_lse=True``
        (``return_attn_probs`` changes nothing, as in yunchang)."""
        if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
            err = ValueError(f"qkv must be [batch, seq, 3, heads, head_dim], got {tuple(getattr(qkv, 'shape', ()))}")
            if torch.compiler.is_compiling():
                raise err
            # a refusal every rank sees (this rank alone raising would leave the others waiting)
            self._pipe(self._pipe.resolve_mesh(), None, None, None, CallOptions(), err=err)
            raise err     # (not reached: the agreement raises)
        q, k, v = qkv.unbind(2)
        return super().forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_lse=return_lse, positions=positions, cu_seqlens=cu_seqlens)


__all__ = ["LongContextAttention", "AsyncLongContextAttention", "LongContextAttentionQKVPacked", "UlyssesAttention",
           "RingAttention", "USPError", "CallPlan", "merge_dtype"]
