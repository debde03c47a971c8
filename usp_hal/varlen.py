"""Packed sequences: several documents in one sequence, attention kept inside each document.

A packed batch is described by its global document boundaries ``cu_seqlens``: the
cumulative lengths ``[0, l1, l1+l2, ..., S]`` (FlashAttention's convention), as an
integer tensor or a list, the same on every rank and for every batch row.  Queries see
only keys of their own document; causal, window, softcap, alibi and GQA apply inside each
document as they would to that document alone (positions restart at 0 per document, and
every mask depends only on differences of positions, so global positions serve as well).

How the core runs it (no dense mask anywhere):

* the layout gives each ring rank its positions (``usp_hal.layout``); ``varlen_zigzag``
  splits every document zigzag-wise over the ring, the stream layouts (basic, zigzag,
  stripe) split the packed stream as if it were one sequence;
* the block plan (``usp_hal.blocks.plan_blocks``) cuts each block's segments at the document
  boundaries (:func:`split_documents`) and pairs only pieces of the same document, so a
  kernel never sees two documents and a (query, key) block pair that shares no document
  costs nothing;
* when no document spans two ring ranks, no ring rank needs another's keys, and the ring
  exchanges nothing at all (:func:`ring_is_local`).

Helpers for models: :func:`document_positions` (position ids for RoPE, restarting at 0 per
document), :func:`document_ids`, and ``mesh.local_position_ids(S, layout, cu_seqlens=...)``.

Where the code lives: the document boundaries (:func:`as_cu_seqlens`, :func:`split_documents`,
:func:`ring_is_local`, :func:`document_ids`, ...) are pure position code in
``usp_hal.positions``, re-exported here; the block plan of every ring rank x source block is
``usp_hal.blocks`` (:func:`~usp_hal.blocks.block_plans`); this module adds per-rank summaries
of it (:func:`ring_work`, :func:`ring_calls`, :func:`work_balance`, :func:`call_work`) and the
float64 packed reference.
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from .blocks import balance, block_plans, call_work
from .positions import (
    CuSeqlens,
    as_cu_seqlens,
    cu_seqlens_from_lengths,
    document_ids,
    document_positions,
    documents_of,
    equal_documents,
    is_single_document,
    num_documents,
    ring_is_local,
    ring_segments,  # noqa: F401  (importable here, as before)
    split_by_documents,
    split_documents,
)
from .reference import reference_attention


def ring_work(layout, seqlen: int, ring_size: int, *, causal: bool = True,
              cu_seqlens=None) -> List[int]:
    """Per ring rank: the query-key pairs its kernels score over every block of the ring
    (per batch row and head), from the block plan alone (:func:`usp_hal.blocks.block_plans`)."""
    return list(block_plans(layout, seqlen, ring_size, causal=causal, cu_seqlens=cu_seqlens).work)


def ring_calls(layout, seqlen: int, ring_size: int, *, causal: bool = True, cu_seqlens=None,
               packed: bool = False) -> List[int]:
    """Per ring rank: the kernel calls of one forward over every block of the ring, from the
    block plan alone; ``packed``: as a backend with a varlen entry point runs them (each
    step's calls packed per kind, :func:`usp_hal.ring.pack_calls`)."""
    return list(block_plans(layout, seqlen, ring_size, causal=causal, cu_seqlens=cu_seqlens).kernel_calls(packed))


def work_balance(work: Sequence[int]) -> float:
    """max / min over ranks (inf when a rank has nothing while another has work)."""
    if max(work) == 0:
        return 1.0
    got = balance(work)
    return float("inf") if got is None else got


def reference_packed_attention(q, k, v, cu_seqlens, **kw):
    """Float64 single-process attention of every document on its own, concatenated:
    the truth a packed USP call is compared against (``usp_hal.reference``, per document).
    ``kw``: the arguments of :func:`usp_hal.reference.reference_attention`."""
    cu = as_cu_seqlens(cu_seqlens, q.shape[1])
    parts = [reference_attention(q[:, a:b], k[:, a:b], v[:, a:b], **kw) for a, b in zip(cu, cu[1:])]
    return torch.cat([o for o, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=2)


__all__ = ["CuSeqlens", "num_documents", "is_single_document", "documents_of", "as_cu_seqlens",
           "cu_seqlens_from_lengths", "equal_documents", "split_documents", "ring_is_local",
           "call_work", "ring_work", "work_balance", "document_ids", "document_positions", "split_by_documents",
           "reference_packed_attention"]
