"""Serving long contexts: a KV cache sharded over the ``U x R`` mesh, filled by a load or a
prefill through the USP call (``usp_hal.serving.fill``), and decode steps merged exactly by lse.

Where the tokens live (:class:`ShardedKVCache`)::

    U x R mesh, H query heads, Hkv KV heads, one sequence of S prompt tokens
      rank (u, r) keeps K/V of the KV heads its query heads use (heads.head_plan, u)
                       for the tokens of ring rank r (the prefill layout's ring shard)
      new tokens go to ring ranks in blocks of ``block_size`` consecutive positions: a new
      block goes to the ring rank holding the fewest tokens of that sequence (ties: the
      lowest ring rank), so every ring rank holds S_b / R tokens of each sequence b plus at
      most one block (a sequence that starts on one rank is evened out as it grows)

Decode (:meth:`ShardedKVCache.decode`) of ``n`` new tokens per sequence, with q/k/v of the new
tokens on every rank of the sequence-parallel group (replicated after the projections):

1. one metadata agreement (:func:`usp_hal.parallel.comm.agree`, ints on the CPU side group): the
   cache's configuration, the call's shapes and options, a fingerprint of the new keys,
   every rank's belief about where every token lives, and every rank's actual lengths;
   any difference raises the same error on every rank before any data moves;
2. the owners append the new K/V (no communication: every rank has them);
3. each rank attends its query heads to its cached tokens on the attention call's parts: the
   options become a :class:`~usp_hal.dispatch.capabilities.KernelCall` as the call's do
   (:meth:`usp_hal.pipeline.CallOptions.kernel_call`), the backend comes from a
   :class:`~usp_hal.dispatch.registry.Dispatch` like the pipeline's, and there is one kernel
   call per contiguous run of positions (the ring's block plan, ``blocks.plan_runs``: full
   rectangles and square causal diagonals, with key offsets for window/ALiBi; with
   ``key_start`` (left-padded prompts) no call reads a key before its row's first real
   token), merged by the ring's merge in float32 (float64 for float64 inputs);
4. ONE ``all_gather`` over the sequence-parallel group of every rank's partial ``(out, lse)``
   (float32: ``B * n * h_max * (Dv + 1) * 4`` bytes sent per rank, ``W`` times that received,
   ``h_max`` the largest head count of a Ulysses rank); every rank merges the ring ranks'
   partials of each head group by lse with the ring's merge (exact) and joins the head
   groups, so every rank returns the full ``[B, n, H, Dv]`` output, bit-identical.

A rank whose cached tokens are all invisible (or that holds none) contributes lse = -inf,
weight 0.  Attention sinks (``sinks=``, one logit per head) join the merged result once,
after the merge over the ring ranks (``lse' = logaddexp(lse, sink)``), as in the USP call.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..dispatch.capabilities import AttnRequest, KernelCall
from ..dispatch.registry import REGISTRY, Dispatch
from ..parallel.comm import agree, all_gather_bytes, all_gather_single, collective, digest_ints, dtype_code
from ..parallel.heads import head_plan
from ..parallel.ring import merge_block, merge_dtype, merge_partials
from ..pipeline.options import CallOptions
from ..pipeline.spec import TensorDigests, compare, meta_vector, spec_of
from ..pipeline.spec import fingerprint as fingerprint_of
from ..sequence.blocks import plan_runs
from ..sequence.positions import Segment, check_layout
from .blocktable import BlockTable, Piece
from .fill import SERVING_WHAT, CacheFilling

__all__ = ["ShardedKVCache", "merge_partials", "decode_bytes", "SERVING_WHAT"]

_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def decode_bytes(batch: int, new_tokens: int, heads_per_rank: int, v_dim: int, world: int,
                 dtype: torch.dtype = torch.float32) -> Dict[str, int]:
    """Bytes of the one data collective of a decode call (per layer and step): what each rank
    sends and receives in the all-gather of partial (out, lse)."""
    item = torch.empty((), dtype=merge_dtype(dtype)).element_size()
    send = batch * new_tokens * heads_per_rank * (v_dim + 1) * item
    return {"send": send, "recv": send * world}


# --------------------------------------------------------------------------------- layer state
@dataclass
class _Layer(BlockTable):
    """One layer's shard: storage ``[B, hk, cap, D]`` beside its block table (replicated)."""

    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    options: Optional[int] = None      # digest of the options this layer's decode last agreed on (every rank)

    def reset(self):
        super().reset()
        self.k = self.v = None
        self.options = None


def _labelled(label: str):
    return field(metadata={"label": label})


_OPTIONS = "the options"


@dataclass(frozen=True)
class DecodeSpec:
    """What every rank of the sequence-parallel group must agree on for one decode call.
    Its agreement vector is derived from the fields as :meth:`usp_hal.pipeline.spec.CallSpec.meta`
    derives the call's (:func:`usp_hal.pipeline.spec.meta_vector`), its options come from the call's
    :class:`KernelCall` by name (:func:`usp_hal.pipeline.spec.spec_of`), and a disagreement is
    told by the attention call's comparison (:func:`usp_hal.pipeline.spec.compare`), each
    field by its label.  Then come, outside the spec, this rank's ring rank and lengths."""

    config: int = _labelled("the cache's configuration")
    ulysses: int = _labelled("")
    ring: int = _labelled("")
    layer: int = _labelled("")
    new_tokens: int = _labelled("new tokens per sequence")
    causal: bool = _labelled(_OPTIONS)
    window: Tuple[int, int] = _labelled(_OPTIONS)
    softcap: float = _labelled(_OPTIONS)
    scale: float = _labelled(_OPTIONS)
    alibi: int = _labelled(_OPTIONS)           # a digest of the slopes' values (0: none)
    sinks: int = _labelled(_OPTIONS)           # a digest of the sink logits' values (0: none)
    key_start: int = _labelled(_OPTIONS)       # a digest of the rows' first keys (0: none)
    inputs: int = _labelled("the new tokens' q, k and v (check_inputs=True: they must be the same on every rank, "
                            "replicated after the projections)")
    table: int = _labelled("the placement table (where every token lives)")

    def meta(self) -> List[int]:
        return meta_vector(self)

    def options(self) -> int:
        """A digest of the options (what a layer's later steps repeat under ``verify="step"``)."""
        return digest_ints(meta_vector(replace(self, config=0, ulysses=0, ring=0, layer=0, new_tokens=0, inputs=0,
                                               table=0)))


@dataclass
class _Decode:
    """One decode call on this rank, checked: its spec, this rank's refusal (None: it can run),
    its backend and :class:`KernelCall` (None after a refusal), and the rows' first keys."""

    spec: DecodeSpec
    refusal: Optional[BaseException]
    backend: Any
    call: Optional[KernelCall]
    key_start: Optional[List[int]]


class _EveryLayer:
    """``verify="layer"``: every call agrees on its metadata."""

    def agrees(self, layer, ly: Optional[_Layer]) -> bool:
        return True

    def problem(self, cache: "ShardedKVCache", ly: Optional[_Layer], spec: DecodeSpec) -> Optional[Exception]:
        return None

    def agreed(self, layer, spec: Optional[DecodeSpec]) -> None:
        """After an agreement (``spec``), or before one (None: nothing agreed in this step yet)."""

    def new_tokens(self, spec: DecodeSpec) -> int:
        return spec.new_tokens


class _EveryStep(_EveryLayer):
    """``verify="step"``: the calls on layer 0 agree (and a layer's first decode step); a later
    layer checks itself against what layer 0 agreed in this step, and a difference is flagged
    in the data all-gather (see :class:`ShardedKVCache`)."""

    def __init__(self):
        self.step: Optional[DecodeSpec] = None     # what layer 0 agreed on in this step

    def agrees(self, layer, ly: Optional[_Layer]) -> bool:
        # a layer decoded for the first time agrees in full (layers may differ: a sliding-window layer
        # beside a full one, each with its own sinks); later steps compare with what it agreed then
        return layer == 0 or self.step is None or ly is None or ly.options is None

    def agreed(self, layer, spec: Optional[DecodeSpec]) -> None:
        if spec is None or layer == 0:
            self.step = spec

    def new_tokens(self, spec: DecodeSpec) -> int:
        assert self.step is not None
        return self.step.new_tokens       # the size every rank's partials have in the gather

    def problem(self, cache, ly, spec) -> Optional[Exception]:
        """Why this call differs from what was agreed (the step's size and placement at layer 0;
        the options at this layer's first decode step)."""
        step = self.step
        assert step is not None
        if ly is None:
            return ValueError("layer out of range")
        if spec.new_tokens != step.new_tokens:
            return ValueError(f"{spec.new_tokens} new tokens per sequence, but layer 0 of this step agreed on "
                              f"{step.new_tokens}")
        if spec.options() != ly.options:
            return ValueError("the options (causal, window, softcap, scale, alibi, sinks, key_start) differ from the "
                              "ones this layer agreed on at its first decode step")
        if ly.digest() != step.table:
            return ValueError(f"this layer's placement table differs from layer 0's at the start of the step "
                              f"(lengths {ly.total} per sequence)")
        me = cache.mesh.ring_rank
        want = ly.held_by(me)
        if ly.local != want:
            return ValueError(f"this rank holds {ly.local} tokens per sequence, but the placement table says ring "
                              f"rank {me} holds {want}")
        return None


class ShardedKVCache(CacheFilling):
    """This rank's shard of a KV cache on a ``U x R`` sequence-parallel mesh (see the module doc).

    ``num_layers`` layers for a batch of ``batch_size`` sequences of ``num_heads`` query heads,
    ``num_kv_heads`` KV heads (GQA/MQA), ``head_dim`` (``v_head_dim``).  ``block_size``: how
    many consecutive new positions go to one ring rank before the next block is placed.
    ``attn_type``: the registry backend used for the decode kernel calls (``"auto"`` picks the
    first backend that can serve the call's options with an lse).  Every rank of the
    sequence-parallel group must construct it with the same arguments (checked: one small
    all-gather).  ``layout``: the prefill layout of :meth:`load` (``prefill`` takes the
    module's own); it must be contiguous (``basic`` or ``zigzag``) for window/ALiBi.

    ``verify``: when decode calls agree on their metadata.  ``"layer"`` (default): every call,
    after this rank's local work (validation, append, attention: launched, not waited for), so a
    local failure is one more refusal in that agreement; the agreement is one small all-gather
    of integers on the mesh's CPU side group, and nothing is read from the device (no host
    sync per layer or step).  ``"step"``: the calls on layer 0 agree; a call on another layer
    checks itself against what layer 0 agreed in this step (new tokens, options, the placement
    table, this rank's lengths) and a rank that finds a difference says so in the data
    all-gather, so every rank still raises together, with one metadata collective per step
    instead of one per layer (for models that decode their layers in order), at the price of
    reading that flag from the device in every layer past 0 (a host sync per layer).

    The caller's contract: q, k and v of the new tokens are the same on every rank of the
    sequence-parallel group (replicated after the projections); the agreement compares the
    rest (:class:`DecodeSpec`, the ranks' lengths).  ``check_inputs=True`` (a debugging aid)
    also compares a fingerprint of q, k and v, at one device->host read per agreed call.
    """

    def __init__(self, mesh=None, *, num_layers: int, batch_size: int, num_heads: int,
                 num_kv_heads: Optional[int] = None, head_dim: int, v_head_dim: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu",
                 block_size: int = 256, attn_type: str = "auto", layout: str = "zigzag", verify: str = "layer",
                 check_inputs: bool = False):
        from ..parallel.mesh import get_default_mesh
        self.mesh = mesh if mesh is not None else get_default_mesh()
        m = self.mesh
        hkv = num_heads if num_kv_heads is None else num_kv_heads
        dv = head_dim if v_head_dim is None else v_head_dim
        problem = None
        try:
            for name, val in (("num_layers", num_layers), ("batch_size", batch_size), ("num_heads", num_heads),
                              ("num_kv_heads", hkv), ("head_dim", head_dim), ("v_head_dim", dv),
                              ("block_size", block_size)):
                if not isinstance(val, int) or val < 1:
                    raise ValueError(f"{name} must be a positive int, got {val!r}")
            if num_heads % hkv:
                raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={hkv}")
            if verify not in ("layer", "step"):
                raise ValueError(f"verify={verify!r}; valid: 'layer', 'step'")
            if dtype not in _FLOATS:
                raise ValueError(f"dtype {dtype} is not supported (float64, float32, bfloat16, float16)")
            REGISTRY.canonical_name(attn_type)
            check_layout(layout)
        except (ValueError, TypeError) as exc:
            problem = exc
        self.num_layers, self.batch_size = num_layers, batch_size
        self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim = num_heads, hkv, head_dim, dv
        self.dtype, self.device = dtype, torch.device(device)
        self.block_size, self.attn_type, self.layout = block_size, attn_type, layout
        sizes = (num_layers, batch_size, num_heads, hkv, head_dim, dv)
        config = [m.ulysses_degree, m.ring_degree, *(int(x) if isinstance(x, int) else -1 for x in sizes),
                  dtype_code(dtype) if isinstance(dtype, torch.dtype) else -1,
                  int(block_size) if isinstance(block_size, int) else -1,
                  digest_ints(list(str(attn_type).encode())), digest_ints(list(str(layout).encode()))]
        labels = ("ulysses_degree", "ring_degree", "num_layers", "batch_size", "num_heads", "num_kv_heads",
                  "head_dim", "v_head_dim", "dtype", "block_size", "attn_type", "layout")
        if m.sp_size > 1:
            agree(problem, m.metadata_group, what=f"{SERVING_WHAT}: construction", where=m.where("sequence-parallel"),
                  values=config, same=labels, ranks=m.sp_ranks)
        elif problem is not None:
            raise problem
        self._config_digest = digest_ints(config)
        self._digests = TensorDigests()
        self.heads = head_plan(num_heads, hkv, m.ulysses_degree)
        u = m.ulysses_rank
        self.q_range = self.heads.q[u]
        self.kv_range = self.heads.kv[u]
        self.kv_expand = self.heads.kv_expand[u]
        self.local_heads = self.heads.local_heads(u)      # (query heads, stored KV heads)
        self.heads_max = max(b - a for a, b in self.heads.q)
        self.layers = [_Layer(batch_size, m.ring_degree) for _ in range(num_layers)]
        self._dispatch = Dispatch(attn_type)   # decode's backends, chosen as the pipeline chooses its own
        self.last_calls = 0          # kernel calls of the last decode on this rank (tests, benchmarks)
        self.verify = verify
        #: debug mode: every agreed decode call also compares a fingerprint of q, k and v (one
        #: device->host read per call); off, their equality on every rank is the caller's contract
        self.check_inputs = bool(check_inputs)
        #: when decode calls agree (``verify``): every call, or once per step
        self._verifier: _EveryLayer = _EveryStep() if verify == "step" else _EveryLayer()

    # ------------------------------------------------------------------ facts
    def lengths(self, layer: int = 0) -> List[int]:
        """Global length of every sequence of ``layer``."""
        return list(self.layers[layer].total)

    def local_lengths(self, layer: int = 0) -> List[int]:
        """Tokens of every sequence of ``layer`` held by this rank."""
        return list(self.layers[layer].local)

    def ring_counts(self, layer: int = 0) -> List[List[int]]:
        """Per sequence, per ring rank: how many of its tokens that ring rank holds."""
        return [list(c) for c in self.layers[layer].counts]

    def local_positions(self, layer: int, row: int) -> List[int]:
        """Global positions of the tokens of sequence ``row`` held here, in storage order."""
        return self.layers[layer].positions(row)

    def memory_bytes(self) -> int:
        """Bytes of K/V storage this rank holds (allocated capacity, all layers)."""
        return sum(t.numel() * t.element_size() for ly in self.layers for t in (ly.k, ly.v) if t is not None)

    def used_bytes(self) -> int:
        """Bytes of the K/V tokens this rank holds (without the capacity's room)."""
        hk = self.local_heads[1]
        item = torch.empty((), dtype=self.dtype).element_size()
        return sum(n * hk * (self.head_dim + self.v_head_dim) * item for ly in self.layers for n in ly.local)

    def reset(self) -> None:
        self._verifier.agreed(0, None)
        for ly in self.layers:
            ly.reset()

    # ------------------------------------------------------------------ storage
    def _reserve(self, ly: _Layer, need: int) -> None:
        """Room for ``need`` tokens per row, in whole blocks (at most one block unused).
        Storage is head-major, ``[B, hk, cap, D]``: each head's keys are contiguous, the
        layout CPU and GPU kernels read fastest; kernels get ``[B, S, hk, D]`` views."""
        cap = 0 if ly.k is None else ly.k.shape[2]
        if need <= cap:
            return
        bs = self.block_size
        new = -(-need // bs) * bs
        hk = self.local_heads[1]
        k = torch.zeros((self.batch_size, hk, new, self.head_dim), dtype=self.dtype, device=self.device)
        v = torch.zeros((self.batch_size, hk, new, self.v_head_dim), dtype=self.dtype, device=self.device)
        if ly.k is not None and ly.v is not None and cap:
            k[:, :, :cap] = ly.k
            v[:, :, :cap] = ly.v
        ly.k, ly.v = k, v

    def _my_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, n, Hkv, D]`` -> the KV heads this rank stores (expanded where the head plan says)."""
        a, b = self.kv_range
        x = x[:, :, a:b]
        if self.kv_expand is not None:
            x = x.index_select(2, torch.tensor(self.kv_expand, device=x.device))
        return x

    def _place(self, ly: BlockTable, row: int, n: int) -> List[Piece]:
        """Assign the next ``n`` positions of ``row`` to ring ranks (:meth:`BlockTable.place`)."""
        return ly.place(row, n, self.block_size)

    def _append(self, ly: _Layer, table: BlockTable, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append the new tokens ``k``/``v`` ``[B, n, Hkv, D]`` (every rank has them): ``table``
        (the layer's, or a copy of it) advances on every rank, the owners copy their heads
        into ``ly``'s storage past the tokens ``table`` holds."""
        n = k.shape[1]
        me = self.mesh.ring_rank
        starts = list(table.total)
        plan = [table.place(b, n, self.block_size) for b in range(self.batch_size)]
        mine = [sum(c for r, _, c in p if r == me) for p in plan]
        if not any(mine):
            return
        self._reserve(ly, max(table.local[b] + mine[b] for b in range(self.batch_size)))
        assert ly.k is not None and ly.v is not None
        kk, vv = self._my_heads(k), self._my_heads(v)
        for b, pieces in enumerate(plan):
            for r, j, c in pieces:
                if r == me:
                    at = table.hold(b, starts[b] + j, c)
                    ly.k[b, :, at:at + c] = kk[b, j:j + c].transpose(0, 1)
                    ly.v[b, :, at:at + c] = vv[b, j:j + c].transpose(0, 1)

    # ------------------------------------------------------------------ decode

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
               softmax_scale=None, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
               return_lse: bool = False, mesh=None, problem: Optional[str] = None,
               sinks: Optional[torch.Tensor] = None, key_start: Optional[Sequence[int]] = None):
        """Append ``n`` new tokens per sequence and attend their queries to the whole cache.

        ``q`` ``[B, n, H, D]``, ``k``/``v`` ``[B, n, Hkv, D]``: the new tokens of every sequence,
        the same on every rank of the sequence-parallel group; sequence ``b``'s new tokens
        are at positions ``lengths()[b] ..`` (so rows may have different lengths).  Returns
        ``out`` ``[B, n, H, Dv]`` (the input dtype), and with ``return_lse`` the lse
        ``[B, H, n]`` (float32; float64 for float64 inputs), the same on every rank.
        ``causal``, ``window_size`` (left, right) over global positions, ``softcap`` and
        ``alibi_slopes`` (``[H]`` or ``[B, H]``) and ``sinks`` (``[H]``, one logit per head in
        every row's denominator, applied once to the merged result) as for
        :class:`usp_hal.LongContextAttention`.
        ``key_start`` (one int per sequence): sequence ``b`` attends only the keys at global
        positions ``>= key_start[b]`` (a left-padded prompt's first real token; its padding is
        never attended); default 0.  A sequence that sees no key gets out 0 and lse -inf.
        ``mesh``: the caller's mesh, checked against the cache's; ``problem``: a reason of the
        caller's to refuse the call, joined to the agreement (so it is raised on every rank).
        Collective."""
        m = self.mesh
        ly = self.layers[layer] if isinstance(layer, int) and 0 <= layer < self.num_layers else None
        agreeing = m.sp_size > 1 and self._verifier.agrees(layer, ly)
        # the options as the attention call's, checked alike (CallOptions.kernel_call)
        opts = CallOptions.of(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)
        call = self._decode_call(layer, ly, q, k, v, opts, alibi_slopes=alibi_slopes, sinks=sinks, key_start=key_start,
                                 mesh=mesh, problem=problem, fingerprint=agreeing and self.check_inputs)
        failure = call.refusal
        if failure is not None and m.sp_size == 1:
            raise failure
        if agreeing:
            self._verifier.agreed(layer, None)
        elif failure is None and m.sp_size > 1:      # verify="step" past layer 0: checked here, flagged in the gather
            failure = self._verifier.problem(self, ly, call.spec)
        # this rank's work first (append, then the kernels: launched, not waited for), on a copy of the
        # block table, so that a failure of it is a refusal in the agreement and nothing needs undoing
        table = ly.copy() if ly is not None else BlockTable(self.batch_size, m.ring_degree)
        out = lse = None
        if failure is None:
            try:
                assert ly is not None
                starts = list(table.total)
                self._append(ly, table, k, v)
                out, lse = self._attend(ly, table, call, q, starts)
            except Exception as exc:
                if m.sp_size == 1:
                    raise
                failure = exc
        if agreeing:       # raises on every rank if one refused or they differ: the table stays as it was
            self._agree_decode(failure, call.spec, table if ly is not None else None)
            assert ly is not None
            ly.options = call.spec.options()
            self._verifier.agreed(layer, call.spec)
        if ly is not None:
            ly.adopt(table)
        if out is None or lse is None:     # a local failure still joins the collective (flagged), so no peer waits
            out, lse = self._no_partials(self._verifier.new_tokens(call.spec))
        out, lse = self._gather(out, lse, failure, flagged=not agreeing)
        if sinks is not None:        # once, on the merged rows (every rank holds every head now)
            from ..pipeline.run import add_sink
            out, lse = add_sink(out, lse, sinks.detach())
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out

    def _decode_call(self, layer, ly: Optional[_Layer], q, k, v, opts: CallOptions, *, alibi_slopes, sinks, key_start,
                     mesh, problem, fingerprint: bool) -> _Decode:
        """This rank's decode call checked (its options as the attention call's:
        :meth:`usp_hal.pipeline.CallOptions.kernel_call`), nothing communicated."""
        m = self.mesh
        n = int(q.shape[1]) if isinstance(q, torch.Tensor) and q.dim() == 4 else -1
        backend = refusal = call = None
        try:
            if problem:
                raise ValueError(problem)
            if mesh is not None and mesh != m:
                raise ValueError(f"the cache was built on a {m.ulysses_degree} x {m.ring_degree} (ulysses x ring) mesh "
                                 f"over ranks {m.sp_ranks}; this call's mesh is {mesh.ulysses_degree} x "
                                 f"{mesh.ring_degree} over ranks {mesh.sp_ranks}: decode with the mesh the cache was "
                                 "prefilled on")
            if ly is None:
                raise ValueError(f"layer {layer!r} is out of range (the cache has {self.num_layers} layers)")
            self._check_kv(k, v, "decode", q)
            if n < 1:
                raise ValueError("decode needs at least one new token per sequence")
            call = opts.kernel_call(head_dim=self.head_dim, heads=self.num_heads, batch=self.batch_size,
                                    alibi_slopes=alibi_slopes, sinks=sinks, q=q, needs_lse=True)
            if key_start is not None:
                key_start = [int(x) for x in key_start]
                if len(key_start) != self.batch_size or min(key_start) < 0:
                    raise ValueError(f"key_start must give a position >= 0 for each of the {self.batch_size} "
                                     f"sequences, got {list(key_start)}")
                if not any(key_start):
                    key_start = None
            # what this rank's kernels see: its heads, key offsets wherever positions matter
            hq, hk = self.local_heads
            backend = self._dispatch(AttnRequest.of(q, k, v, call, lengths=False, num_heads=max(hq, 1),
                                                    num_kv_heads=max(hk, 1), key_offset=call.positional))
        except Exception as exc:      # any failure of this rank's call is a refusal every rank sees
            refusal = exc
        # alibi slopes and sinks are the same tensors step after step: digested once per tensor version
        spec = spec_of(DecodeSpec, call if call is not None else KernelCall(scale=0.0), config=self._config_digest,
                       ulysses=m.ulysses_degree, ring=m.ring_degree, layer=layer if isinstance(layer, int) else -1,
                       new_tokens=n, alibi=self._digests(alibi_slopes) if isinstance(alibi_slopes, torch.Tensor) else 0,
                       sinks=self._digests(sinks) if isinstance(sinks, torch.Tensor) else 0,
                       key_start=digest_ints(key_start) if isinstance(key_start, list) else 0,
                       inputs=fingerprint_of(q, k, v) if fingerprint and refusal is None else 0,   # debug: a host read
                       table=ly.digest() if ly is not None else 0)
        return _Decode(spec, refusal, backend, call, key_start if isinstance(key_start, list) else None)

    def _no_partials(self, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """What a rank that failed sends in the gather: out 0 and lse -inf for its heads."""
        hq = self.q_range[1] - self.q_range[0]
        out = torch.zeros((self.batch_size, n, hq, self.v_head_dim), dtype=merge_dtype(self.dtype), device=self.device)
        return out, torch.full((self.batch_size, hq, n), float("-inf"), dtype=out.dtype, device=self.device)

    def _agree_decode(self, problem, spec: DecodeSpec, table: Optional[BlockTable]) -> None:
        """One agreement of every rank's :class:`DecodeSpec`, ring rank and lengths (after this
        rank's append to ``table``: they must be what the table says its ring rank holds)."""
        m = self.mesh
        names = m.sp_ranks
        values = spec.meta()[1:]
        nf = len(values)

        def check(rows):
            diffs = compare([[0, *r[:nf]] for r in rows], names, spec)       # the attention call's comparison
            if diffs or table is None:
                return diffs
            for i, r in enumerate(rows):
                rr, got = r[nf], r[nf + 1:]
                want = table.held_by(rr)
                if list(got) != want:
                    diffs.append(f"rank {names[i]} (ring rank {rr}) holds {list(got)} tokens per sequence, but the "
                                 f"ranks' placement table says ring rank {rr} holds {want}")
            return diffs

        agree(problem, m.metadata_group, what=f"{SERVING_WHAT}: decode", where=m.where("sequence-parallel"),
              values=[*values, m.ring_rank, *(table.local if table is not None else [0] * self.batch_size)],
              width=nf + 1 + self.batch_size, check=check, ranks=names)

    def _attend(self, ly: _Layer, table: BlockTable, dec: _Decode, q, starts):
        """This rank's partial ``(out [B, n, hq, Dv], lse [B, hq, n])`` over its cached tokens
        (``table``'s, in ``ly``'s storage; of sequence b, those at positions >= ``key_start[b]``):
        each run's block calls, their values derived from the decode call's, merged by the ring's merge."""
        call, key_start, backend = dec.call, dec.key_start, dec.backend
        assert call is not None
        qa, qb = self.q_range
        bsz, n, hq = q.shape[0], q.shape[1], qb - qa
        mdt = merge_dtype(q.dtype)
        out = torch.zeros((bsz, n, hq, self.v_head_dim), dtype=mdt, device=q.device)
        lse = torch.full((bsz, hq, n), float("-inf"), dtype=mdt, device=q.device)
        self.last_calls = 0
        if hq == 0:
            return out, lse
        qh = q[:, :, qa:qb]
        slopes = None if call.alibi_slopes is None else call.alibi_slopes[..., qa:qb].to(torch.float32)
        for b in range(bsz):
            plan = plan_runs(Segment(starts[b], n), table.runs[b], causal=call.causal, window=call.window,
                             positional=call.positional, first=key_start[b] if key_start is not None else 0)
            row = call if slopes is None else call.with_(alibi_slopes=slopes if slopes.dim() == 1 else slopes[b:b + 1])
            for c in plan:        # (a plan has calls only where this rank holds tokens, so storage)
                assert ly.k is not None and ly.v is not None
                o, s = backend.forward(qh[b:b + 1, c.rows], ly.k[b:b + 1, :, c.cols].transpose(1, 2),
                                       ly.v[b:b + 1, :, c.cols].transpose(1, 2),
                                       row.with_(causal=c.causal, key_offset=c.key_offset if row.positional else 0))
                merge_block(out[b:b + 1], lse[b:b + 1], c.rows, o, s, empty_rows=True)
                self.last_calls += 1
        return out, lse

    def _gather(self, out: torch.Tensor, lse: torch.Tensor, failure: Optional[BaseException] = None,
                flagged: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
        """The one data collective: every rank's partial (out, lse), merged over the ring ranks
        of each head group by lse, the head groups joined: ``[B, n, H, Dv]``, ``[B, H, n]``.
        ``flagged``: one trailing element per rank flags a local failure, raised on every rank
        (read on the host: a device sync); False after an agreement that already saw every
        rank's failures (nothing is read from the device)."""
        m = self.mesh
        if m.sp_size == 1:
            if failure is not None:
                raise failure
            return out, lse
        bsz, n, hq, dv = out.shape
        h = self.heads_max
        size = bsz * n * h * (dv + 1)
        extra = 1 if flagged else 0
        send = torch.empty(size + extra, dtype=out.dtype, device=out.device)
        buf = send[:size].view(bsz, n, h, dv + 1)
        if hq < h:
            buf[:, :, hq:, :dv] = 0.0
        buf[:, :, :hq, :dv] = out
        buf[:, :, :, dv] = float("-inf")
        buf[:, :, :hq, dv] = lse.transpose(1, 2)
        if flagged:
            send[size] = 0.0 if failure is None else 1.0
        flat = torch.empty(m.sp_size * (size + extra), dtype=send.dtype, device=send.device)
        collective("decode all-gather of partial out/lse", m.where("sequence-parallel"), all_gather_single,
                   flat, send, group=m.sp_group)
        rows = flat.view(m.sp_size, size + extra)
        failed = [i for i in range(m.sp_size) if float(rows[i, size]) != 0.0] if flagged else []
        if failed:      # every rank knows: one more (small) exchange gives every rank every reason
            mine = f"{type(failure).__name__}: {failure}" if failure is not None else ""
            texts = all_gather_bytes(mine.encode("utf-8", "replace"), m.metadata_group,
                                     what=f"{SERVING_WHAT}: decode failure messages",
                                     where=m.where("sequence-parallel"))
            why = "; ".join(f"rank {m.sp_ranks[i]}: {texts[i].decode('utf-8', 'replace')}" for i in failed)
            msg = (f"{SERVING_WHAT}: decode failed on rank(s) {[m.sp_ranks[i] for i in failed]} ({why}); the "
                   "cache of this layer may be inconsistent now: reset() it and prefill again")
            if failure is not None:
                raise RuntimeError(msg) from failure
            raise RuntimeError(msg)
        got = rows[:, :size].view((m.sp_size, bsz, n, h, dv + 1))
        U, R = m.ulysses_degree, m.ring_degree
        outs, lses = [], []
        for u in range(U):
            a, b = self.heads.q[u]
            if b <= a:
                continue
            parts = got[[m.sp_index(r, u) for r in range(R)]][:, :, :, :b - a]     # [R, B, n, h_u, Dv+1]
            o, s = merge_partials(parts[..., :dv], parts[..., dv].transpose(2, 3))
            outs.append(o)
            lses.append(s)
        return torch.cat(outs, 2), torch.cat(lses, 1)
