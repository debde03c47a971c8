"""Recognising the mask transformers asks for: the mask function registered with
``AttentionMaskInterface`` (:func:`usp_mask`) builds no mask, it walks the mask function the
model's mask creation hands it and reports what it is (:class:`MaskInfo`: causal or
bidirectional, a sliding window, or why it cannot be honoured); the attention function applies
causality and windows itself.

Mask functions are recognised by ``__qualname__`` (the table below) and read through their
closures; both are internal to transformers and were read from the release in
:data:`TESTED_VERSIONS` (``src/transformers/masking_utils.py``).  A name that is not in the
table is refused, never guessed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

#: the transformers releases the mask-function table below was read from and tested with
TESTED_VERSIONS = ("5.23.0",)


@dataclass(frozen=True)
class MaskInfo:
    """What the model's mask creation asked for, handed to the attention function in place
    of a mask tensor: causal or not, a sliding window, or the reason it cannot be honoured."""

    causal: bool = True
    sliding_window: Optional[int] = None
    refused: Optional[str] = None


# the ``__qualname__`` of the mask functions (and their wrappers) of transformers 5.23.0 (TESTED_VERSIONS)
_CAUSAL, _BIDIRECTIONAL = "causal_mask_function", "bidirectional_mask_function"
_WINDOW_CAUSAL = "sliding_window_overlay.<locals>.inner_mask"
_WINDOW_BIDIRECTIONAL = "sliding_window_bidirectional_overlay.<locals>.inner_mask"
# transformers wraps the mask function when position_ids are not 0, 1, 2, ... ("packed
# sequences"); sharded positions look like that.  Real packing is refused by the position check.
_PACKED = ("packed_sequence_mask_function.<locals>.inner_mask",
           "remap_positions_for_packed_sequence.<locals>.inner_mask")
_AND = "and_masks.<locals>.and_mask"


def _closure(fn) -> Dict[str, Any]:
    cells = getattr(fn, "__closure__", None) or ()
    return {name: c.cell_contents for name, c in zip(fn.__code__.co_freevars, cells)}


def _describe_mask_function(fn, found: dict) -> Optional[str]:
    """Walk a transformers mask function; return why it cannot be honoured, or None.
    Only patterns known to be plain causal / bidirectional / sliding window are accepted:
    anything else (an unknown name, a union, chunked or block masks) is refused."""
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if name == _CAUSAL:
        found.setdefault("causal", set()).add(True)
        return None
    if name == _BIDIRECTIONAL:
        found.setdefault("causal", set()).add(False)
        return None
    if name in (_WINDOW_CAUSAL, _WINDOW_BIDIRECTIONAL):
        w = _closure(fn).get("sliding_window")
        if not isinstance(w, int):
            return f"a sliding window of unknown size ({name})"
        if name == _WINDOW_BIDIRECTIONAL:
            return ("a bidirectional sliding window (transformers' masks and kernels count it differently; "
                    "use a causal sliding window or full attention)")
        found.setdefault("window", set()).add(w)
        return None
    if name in _PACKED:
        inner = _closure(fn).get("mask_function")
        return None if inner is None else _describe_mask_function(inner, found)
    if name == _AND:
        for sub in _closure(fn).get("mask_functions", ()):
            why = _describe_mask_function(sub, found)
            if why:
                return why
        return None
    return f"the custom mask pattern {name!r} (only causal, bidirectional and causal sliding-window masks)"


# Under torch.compile, Dynamo traces the mask interface; traced, a function's ``__qualname__``
# and closure cells are not what the walk above reads (a traced hybrid model's mask function
# read as 'function' and was refused), so the walk always runs eagerly (one graph break per
# mask built, beside the attention call's own).
_describe_mask_function = torch.compiler.disable(_describe_mask_function, recursive=True)


def usp_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
             attention_mask=None, use_vmap=False, **kwargs) -> MaskInfo:
    """The mask function registered with transformers' ``AttentionMaskInterface``.

    It builds no mask: the attention function applies causality and windows itself.  It
    returns a :class:`MaskInfo` saying what was asked for; refusals are raised by the
    attention function, on every rank together."""
    if attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()):
        return MaskInfo(refused=_DIRECT_PADDING)
    if use_vmap:
        return MaskInfo(refused="a custom mask pattern (or_mask_function/and_mask_function overlays)")
    found: dict = {}
    why = _describe_mask_function(mask_function, found) if mask_function is not None else None
    if why:
        return MaskInfo(refused=why)
    causal = found.get("causal", {True})
    windows = found.get("window", set())
    if len(causal) > 1 or len(windows) > 1:
        return MaskInfo(refused="a mask combining several patterns")
    return MaskInfo(causal=next(iter(causal)), sliding_window=next(iter(windows)) if windows else None)


# refused by usp_mask here and by generate()
_DIRECT_PADDING = ("a padding mask (attention_mask with zeros) given to the model or generate() directly: each rank "
                   "would see its own shard of it only; pass the attention_mask to shard_batch with the batch "
                   "(shard_batch({'input_ids': ids, 'attention_mask': mask}, mesh)), which carries the global "
                   "padding to the attention as a key mask")
