"""The compat map: every former import path of the package, and where its code lives now.

A former path keeps working until usp-hal :data:`REMOVED_IN`; importing it warns once (a
``DeprecationWarning`` naming the new path and that version).  One mechanism serves them all:

* ``usp_hal/__init__.py`` adds this folder to the package's ``__path__``, so ``import
  usp_hal.comm`` finds ``comm.py`` here; ``usp_hal/integrations/`` keeps its former module
  names (``trainer.py``, ``grads.py``, ...) as files of the same kind.  Each such file is two
  lines: it calls :func:`redirect` with its own name.
* :func:`redirect` looks the name up in :data:`MOVED`, warns, and puts the module of the new
  path in the former one's place in ``sys.modules``: both names are one module object, so an
  attribute set (or monkeypatched) through either is seen through both.
* Two former modules (:data:`SPLIT`) had their names spread over several modules; they become
  modules of those names (the same objects), resolved from the new homes.

docs/architecture.md ("Moved") lists the same table for readers; the repository itself imports
the new paths only (tests/test_hygiene.py checks it).
"""
from __future__ import annotations

import importlib
import sys
import warnings
from types import FrameType
from typing import Dict, Optional

REMOVED_IN = "0.3.0"
"""The first usp-hal version without the former paths."""

MOVED: Dict[str, str] = {
    # 0.1: the layers got folders
    "usp_hal.positions": "usp_hal.sequence.positions",
    "usp_hal.blocks": "usp_hal.sequence.blocks",
    "usp_hal.masks": "usp_hal.sequence.masks",
    "usp_hal.backend": "usp_hal.dispatch.backend",
    "usp_hal.capabilities": "usp_hal.dispatch.capabilities",
    "usp_hal.registry": "usp_hal.dispatch.registry",
    "usp_hal.platform": "usp_hal.dispatch.platform",
    "usp_hal.reference": "usp_hal.dispatch.reference",
    "usp_hal.processor": "usp_hal.dispatch.processor",
    "usp_hal.comm": "usp_hal.parallel.comm",
    "usp_hal.mesh": "usp_hal.parallel.mesh",
    "usp_hal.wire": "usp_hal.parallel.wire",
    "usp_hal.codec": "usp_hal.parallel.codec",
    "usp_hal.heads": "usp_hal.parallel.heads",
    "usp_hal.ulysses": "usp_hal.parallel.ulysses",
    "usp_hal.rotation": "usp_hal.parallel.rotation",
    "usp_hal.ring": "usp_hal.parallel.ring",
    "usp_hal.spec": "usp_hal.pipeline.spec",
    "usp_hal.compiled": "usp_hal.pipeline.compiled",
    "usp_hal.hybrid": "usp_hal.mixers.head_parallel",
    "usp_hal.state_passing": "usp_hal.mixers.state_passing",
    "usp_hal.integrations.hybrid": "usp_hal.integrations.sequence_mixers",
    "usp_hal.integrations.trainer": "usp_hal.integrations.training.trainer",
    "usp_hal.integrations.grads": "usp_hal.integrations.training.grads",
    "usp_hal.integrations.tiled_loss": "usp_hal.integrations.training.tiled_loss",
    # 0.2: choosing a split is one folder; the collectives of shard/unshard joined the data path
    "usp_hal.planner": "usp_hal.planning.planner",
    "usp_hal.schedule": "usp_hal.planning.schedule",
    "usp_hal.dynamic": "usp_hal.planning.dynamic",
    "usp_hal.stepcost": "usp_hal.planning.stepcost",
    "usp_hal.sharding": "usp_hal.parallel.sharding",
}
"""Former module path -> the module's path now (the same module object)."""

_POSITIONS = "usp_hal.sequence.positions"
_BLOCKS = "usp_hal.sequence.blocks"

SPLIT: Dict[str, Dict[str, str]] = {
    "usp_hal.layout": {
        **{name: _POSITIONS for name in (
            "LAYOUTS", "Layout", "Segment", "check_layout", "get_layout", "layout_names", "local_lengths",
            "local_positions", "permutation", "register_layout", "ring_segments", "segment_positions",
            "segments_from_positions", "shard_lengths")},
        "EXTRACT_FUNC_DICT": "usp_hal.compat.extract",
        "shard": "usp_hal.parallel.sharding",
        "unshard": "usp_hal.parallel.sharding",
    },
    "usp_hal.varlen": {
        **{name: _POSITIONS for name in (
            "CuSeqlens", "as_cu_seqlens", "cu_seqlens_from_lengths", "document_ids", "document_positions",
            "documents_of", "equal_documents", "is_single_document", "num_documents", "ring_is_local",
            "ring_segments", "split_by_documents", "split_documents")},
        **{name: _BLOCKS for name in ("call_work", "ring_calls", "ring_work", "work_balance")},
        "reference_packed_attention": "usp_hal.dispatch.reference",
    },
}
"""Former module path -> {name: the module that holds it now}, for the modules whose names
were spread over several modules."""


def new_path(former: str) -> str:
    """Where the code of a former path lives now (one module path, or a description of several)."""
    if former in MOVED:
        return MOVED[former]
    homes = sorted(set(SPLIT[former].values()))
    return ", ".join(homes)


def message(former: str) -> str:
    """The warning a former path gives."""
    return (f"{former} is a former import path: import {new_path(former)} instead "
            f"({former} is removed in usp-hal {REMOVED_IN})")


def _machinery(frame) -> bool:
    """A frame of the import itself: importlib, the package's ``__getattr__``, this map, a former path's file."""
    name = frame.f_globals.get("__name__", "")
    filename = frame.f_code.co_filename.replace("\\", "/")
    return ("importlib" in filename and "_bootstrap" in filename) or filename.endswith("/importlib/__init__.py") or \
        name in ("usp_hal", __name__) or name.startswith(__name__ + ".") or name in MOVED or name in SPLIT


def _warn(text: str) -> None:
    """A DeprecationWarning attributed to the line that imports the former path."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None and _machinery(frame):
        frame = frame.f_back
    if frame is None:
        warnings.warn(text, DeprecationWarning, stacklevel=2)
        return
    scope = frame.f_globals
    warnings.warn_explicit(text, DeprecationWarning, frame.f_code.co_filename, frame.f_lineno,
                           module=scope.get("__name__"), registry=scope.setdefault("__warningregistry__", {}))


def redirect(name: str) -> None:
    """Called by a former path's own file as it is imported (``name``: its ``__name__``): warn,
    then serve the new module under that name."""
    former = name.replace("usp_hal._moved.", "usp_hal.", 1)     # also imported by its file's own name
    _warn(message(former))
    if former in MOVED:
        sys.modules[name] = importlib.import_module(MOVED[former])
        return
    module = sys.modules[name]
    names = SPLIT[former]
    for attr, home in names.items():
        setattr(module, attr, getattr(importlib.import_module(home), attr))
    module.__dict__["__all__"] = list(names)
