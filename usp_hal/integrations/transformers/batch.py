"""A global batch as this rank's share (:func:`shard_batch`), and what travels with it to the
attention function: the mark that a call came through shard_batch (``SHARDED_ATTR`` on the
returned position ids), the global padding (:class:`Padding`, ``PADDING_ATTR``) and the packed
documents' boundaries (``cu_seq_lens_q/k``)."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

import usp_hal
from usp_hal.parallel.comm import agree, digest_ints

DEFAULT_LAYOUT = "zigzag"
IGNORE_INDEX = -100
SHARDED_ATTR = "_usp_hal_sharded"   # set by shard_batch on the position_ids it returns
PADDING_ATTR = "_usp_hal_padding"   # a Padding, set by shard_batch on those position_ids for a padded batch


class Padding:
    """The padding of a batch given to :func:`shard_batch` with an ``attention_mask`` that has
    zeros: ``keep`` ``[B, S]`` (bool, global, the same on every rank: shard_batch checks) says
    which keys every row attends.  ``mask`` is that as a :class:`usp_hal.sequence.masks.Mask` over global
    positions (per row), and'ed by the attention with causality and windows; ``left`` holds
    each row's number of leading pads when every row is left-padded (zeros, then ones), else
    None.  It travels with the position_ids shard_batch returns (attribute ``PADDING_ATTR``)."""

    def __init__(self, keep: torch.Tensor):
        from usp_hal.sequence.masks import Mask
        self.keep = keep = keep.detach().bool().contiguous()
        bsz, seqlen = keep.shape
        ones = keep.sum(1)
        self.empty_rows = [b for b in range(bsz) if int(ones[b]) == 0]
        lead = (seqlen - ones).tolist()
        idx = torch.arange(seqlen, device=keep.device).view(1, -1)
        is_left = bool((keep == (idx >= (seqlen - ones).view(-1, 1))).all())
        self.left = [int(x) for x in lead] if is_left else None

        def padding_mod(b, h, q_idx, kv_idx):
            return keep.to(kv_idx.device)[b, kv_idx]
        self.mask = Mask.from_mod(padding_mod, batch=int(bsz), name="padding")

    def positions(self, index_positions: torch.Tensor) -> torch.Tensor:
        """generate()'s position ids of a left-padded prompt (transformers: ``cumsum(mask) - 1``,
        0 on the pads) from the tokens' global indices ``[B|1, n]``."""
        assert self.left is not None
        lead = torch.tensor(self.left, dtype=index_positions.dtype, device=index_positions.device).view(-1, 1)
        return (index_positions - lead).clamp(min=0)


# A call is sequence-parallel only when its batch came through shard_batch (its position_ids
# carry SHARDED_ATTR).  Any other call raises at once, on this rank, before any collective: the
# other ranks may not be calling at all (evaluation on rank 0 alone), and attention over this
# rank's tokens only would be silently wrong if the batch was a shard.
_OUTSIDE = ("usp_hal attention (transformers): this {what} did not come through shard_batch (its position_ids "
            "are not the ones shard_batch returns; a copy, e.g. by .to(device), is not: move the batch before "
            "shard_batch), so it is not a sequence-parallel call and usp_hal enters no "
            "collective for it. On every rank of the group pass model(**shard_batch(batch, mesh)); under a "
            "transformers or TRL Trainer, which calls the model itself, train with "
            "usp_hal.integrations.training.trainer.USPTrainer, or for TRL's trainers usp_hal.integrations.trl "
            "(USPSFTTrainer, USPDPOTrainer, usp_trainer(SFTTrainer)), which shard every batch; to run the "
            "model on one rank or on whole sequences, switch its attention back first: "
            "model.set_attn_implementation('sdpa') (and back to the usp_hal name afterwards)")


def _packing(cu_q, cu_k):
    """``(boundaries, None)`` for a packed self-attention call (``cu_seq_lens_q`` as a tuple:
    one host copy of each, and shard_batch gives CPU tensors), ``(None, why)`` when the pair
    cannot be used, ``(None, None)`` without packing."""
    from usp_hal.sequence.positions import as_cu_seqlens
    if cu_q is None and cu_k is None:
        return None, None
    if cu_q is None or cu_k is None:
        return None, "only one of cu_seq_lens_q / cu_seq_lens_k (packed self-attention needs both, equal)"
    try:
        a, b = as_cu_seqlens(cu_q), as_cu_seqlens(cu_k)
    except (TypeError, ValueError) as exc:
        return None, f"cu_seq_lens_q/k: {exc}"
    if a != b:
        return None, "cu_seq_lens_q differs from cu_seq_lens_k (packed cross-attention is not supported)"
    return a, None


_SEQ_KEYS = ("input_ids", "inputs_embeds", "token_type_ids")


def shard_batch(batch: Dict[str, Any], mesh=None, layout: str = DEFAULT_LAYOUT, *, cu_seqlens=None,
                ignore_index: int = IGNORE_INDEX, check: bool = True, dp_group=None) -> Dict[str, Any]:
    """This rank's share of a global batch, ready for ``model(**batch)``.

    Every rank of the sequence-parallel group passes the same global batch (``[B, S]`` tensors).
    Returns ``input_ids`` (or ``inputs_embeds``, ``token_type_ids``) sharded in ``layout``;
    ``position_ids``: this rank's global positions, for RoPE; ``labels`` and ``shift_labels``:
    the labels shifted by one over the *global* sequence (then sharded), so the last token of
    each shard predicts the first token of the next one; ``num_items_in_batch``: the global
    number of labels that count (not ``ignore_index``), so that each rank's loss is its share
    of the loss of the whole sequence (sum them with :func:`sync_gradients`).

    Packed sequences: ``cu_seqlens`` (the global document boundaries ``[0, l1, l1+l2, ..., S]``,
    shared by every row), or ``cu_seq_lens_q``/``cu_seq_lens_k`` in the batch, or
    ``position_ids`` restarting at 0 at every document.  The batch is then sharded with those
    boundaries (``layout="varlen_zigzag"`` balances causal work per document), ``position_ids``
    restart per document, the label of each document's last token (which would predict the
    next document) is ``ignore_index``, and ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32, CPU)
    carry the boundaries to the attention function.

    ``dp_group``: the data-parallel group (``mesh.dp_group``; every replica passes its own
    batch).  ``num_items_in_batch`` is then the non-ignored labels of *every* replica's batch
    divided by the number of replicas (one all-reduce of one integer), so that the mean over
    replicas that :func:`sync_gradients` takes for a plain module (and DDP or FSDP2 for theirs)
    gives the loss and gradients of one process on the replicas' batches together, also when
    the replicas hold different numbers of labels.  Without it each replica's loss is the mean
    over its own labels, and the mean of those means is what the step gets.

    ``attention_mask`` (``[B, S]``, 0 = padding): one of all ones is dropped.  One with padding
    (any pattern: left, right, or both in one batch) is not returned either: the global mask
    travels with the returned ``position_ids`` (a :class:`Padding`) to the attention function,
    which excludes the padded keys for every query (a per-row key mask over global positions,
    and'ed with causality and windows), as transformers does with a 2-D mask; positions stay
    ``0..S-1`` as in a transformers forward without ``position_ids``.  The outputs of a query
    that sees no key (a left pad) are 0 attention (transformers' kernels disagree there: label
    such positions -100).  ``generate()`` takes left-padded prompts this way (see the module
    doc).  Not with packed documents.  ``seq_idx`` (the document index of every token, from TRL's
    padding-free collator) is sharded like the tokens.  Other tensors are refused rather than passed through
    unsharded.  ``check`` (one small all-gather)
    verifies that every rank passed the same batch.
    """
    mesh = mesh if mesh is not None else usp_hal.get_default_mesh()
    problem: Optional[BaseException] = None
    plan = None
    try:
        plan = _batch_plan(batch, layout, cu_seqlens, ignore_index)
        from usp_hal.parallel.sharding import empty_rank_problem
        short = empty_rank_problem(mesh, layout, plan[4], plan[5])
        if short:
            raise ValueError(f"shard_batch: {short}")
    except (TypeError, ValueError) as exc:
        problem = exc
    if check and mesh.sp_size > 1:
        # every rank's local checks and its batch's fingerprint, in one small all-gather: a bad
        # or different batch on any rank raises on every rank (none is left in a collective)
        agree(problem, mesh.metadata_group, what="shard_batch", where=mesh.where("sequence-parallel"),
              values=_batch_prints(plan) if plan is not None else (), width=3, ranks=mesh.sp_ranks,
              check=lambda rows: _different_batches(rows, plan))
    elif problem is not None:
        raise problem
    assert plan is not None
    batch, main, seq_keys, bsz, seqlen, cu, shifted, out, padding = plan

    def sh(x):
        return usp_hal.shard(x, layout=layout, mesh=mesh, seq_dim=1, cu_seqlens=cu)

    for k in seq_keys:
        out[k] = sh(batch[k])
    positions = mesh.local_position_ids(seqlen, layout, device=batch[main].device, cu_seqlens=cu)
    out["position_ids"] = positions.unsqueeze(0).expand(bsz, -1).contiguous()
    setattr(out["position_ids"], SHARDED_ATTR, True)     # what makes a model call sequence-parallel
    if padding is not None:       # the global padding, for the attention (a key mask) and generate()
        setattr(out["position_ids"], PADDING_ATTR, padding)
    if cu is not None:
        bounds = torch.tensor(cu, dtype=torch.int32)
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = bounds
    if batch.get("seq_idx") is not None:     # per token, like the positions: this rank's tokens' documents
        out["seq_idx"] = sh(batch["seq_idx"])
    if shifted is not None:
        local = sh(shifted)
        out["labels"] = local           # the model computes a loss only when labels are given ...
        out["shift_labels"] = local     # ... and uses these as they are (already shifted)
        out["num_items_in_batch"] = int((shifted != ignore_index).sum())
    if dp_group is not None:
        total = _global_count(out.get("num_items_in_batch"), dp_group, batch[main].device)
        if total is not None:
            out["num_items_in_batch"] = total
    return out


def _global_count(count: Optional[int], dp_group, device):
    """The label count of every replica's batch over the replicas (see shard_batch's ``dp_group``)."""
    import torch.distributed as dist

    from usp_hal.parallel.comm import collective
    replicas = dist.get_world_size(dp_group)
    total = torch.tensor([-1 if count is None else count, 1 if count is None else 0], dtype=torch.int64,
                         device=device)
    collective("all-reduce of the label count", "data-parallel group", dist.all_reduce, total, group=dp_group)
    missing = int(total[1])
    if missing == replicas:
        return None
    if missing:
        raise ValueError("shard_batch: dp_group= counts the labels of every replica's batch, but "
                         f"{missing} of the {replicas} replicas passed a batch without labels")
    return int(total[0]) / replicas


def _batch_plan(batch, layout: str, cu_seqlens, ignore_index: int):
    """The local checks of :func:`shard_batch` (ValueError/TypeError naming the problem), and
    what it shards: ``(batch, main key, sequence keys, B, S, cu, shifted labels, passed-through)``."""
    from usp_hal.sequence.positions import check_layout, document_positions
    check_layout(layout)
    if not isinstance(batch, dict) and hasattr(batch, "keys"):
        batch = dict(batch)
    if not isinstance(batch, dict):
        raise TypeError(f"shard_batch: expected a dict of tensors, got {type(batch).__name__}")
    seq_keys = [k for k in _SEQ_KEYS if batch.get(k) is not None]
    main = "input_ids" if batch.get("input_ids") is not None else "inputs_embeds"
    if batch.get(main) is None:
        raise ValueError("shard_batch: the batch has neither input_ids nor inputs_embeds")
    ref = batch[main]
    if ref.dim() < 2:
        raise ValueError(f"shard_batch: {main} must be [batch, seq{', hidden' if main == 'inputs_embeds' else ''}], "
                         f"got shape {tuple(ref.shape)}")
    bsz, seqlen = int(ref.shape[0]), int(ref.shape[1])
    out: Dict[str, Any] = {}
    padding: Optional[Padding] = None
    cu = _batch_boundaries(batch, cu_seqlens, bsz, seqlen)
    for k, v in batch.items():
        if k in seq_keys or k in ("labels", "shift_labels", "attention_mask", "position_ids", "seq_idx") \
                or k in _PACKING_KEYS:
            continue
        if isinstance(v, torch.Tensor):
            raise ValueError(f"shard_batch: don't know how to shard the tensor {k!r} {tuple(v.shape)}; shard it "
                             "yourself with usp_hal.shard(x, layout, mesh, seq_dim=...) or leave it out")
        out[k] = v
    for k in seq_keys:
        v = batch[k]
        if tuple(v.shape[:2]) != (bsz, seqlen):
            raise ValueError(f"shard_batch: {k} has shape {tuple(v.shape)}, expected [{bsz}, {seqlen}, ...]")
    mask = batch.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != (bsz, seqlen):
            raise ValueError("shard_batch: attention_mask must be a [batch, seq] tensor; custom masks are not "
                             "supported by sequence-parallel attention")
        if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
            seen = sorted(set(mask.reshape(-1).tolist()))[:6]
            raise ValueError(f"shard_batch: the attention_mask must hold 0 (padding) and 1 (token) only; got values "
                             f"{seen} ({mask.dtype}). Custom masks are not supported through shard_batch")
        if not bool(mask.bool().all()):
            if cu is not None:
                raise ValueError("shard_batch: an attention_mask with padding together with packed documents "
                                 "(cu_seqlens) is not supported; pack without padding")
            padding = Padding(mask)
    pos = batch.get("position_ids")
    if pos is not None:
        expect = torch.arange(seqlen, device=pos.device)
        if cu is not None:
            expect = document_positions(expect, cu)
        if not bool((pos.reshape(-1, pos.shape[-1]) == expect).all()):
            raise ValueError("shard_batch: position_ids other than 0..S-1 (or, for packed sequences, 0.. in every "
                             "document of cu_seqlens) are not supported; leave position_ids out and shard_batch "
                             "makes them")
    _check_seq_idx(batch.get("seq_idx"), bsz, seqlen, cu)
    shifted = batch.get("shift_labels")
    if shifted is None and batch.get("labels") is not None:
        labels = batch["labels"]
        if tuple(labels.shape) != (bsz, seqlen):
            raise ValueError(f"shard_batch: labels have shape {tuple(labels.shape)}, expected [{bsz}, {seqlen}] "
                             "(token labels of a causal LM)")
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)
        if cu is not None:      # a document's last token does not predict the next document
            ends = torch.tensor([e - 1 for e in cu[1:] if e > 0], dtype=torch.long, device=shifted.device)
            shifted = shifted.index_fill(1, ends, ignore_index)
    if shifted is not None and tuple(shifted.shape) != (bsz, seqlen):
        raise ValueError(f"shard_batch: shift_labels have shape {tuple(shifted.shape)}, expected [{bsz}, {seqlen}]")
    return batch, main, seq_keys, bsz, seqlen, cu, shifted, out, padding


_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _brief(xs: list) -> str:
    """A list of ints for an error message: the first four and the last two when long."""
    if len(xs) <= 8:
        return str(xs)
    return "[" + ", ".join(map(str, xs[:4])) + ", ..., " + ", ".join(map(str, xs[-2:])) + "]"


def _check_seq_idx(seq_idx, bsz: int, seqlen: int, cu) -> None:
    """``seq_idx`` (``[1|B, S]``): the document index of every token, as TRL's padding-free
    collator (trl 1.16, trainer/sft_trainer.py, ``DataCollatorForLanguageModeling``) and
    transformers' ``DataCollatorWithFlattening(return_seq_idx=True)`` add it for the short
    convolutions of linear-attention layers.  It is per token like ``position_ids``, so
    :func:`shard_batch` shards it with the batch's layout; it must name the documents of the
    batch's boundaries (0 everywhere for one sequence per row), or the shards would disagree
    with the boundaries the attention gets."""
    if seq_idx is None:
        return
    if not isinstance(seq_idx, torch.Tensor) or seq_idx.dim() != 2 or seq_idx.shape[0] not in (1, bsz) \
            or seq_idx.shape[1] != seqlen or seq_idx.is_floating_point() or seq_idx.is_complex():
        what = tuple(seq_idx.shape) if isinstance(seq_idx, torch.Tensor) else type(seq_idx).__name__
        raise ValueError(f"shard_batch: seq_idx must be an integer [1 or {bsz}, {seqlen}] tensor (the document index "
                         f"of every token), got {what}")
    bounds = cu if cu is not None else (0, seqlen)
    expect = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds).diff())
    if not bool((seq_idx.cpu().to(torch.int64) == expect).all()):
        raise ValueError(f"shard_batch: seq_idx {_brief(seq_idx[0].tolist())} does not number the documents of the "
                         f"batch's boundaries {list(bounds)} (0, 1, ... per document); leave seq_idx out or make it "
                         "match cu_seq_lens_q / the position_ids")


def _batch_boundaries(batch, cu_seqlens, bsz: int, seqlen: int):
    """The packed batch's global document boundaries (a tuple), or None for one sequence per row."""
    from usp_hal.sequence.positions import as_cu_seqlens
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    found = []
    if cu_seqlens is not None:
        found.append(("cu_seqlens", as_cu_seqlens(cu_seqlens, seqlen)))
    packed, why = _packing(cu_q, cu_k)
    if why:
        raise ValueError(f"shard_batch: {why}")
    if packed is not None:
        found.append(("cu_seq_lens_q", as_cu_seqlens(packed, seqlen)))
    pos = batch.get("position_ids")
    if not found and isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape[-1] == seqlen:
        rows = pos.reshape(-1, seqlen)
        starts = (rows[0] == 0).nonzero().flatten().tolist()
        if len(starts) > 1 and starts[0] == 0 and bool((rows == rows[0]).all()):
            cu = tuple(starts) + (seqlen,)
            found.append(("position_ids", as_cu_seqlens(cu, seqlen)))
    if len({c for _, c in found}) > 1:
        raise ValueError("shard_batch: the document boundaries disagree: "
                         + "; ".join(f"{name} gives {list(c)}" for name, c in found))
    return found[0][1] if found else None


def _fingerprint(t: torch.Tensor) -> int:
    x = t.detach()
    if x.is_floating_point():
        x = x.to(torch.float64).view(torch.int64)
    x = x.reshape(-1).to(torch.int64).cpu()
    if x.numel() == 0:
        return 0
    w = torch.arange(1, x.numel() + 1, dtype=torch.int64) * 1000003 + 12345
    return int((x * w).sum()) ^ int(x.sum())       # int64 arithmetic wraps: a hash, not a number


def _checked_keys(plan) -> list:
    batch, _, seq_keys = plan[:3]
    return seq_keys + [k for k in ("labels", "shift_labels") if batch.get(k) is not None] + \
        (["attention_mask"] if plan[8] is not None else [])


def _batch_prints(plan) -> list:
    """Three ints that every rank of the group must share: the checked keys, their contents
    (fingerprints) and the document boundaries."""
    batch, cu, keys = plan[0], plan[5], _checked_keys(plan)
    return [digest_ints([len(keys)] + [sum(k.encode()) * 131 + len(k) for k in keys]),
            digest_ints([_fingerprint(batch[k]) for k in keys]), digest_ints(cu) if cu is not None else 0]


def _different_batches(rows, plan) -> Optional[str]:
    if all(r == rows[0] for r in rows):
        return None
    keys = _checked_keys(plan)
    what = ("the keys of the batch" if len({r[0] for r in rows}) > 1 else ", ".join(keys)) + \
        (" or the document boundaries" if plan[5] is not None or any(r[2] for r in rows) else "")
    return ("the ranks of the sequence-parallel group passed different batches "
            f"({what} differ); every rank of the group must pass the same global batch "
            "(give data loaders one shard per data-parallel replica, not per rank)")
