"""Sequence layouts: which global positions each rank holds.

A layout assigns each *ring* rank a shard of the global sequence; inside a ring rank's
shard, the Ulysses ranks hold contiguous, as-even-as-possible parts (like
``torch.tensor_split``).  After the Ulysses all-to-all every ring rank therefore holds its
whole layout shard, in order.

Layouts (R = ring degree, any global length S)::

    basic   rank r holds chunk r of R contiguous chunks
    zigzag  2R chunks; rank r holds chunks r and 2R-1-r (balanced causal work)
    stripe  rank r holds positions r, r+R, r+2R, ... (balanced causal work)
    varlen_zigzag
            packed documents (``cu_seqlens``): every document cut into 2R chunks and
            dealt zigzag-wise, chunk pair (j, 2R-1-j) to one rank (balanced causal
            work per document); see :func:`_varlen_zigzag`

    causal work per rank, R = 2, S = 8 (x = computed score)
    basic:  rank0 q0-3 x 10   rank1 q4-7 x 26
    zigzag: rank0 {0,1,6,7}   rank1 {2,3,4,5}   -> 18 each
    stripe: rank0 {0,2,4,6}   rank1 {1,3,5,7}   -> 16 / 20

A shard is described by :class:`Segment` s (arithmetic progressions of positions); the
ring plan (``usp_hal.ring.plan_blocks``) works on segments, so every layout and every
uneven length is exact.

Packed sequences: every function here takes ``cu_seqlens`` (the global document
boundaries, see ``usp_hal.varlen``).  The stream layouts (basic, zigzag, stripe) split the
packed stream as one sequence and ignore the boundaries; a per-document layout
(``varlen_zigzag``) splits each document.  A per-document layout without ``cu_seqlens``
treats the whole sequence as one document.

Where the code lives: the layouts and every position computation are pure functions in
``usp_hal.positions`` (no process group); :func:`shard` and :func:`unshard` are in
``usp_hal.sharding``.  This module re-exports both, under the names it has always had.
"""
from __future__ import annotations

from .positions import (
    EXTRACT_FUNC_DICT,
    LAYOUTS,
    Layout,
    Segment,
    check_layout,
    get_layout,
    layout_names,
    local_lengths,
    local_positions,
    permutation,
    register_layout,
    ring_segments,
    segment_positions,
    segments_from_positions,
    shard_lengths,
)
from .sharding import shard, unshard

__all__ = ["EXTRACT_FUNC_DICT", "LAYOUTS", "Layout", "Segment", "check_layout", "get_layout", "layout_names",
           "local_lengths", "local_positions", "permutation", "register_layout", "ring_segments",
           "segment_positions", "segments_from_positions", "shard_lengths", "shard", "unshard"]
