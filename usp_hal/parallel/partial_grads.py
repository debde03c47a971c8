"""Which meshes hold partial gradients: the mark a sequence-parallel backward leaves until the
gradients are reduced over the group.

After ``backward()`` each rank of a sequence-parallel group holds, for every parameter, the
gradient of its own tokens only.  The integrations mark the mesh during backward
(:func:`mark_partial`, from a tensor hook on a sequence-parallel attention output); whatever
reduces the gradients clears it (:func:`mark_synced`: ``sync_gradients`` of the integrations,
:meth:`usp_hal.planning.dynamic.DynamicDegree.sync_gradients`, or a caller that reduces them
itself); the integrations' optimizer-step check reads it (:func:`partial_sources`).  The mark
lives here, below both, so that neither imports the other.  Pure bookkeeping: no collective,
no hook, no tensor.
"""
from __future__ import annotations

from typing import Dict, List

__all__ = ["mark_partial", "mark_synced", "is_partial", "partial_sources"]

_PENDING: Dict[int, str] = {}          # id(mesh) -> where the partial gradients came from


def mark_partial(mesh, where: str) -> None:
    """``mesh`` holds partial gradients, from ``where`` (named in the check's message)."""
    _PENDING[id(mesh)] = where


def mark_synced(mesh=None) -> None:
    """Declare the gradients of ``mesh`` (default: every mesh) reduced, e.g. by your own
    all-reduce over ``mesh.sp_group``."""
    if mesh is None:
        _PENDING.clear()
    else:
        _PENDING.pop(id(mesh), None)


def is_partial(mesh) -> bool:
    """Whether ``mesh`` holds partial gradients not yet reduced."""
    return id(mesh) in _PENDING


def partial_sources() -> List[str]:
    """Where the partial gradients of every marked mesh came from (sorted, each once); empty
    when no mesh holds any."""
    return sorted(set(_PENDING.values()))
