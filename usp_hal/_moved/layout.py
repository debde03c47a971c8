"""Former path of the layout names: they live in :mod:`usp_hal.sequence.positions` (and
``shard``/``unshard`` in :mod:`usp_hal.sharding`); this module re-exports them."""
from __future__ import annotations

from usp_hal.sequence.positions import (
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
from usp_hal.sharding import shard, unshard

__all__ = ["EXTRACT_FUNC_DICT", "LAYOUTS", "Layout", "Segment", "check_layout", "get_layout", "layout_names",
           "local_lengths", "local_positions", "permutation", "register_layout", "ring_segments",
           "segment_positions", "segments_from_positions", "shard_lengths", "shard", "unshard"]
