"""yunchang's ``EXTRACT_FUNC_DICT`` (yunchang/comm/extract_local.py): the part of a global tensor
a rank holds, by ``ring_impl_type``, over usp-hal's layouts.

The functions follow the default sequence-parallel mesh's placement when there is one (so
``set_seq_parallel_pg(..., use_ulysses_low=False)`` is honoured), which is why they live here
and not beside the pure position code they call (:mod:`usp_hal.sequence.positions`).

:data:`EXTRACT_FUNC_DICT` is a view of the layout table: every registered layout
(:func:`usp_hal.sequence.positions.register_layout`, now or later) is a key, under its own name,
its ``yunchang_name`` and yunchang's other ring names for it (``LAYOUT_ALIASES``: "strip",
"basic_pytorch", ...).  An entry assigned here takes precedence over the layout's function.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterator, MutableMapping, Optional, Tuple

from ..parallel.mesh import current_default_mesh
from ..sequence.positions import LAYOUT_ALIASES, LAYOUTS, local_positions

__all__ = ["EXTRACT_FUNC_DICT", "extract_ranks"]


def extract_ranks(rank: int, rd: int, ud: int, use_ulysses_low: Optional[bool] = None) -> Tuple[int, int]:
    """``(ring_rank, ulysses_rank)`` of sequence-parallel rank ``rank`` (or a global rank: replicas
    are ``rd * ud`` consecutive ranks) under the placement ``use_ulysses_low``.

    ``None``: the placement of the default mesh (``set_seq_parallel_pg`` /
    ``init_sequence_parallel``) when its degrees are ``ud`` x ``rd`` (this process's own rank
    then reads the mesh's own ring and Ulysses ranks, as yunchang's ``zigzag_extract_local``
    reads its groups'); yunchang's default placement (Ulysses ranks consecutive) without one."""
    default = current_default_mesh()
    if default is not None and (default.ulysses_degree, default.ring_degree) != (ud, rd):
        default = None
    if use_ulysses_low is None:
        if default is not None and rank == default.rank:
            return default.ring_rank, default.ulysses_rank
        use_ulysses_low = True if default is None else default.use_ulysses_low
    sp = rank % (rd * ud)
    if use_ulysses_low:
        return sp // ud, sp % ud
    return sp % rd, sp // rd


def _yunchang_extract(layout: str) -> Callable:
    keep_graph = layout != "basic"      # yunchang's basic_extract_local detaches; zigzag/strip ones do not

    def extract(value, rank, world_size, rd=None, ud=None, dim=1, *args, cu_seqlens=None,
                use_ulysses_low: Optional[bool] = None, **kwargs):
        """yunchang-compatible: ``value`` is global along ``dim``; returns the part rank ``rank``
        holds.  ``rd``/``ud``: ring and Ulysses degrees (``rd * ud == world_size``; without them,
        as yunchang's ``basic_extract_local(value, rank, world_size)`` allows, the default mesh's,
        else a ring of ``world_size``).  The placement of ``rank`` in the ring x Ulysses grid is
        the default mesh's (so ``set_seq_parallel_pg(..., use_ulysses_low=False)`` is honoured),
        or ``use_ulysses_low`` when given (see :func:`extract_ranks`).  ``cu_seqlens``: document
        boundaries of a packed ``value``."""
        if rd is None or ud is None:
            default = current_default_mesh()
            if rd is None and ud is None and default is not None and default.sp_size == world_size:
                rd, ud = default.ring_degree, default.ulysses_degree
            elif rd is None and ud is None:
                rd, ud = world_size, 1
            else:
                raise ValueError(f"{layout}_extract_local: give both rd and ud (got rd={rd}, ud={ud})")
        if rd * ud != world_size:
            raise ValueError(f"ring degree {rd} x ulysses degree {ud} != world size {world_size}")
        default = current_default_mesh()
        if (default is not None and default.sp_size == world_size
                and (default.ring_degree, default.ulysses_degree) != (rd, ud)):
            # the attention runs on the mesh's split: a shard cut for another one (e.g. rd and ud
            # swapped) would be silently wrong
            raise ValueError(f"{layout}_extract_local: rd={rd}, ud={ud} contradict the sequence-parallel mesh "
                             f"(ring degree {default.ring_degree}, ulysses degree {default.ulysses_degree}); pass "
                             f"rd={default.ring_degree}, ud={default.ulysses_degree}, or leave both out to use the "
                             "mesh's")
        ring_rank, ulysses_rank = extract_ranks(rank, rd, ud, use_ulysses_low)
        pos = local_positions(layout, value.shape[dim], rd, ud, ring_rank, ulysses_rank,
                              cu_seqlens=cu_seqlens).to(value.device)
        local = value.index_select(dim, pos)
        return local if keep_graph else local.detach().clone()
    extract.__name__ = extract.__qualname__ = f"{layout}_extract_local"
    return extract


class ExtractFuncs(MutableMapping):
    """``EXTRACT_FUNC_DICT``: ring name -> extract function, read from the layout table at each
    lookup (one function object per layout, made on first use)."""

    def __init__(self) -> None:
        self._made: Dict[str, Callable] = {}        # layout name -> its function
        self._own: Dict[str, Callable] = {}         # entries assigned here

    def _layout(self, key: str) -> Optional[str]:
        """The registered layout a key names (its name, its yunchang name, a yunchang alias), or None."""
        if key in LAYOUTS:
            return key
        for lay in LAYOUTS.values():
            if lay.yunchang_name == key:
                return lay.name
        alias = LAYOUT_ALIASES.get(key)
        return alias if alias in LAYOUTS else None

    def __getitem__(self, key: str) -> Callable:
        if key in self._own:
            return self._own[key]
        name = self._layout(key) if isinstance(key, str) else None
        if name is None:
            raise KeyError(key)
        fn = self._made.get(name)
        if fn is None:
            fn = self._made[name] = _yunchang_extract(name)
        return fn

    def __setitem__(self, key: str, fn: Callable) -> None:
        self._own[key] = fn

    def __delitem__(self, key: str) -> None:
        if key in self._own:
            del self._own[key]
            return
        if self._layout(key) is not None:
            raise KeyError(f"{key!r} is a registered layout's extract function: remove the layout from LAYOUTS "
                           "instead")
        raise KeyError(key)

    def _keys(self) -> Dict[str, None]:
        keys: Dict[str, None] = {}
        for lay in LAYOUTS.values():
            keys[lay.name] = None
            if lay.yunchang_name:
                keys[lay.yunchang_name] = None
        for alias, name in LAYOUT_ALIASES.items():
            if name in LAYOUTS:
                keys[alias] = None
        keys.update(dict.fromkeys(self._own))
        return keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k!r}: {getattr(self[k], '__name__', self[k])}" for k in self) + "}"


EXTRACT_FUNC_DICT = ExtractFuncs()
