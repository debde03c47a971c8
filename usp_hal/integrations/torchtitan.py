"""usp-hal as the attention of torchtitan 0.3.0's decoders (tested: Llama3, and gpt-oss's attention with sinks).

torchtitan's own context parallel swaps each block's ``attention.inner_attention.forward``
(torchtitan/distributed/context_parallel/api.py, ``apply_cp_to_forward``) before
``Module.parallelize()`` wraps it in TP's ``local_map``.  :func:`apply_usp` uses the same hook:
every inner attention becomes a call of one :class:`usp_hal.LongContextAttention` over
``mesh`` (Ulysses x Ring over the sequence-parallel ranks), so it composes with torchtitan's
TP (the hook sees this TP rank's heads; Ulysses then splits those over the sp group) and
FSDP2 (``apply_fsdp_to_decoder``, which shards over ``dp_shard x cp``: use the ``cp`` mesh
dim as the sequence-parallel one).  :func:`prepare_inputs` takes the place of torchtitan's
``prepare_context_parallel_input``: it shards one whole batch with the layout ``apply_usp``
was given (the one source of the layout) and finds its packed documents::

    mesh = usp_hal.init_sequence_parallel(device_mesh=parallel_dims.get_mesh("cp"), set_default=False)
    apply_usp(model, mesh)                    # in place of apply_cp_to_forward: before model.parallelize and FSDP
    ...
    tokens, labels, extra = prepare_inputs(model, input_dict["input"], labels, positions=input_dict.get("positions"))
    logits = model(tokens, **extra)           # extra: positions= (this rank's) and attention_masks= (a ShardedBatch)
    loss = ce_sum(logits, labels) / global_valid_tokens               # torchtitan's own loss convention
    loss.backward()

Packed documents follow torchtitan's convention (``get_document_mask_mod``,
``create_varlen_metadata_for_document``): ``positions`` restart at 0 at every document start.
:func:`prepare_inputs` takes the boundaries from there, packs the batch's rows into one stream
(``[1, B*S]``: every row starts a document, so rows may hold different documents), shards it
with these boundaries, and the attention keeps every query inside its own document
(``LongContextAttention(...)(q, k, v, cu_seqlens=...)``; ``layout="varlen_zigzag"`` balances the
causal work per document, docs/varlen.md).  No BlockMask or varlen metadata is built: usp-hal
needs only the boundaries.  torchtitan's own ``attention_masks`` are refused (a BlockMask does
not say where the documents are; build the call with :func:`prepare_inputs` instead).

Checked on every rank before any block runs, in one small all-gather of integers over the
mesh's metadata group (a model forward pre-hook; once per forward with the attention's
default ``check_ranks="every_call"``, on the first forward only with ``"first_call"`` or
``"off"``): the positions each rank passes are the ones the layout gives its tokens (stream
positions, or per-document ones with documents: so tokens sharded with another layout and
their own positions are refused, not attended in the wrong order), every rank's length fits
the layout, the ranks of the group passed the same whole batch to :func:`prepare_inputs`,
and each rank's local refusals below.  Any of them raises the same error on every rank.  The
positions are read to the host for this (once per positions tensor and version).

No :func:`usp_hal.integrations.sync_gradients` here: torchtitan's ``apply_fsdp_to_decoder``
sets FSDP's gradient divide factor to 1.0, so FSDP *sums* over ``dp_shard x cp`` (the sp ranks
included) and, with the loss divided by the global token count, the gradients are already the
whole sequence's.  ``sync_gradients`` takes a DTensor gradient whose mesh holds the sp group
as averaged and multiplies it by sp (measured: the gradient norm doubled on sp 2).

What the hook honours: ``scale``, ``is_causal``, GQA (heads as they arrive), a causal sliding
window that the block's config declares (gpt-oss ``sliding_window_size``), and gpt-oss's
sinks: its ``out_transform`` (``out * sigmoid(lse - sink)``) is softmax with ``exp(sink)`` in
the denominator, which usp-hal computes itself (``sinks=``, gradient included); any other
``out_transform`` is refused (usp-hal's lse output carries no gradient).

Refused: an inner attention other than torchtitan's ``ScaledDotProductAttention`` /
``FlexAttention`` (by layer name, in :func:`apply_usp`: e.g. ``VarlenAttention``, whose
documents come as metadata built from local positions); at call time, ``attention_masks``
other than :func:`prepare_inputs`' (torchtitan's BlockMask or varlen metadata), flex
``score_mod``, a batch sharded with another layout than ``apply_usp``'s, positions that are
not the layout's (or not per-document positions), and a model call without ``positions``
while the sequence is sharded (RoPE would number this rank's tokens from 0).
"""
from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["apply_usp", "prepare_inputs", "ShardedBatch", "local_positions", "SUPPORTED_INNER_ATTENTION"]

SUPPORTED_INNER_ATTENTION = ("ScaledDotProductAttention", "FlexAttention")
_WHAT = "usp_hal torchtitan model call"


@dataclass(frozen=True, eq=False)
class ShardedBatch:
    """One batch as :func:`prepare_inputs` sharded it; pass it as the model's
    ``attention_masks=`` (torchtitan hands it to every inner attention unchanged).

    ``layout``: the layout its tokens were sharded with (``apply_usp``'s); ``seqlen``: the
    global length of each sharded row (``B * S`` when its documents were packed into one
    stream); ``cu_seqlens``: the document boundaries in that stream, or None for one causal
    sequence per row; ``digest``: of the whole batch (tokens and positions), compared across
    the group; ``problem``: why the batch cannot be attended (refused by every rank at the
    model call)."""
    layout: str
    seqlen: int
    cu_seqlens: Optional[Tuple[int, ...]]
    digest: int
    problem: Optional[str] = None


def local_positions(mesh, seqlen: int, batch: int, layout: str = "zigzag", device=None) -> torch.Tensor:
    """This rank's global positions ``[batch, S_local]`` (the ``positions=`` of the model call)."""
    from usp_hal import shard
    pos = torch.arange(seqlen, device=device).unsqueeze(0).expand(batch, seqlen)
    return shard(pos, layout=layout, mesh=mesh)


def _window(model, index: int) -> Tuple[int, int]:
    """The causal sliding window a layer's config declares (gpt-oss), as flash's window_size."""
    layers = getattr(getattr(model, "config", None), "layers", None)
    try:
        size = layers[index].attention.sliding_window_size  # type: ignore[index]
    except (AttributeError, IndexError, TypeError):
        return (-1, -1)
    return (-1, -1) if size is None else (int(size) - 1, 0)


def apply_usp(model: torch.nn.Module, mesh, *, layout: str = "zigzag", **usp_kwargs: Any) -> int:
    """Make every transformer block's inner attention usp-hal's (before ``model.parallelize``
    and FSDP).  ``layout``: how the tokens are sharded; :func:`prepare_inputs` shards with it
    (``usp_hal.shard``'s own default is ``basic``: shard by hand with ``layout=`` this one).
    ``usp_kwargs`` go to :class:`usp_hal.LongContextAttention`.  Returns the number of layers
    replaced; refuses, naming them, layers it cannot shard (module docstring).  Every model
    call is then checked across the ranks first (module docstring)."""
    from usp_hal import LongContextAttention
    from usp_hal.sequence.positions import check_layout
    layout = check_layout(layout)
    blocks = getattr(model, "layers", None)
    if blocks is None:
        raise TypeError(f"apply_usp: {type(model).__name__} has no .layers; pass a torchtitan Decoder "
                        "(Llama3Model, Qwen3Model, GptOssModel, ...)")
    found: List[Tuple[str, Any, Tuple[int, int]]] = []
    refused: List[str] = []
    for i, (name, block) in enumerate(blocks.items() if hasattr(blocks, "items") else enumerate(blocks)):
        inner = getattr(getattr(block, "attention", None), "inner_attention", None)
        kind = type(inner).__name__
        if kind in SUPPORTED_INNER_ATTENTION:
            found.append((str(name), inner, _window(model, i)))
        else:
            refused.append(f"layers.{name}: {kind}")
    if refused:
        raise NotImplementedError(
            "apply_usp: these layers' inner attention cannot be sequence-sharded by usp-hal: " + "; ".join(refused)
            + f" (supported: torchtitan's {' and '.join(SUPPORTED_INNER_ATTENTION)}; build the model with one of "
            "them, e.g. attn_backend='flex', or leave those layers unsharded by not using apply_usp)")
    attn = LongContextAttention(ring_impl_type=layout, mesh=mesh, **usp_kwargs)
    for name, inner, window in found:
        inner.forward = _usp_forward(attn, name, window)      # the hook torchtitan's own CP uses
    model.register_forward_pre_hook(_CallCheck(mesh, layout, attn), with_kwargs=True)
    model._usp_attention = attn
    # plain attributes (not a Module, Parameter or buffer): prepare_inputs reads them
    object.__setattr__(model, "_usp_mesh", mesh)
    object.__setattr__(model, "_usp_layout", layout)
    return len(found)


# ----------------------------------------------------------------------------- sharding a batch
def _bytes_digest(*tensors: Optional[torch.Tensor]) -> int:
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        data = t.detach().contiguous().cpu()
        h.update(repr((tuple(data.shape), str(data.dtype))).encode())
        h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1 | 1


def _documents(pos: torch.Tensor) -> Tuple[Optional[List[List[int]]], Optional[str]]:
    """Per row, the starts of its documents (torchtitan's convention: positions restart at 0
    at each document), or a problem when ``pos`` is not per-document positions."""
    rows = pos.detach().cpu().to(torch.long)
    B, S = rows.shape
    if S == 0:
        return [[] for _ in range(B)], None
    first = rows[:, 0]
    if bool((first != 0).any()):
        b = int((first != 0).nonzero()[0, 0])
        return None, (f"positions of row {b} start at {int(first[b])}; torchtitan's per-document positions start "
                      "every row at 0 (its dataloader renormalises them)")
    idx = torch.arange(S).expand(B, S)
    start_of = torch.cummax(torch.where(rows == 0, idx, torch.zeros_like(idx)), dim=1).values
    want = idx - start_of                      # 0, 1, ... inside each document
    bad = (rows != want).nonzero()
    if bad.numel():
        b, i = (int(x) for x in bad[0])
        return None, (f"positions of row {b} are not per-document positions at index {i} (got {int(rows[b, i])}, "
                      f"expected {int(want[b, i])}): they must count 0, 1, ... inside each document and restart "
                      "at 0 at the next one")
    return [(rows[b] == 0).nonzero().flatten().tolist() for b in range(B)], None


def prepare_inputs(model: torch.nn.Module, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                   positions: Optional[torch.Tensor] = None):
    """This rank's part of one whole batch for a model :func:`apply_usp` made sequence
    parallel, with its layout (torchtitan's ``prepare_context_parallel_input``, for usp-hal).

    ``inputs``/``labels`` ``[B, S]`` (the whole batch, the same on every rank of the
    sequence-parallel group); ``positions`` ``[B, S]`` or ``[S]``: torchtitan's per-document
    positions (restarting at 0 at each document), or None for one sequence per row.  Returns
    ``(inputs, labels, extra)`` where ``extra`` holds ``positions`` (this rank's, for RoPE) and
    ``attention_masks`` (a :class:`ShardedBatch`): call ``model(inputs, **extra)``.  With
    documents, the rows are packed into one stream (``[1, B*S]``, each row starting a
    document) before sharding.  A batch that cannot be attended (positions that are not
    per-document positions, shapes that differ) is refused at the model call, on every rank
    together.  The whole batch is read to the host once (its digest, compared across the
    group at the call)."""
    from usp_hal import shard
    mesh, layout = getattr(model, "_usp_mesh", None), getattr(model, "_usp_layout", None)
    if mesh is None or layout is None:
        raise TypeError(f"prepare_inputs: {type(model).__name__} was not made sequence parallel; call "
                        "usp_hal.integrations.torchtitan.apply_usp(model, mesh, layout=...) first")
    if not (isinstance(inputs, torch.Tensor) and inputs.dim() == 2):
        raise TypeError(f"prepare_inputs: inputs must be a [B, S] tensor, got "
                        f"{tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__}")
    B, S = inputs.shape
    shape_problem = None         # kept, to be refused at the model call on every rank together
    if positions is not None and positions.dim() == 1:
        positions = positions.unsqueeze(0).expand(B, -1)
    if positions is not None and tuple(positions.shape) != (B, S):
        shape_problem, positions = f"positions {tuple(positions.shape)} do not match inputs {(B, S)}", None
    if labels is not None and tuple(labels.shape) != (B, S):
        shape_problem, labels = f"labels {tuple(labels.shape)} do not match inputs {(B, S)}", None
    starts, problem = _documents(positions) if positions is not None else (None, None)
    problem = shape_problem or problem
    digest = _bytes_digest(inputs, positions)
    if starts is None or all(len(s) <= 1 for s in starts):
        # one sequence per row: every row sharded alike, positions the layout's
        sharded = [shard(t, layout=layout, mesh=mesh) if t is not None else None for t in (inputs, labels)]
        local = local_positions(mesh, S, B, layout, device=inputs.device)
        batch = ShardedBatch(layout, S, None, digest, problem)
        return sharded[0], sharded[1], {"positions": local, "attention_masks": batch}
    cu = tuple(sorted({b * S + s for b, row in enumerate(starts) for s in row} | {B * S}))
    assert positions is not None
    flat = [t.reshape(1, B * S) if t is not None else None for t in (inputs, labels, positions)]
    tok, lab, pos = (shard(t, layout=layout, mesh=mesh, cu_seqlens=cu) if t is not None else None for t in flat)
    return tok, lab, {"positions": pos, "attention_masks": ShardedBatch(layout, B * S, cu, digest)}


# ----------------------------------------------------------------------------- the call's check
def _seq_digest(values: List[int]) -> int:
    from usp_hal.parallel.comm import digest_ints
    return digest_ints(values)


class _CallCheck:
    """The model's forward pre-hook: the positions, lengths, batch and local refusals of this
    call, agreed across the sequence-parallel group before any block runs (module docstring)."""

    def __init__(self, mesh, layout: str, attn):
        self.mesh, self.layout, self.attn = mesh, layout, attn
        self.checked = False
        self._seen: Dict[int, Tuple[Any, int, int, int]] = {}       # id(positions): (ref, version, ptr, digest)
        self._expected: Dict[tuple, List[int]] = {}

    def _positions_digest(self, pos: torch.Tensor) -> Tuple[int, Optional[str]]:
        seen = self._seen.get(id(pos))
        version, ptr = int(getattr(pos, "_version", 0)), pos.data_ptr()
        if seen is not None and seen[0]() is pos and seen[1:3] == (version, ptr):
            return seen[3], None
        rows = pos.detach().reshape(-1, pos.shape[-1]).cpu().to(torch.long)
        if rows.shape[0] > 1 and not bool((rows == rows[:1]).all()):
            return 0, ("the rows of positions differ: usp-hal's attention takes one position sequence for the "
                       "batch; with packed documents use prepare_inputs, which packs the rows into one stream")
        digest = _seq_digest(rows[0].tolist())
        if len(self._seen) > 64:
            self._seen = {k: v for k, v in self._seen.items() if v[0]() is not None}
        self._seen[id(pos)] = (weakref.ref(pos), version, ptr, digest)
        return digest, None

    def _expected_digests(self, seqlen: int, cu) -> List[int]:
        from usp_hal.sequence.positions import document_positions
        from usp_hal.sequence.positions import local_positions as layout_positions
        mesh = self.mesh
        key = (seqlen, cu)
        got = self._expected.get(key)
        if got is None:
            got = []
            for i in range(mesh.sp_size):
                pos = layout_positions(self.layout, seqlen, mesh.ring_degree, mesh.ulysses_degree, mesh.ring_of(i),
                                       mesh.ulysses_of(i), cu_seqlens=cu)
                if cu is not None:
                    pos = document_positions(pos, cu)
                got.append(_seq_digest(pos.tolist()))
            if len(self._expected) > 16:
                self._expected.clear()
            self._expected[key] = got
        return got

    @torch.compiler.disable        # host reads and a host collective: eager under a compiled model too
    def __call__(self, module, args, kwargs):
        mesh = self.mesh
        tokens = args[0] if args else kwargs.get("tokens")
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        masks = kwargs.get("attention_masks", args[2] if len(args) > 2 else None)
        problem: Optional[BaseException] = None
        batch = masks if isinstance(masks, ShardedBatch) else None
        if masks is not None and batch is None:
            problem = NotImplementedError(
                f"apply_usp: attention_masks={type(masks).__name__}: torchtitan's masks are not read (a BlockMask does "
                "not say where the documents are); call the model with attention_masks=None (one causal sequence "
                "over the ranks) or with the attention_masks of usp_hal.integrations.torchtitan.prepare_inputs(model, "
                "tokens, labels, positions=...), which carries the packed documents of torchtitan's per-document "
                "positions")
        elif batch is not None and batch.problem:
            problem = ValueError(f"apply_usp: prepare_inputs refused this batch: {batch.problem}")
        elif batch is not None and batch.layout != self.layout:
            problem = ValueError(f"apply_usp: this batch was sharded with layout={batch.layout!r}, and the attention "
                                 f"runs layout={self.layout!r} (apply_usp's); shard with prepare_inputs(model, ...)")
        local_len = int(tokens.shape[1]) if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 else -1
        pos_digest = 0
        if positions is None:
            if mesh.sp_size > 1 and problem is None:
                problem = ValueError(
                    "apply_usp: the model was called without positions= while its sequence is sharded over "
                    f"{mesh.sp_size} ranks: RoPE would number this rank's tokens from 0; pass the positions of "
                    "prepare_inputs(model, ...) (or usp_hal.integrations.torchtitan.local_positions(mesh, S, B, "
                    f"{self.layout!r}))")
        elif problem is None:
            if not isinstance(positions, torch.Tensor) or positions.shape[-1] != local_len:
                problem = ValueError(f"apply_usp: positions {tuple(getattr(positions, 'shape', ()))} do not match "
                                     f"this rank's {local_len} tokens")
            else:
                pos_digest, text = self._positions_digest(positions)
                problem = ValueError(f"apply_usp: {text}") if text else None
        if mesh.sp_size == 1:
            if problem is not None:
                raise problem
            return None
        if self.checked and self.attn.check_ranks != "every_call":
            return None
        self._agree(problem, local_len, pos_digest, batch)
        self.checked = True
        return None

    def _agree(self, problem, local_len: int, pos_digest: int, batch: Optional[ShardedBatch]) -> None:
        from usp_hal.parallel.comm import agree
        from usp_hal.sequence.positions import local_lengths
        mesh, layout = self.mesh, self.layout
        names = mesh.sp_ranks
        cu = batch.cu_seqlens if batch is not None else None
        values = [local_len, pos_digest, batch.digest if batch is not None else 0,
                  _seq_digest(list(cu)) if cu else 0, batch.seqlen if batch is not None else -1, int(batch is not None)]

        def check(rows) -> Optional[str]:
            if len({r[5] for r in rows}) > 1:
                return ("some ranks called the model with prepare_inputs' attention_masks and some without ("
                        + ", ".join(f"rank {names[i]}: {'yes' if r[5] else 'no'}" for i, r in enumerate(rows))
                        + "); every rank must make the same call")
            if len({(r[2], r[3], r[4]) for r in rows}) > 1:
                return ("the ranks of the sequence-parallel group passed different batches to prepare_inputs (each "
                        "rank of a group must pass the same whole batch: tokens and positions; data parallel "
                        "replicas, not the sequence-parallel ranks, take different batches)")
            lengths = [r[0] for r in rows]
            seqlen = batch.seqlen if batch is not None else sum(lengths)
            table = local_lengths(layout, seqlen, mesh.ring_degree, mesh.ulysses_degree, cu_seqlens=cu)
            expect = [table[mesh.ring_of(i)][mesh.ulysses_of(i)] for i in range(mesh.sp_size)]
            if lengths != expect:
                return (f"the ranks hold {lengths} tokens, not the {layout!r} layout's {expect} for S={seqlen}; "
                        f"shard with prepare_inputs(model, ...) (apply_usp's layout is {layout!r})")
            want = self._expected_digests(seqlen, cu)
            wrong = [names[i] for i, r in enumerate(rows) if r[1] != want[i]]
            if wrong:
                what = "per-document positions" if cu else "positions"
                return (f"rank(s) {wrong} passed other {what} than the {layout!r} layout gives their tokens for "
                        f"S={seqlen} (apply_usp's layout is {layout!r}; tokens sharded with another layout would be "
                        "attended in the wrong order): shard tokens, labels and positions together with "
                        f"prepare_inputs(model, tokens, labels, positions=...), or by hand with usp_hal.shard(x, "
                        f"layout={layout!r}) and local_positions(mesh, S, B, {layout!r})")
            return None
        agree(problem, mesh.metadata_group, what=_WHAT, where=mesh.where("sequence-parallel"),
              values=[] if problem is not None else values, width=len(values), ranks=names, check=check)


# ----------------------------------------------------------------------------- the inner attention
def _usp_forward(attn, name: str, window: Tuple[int, int]):
    def forward(q, k, v, *, attention_masks=None, scale: Optional[float] = None, enable_gqa: bool = False,
                is_causal: bool = True, score_mod=None, out_transform=None, **_):
        cu = None
        if isinstance(attention_masks, ShardedBatch):
            cu = list(attention_masks.cu_seqlens) if attention_masks.cu_seqlens is not None else None
        elif attention_masks is not None or score_mod is not None:
            raise NotImplementedError(
                f"apply_usp (layers.{name}): attention_masks/score_mod are built over this rank's tokens only; call "
                "the model with attention_masks=None (usp-hal attends causally over the global sequence) or with "
                "prepare_inputs(model, ...)'s attention_masks (packed documents)")
        docs = {} if cu is None else {"cu_seqlens": cu}
        if out_transform is None:
            return attn(q, k, v, softmax_scale=scale, causal=is_causal, window_size=window, **docs)
        sinks = _sinks_of(out_transform)
        if sinks is None:
            raise NotImplementedError(
                f"apply_usp (layers.{name}): an out_transform other than gpt-oss's sink rescaling "
                f"({getattr(out_transform, '__qualname__', out_transform)!r}): it would need the gradient of the "
                "lse, which usp-hal's attention does not return")
        # gpt-oss's out * sigmoid(lse - sink) is softmax with exp(sink) in the denominator: usp-hal's sinks=
        return attn(q, k, v, softmax_scale=scale, causal=is_causal, window_size=window, sinks=sinks, **docs)
    return forward


def _sinks_of(out_transform) -> Optional[torch.Tensor]:
    """The per-head sink logits behind gpt-oss's ``Attention._apply_sinks`` (this TP rank's
    heads, as its own hook takes them: torchtitan/models/gpt_oss/model.py), else None."""
    owner = getattr(out_transform, "__self__", None)
    sinks = getattr(owner, "sinks", None)
    if getattr(out_transform, "__name__", "") != "_apply_sinks" or not isinstance(sinks, torch.Tensor):
        return None
    to_local = getattr(sinks, "to_local", None)
    return to_local(grad_placements=sinks.placements) if to_local is not None else sinks  # type: ignore[attr-defined]
