"""Former path of the packed-sequence names: the document boundaries live in
:mod:`usp_hal.sequence.positions`, the per-rank work summaries in :mod:`usp_hal.sequence.blocks`,
the float64 packed reference in :mod:`usp_hal.dispatch.reference`; this module re-exports them."""
from __future__ import annotations

from usp_hal.dispatch.reference import reference_packed_attention
from usp_hal.sequence.blocks import call_work, ring_calls, ring_work, work_balance
from usp_hal.sequence.positions import (
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
    ring_segments,
    split_by_documents,
    split_documents,
)

__all__ = ["CuSeqlens", "num_documents", "is_single_document", "documents_of", "as_cu_seqlens",
           "cu_seqlens_from_lengths", "equal_documents", "split_documents", "ring_is_local",
           "call_work", "ring_calls", "ring_work", "work_balance", "document_ids", "document_positions",
           "split_by_documents", "ring_segments", "reference_packed_attention"]
