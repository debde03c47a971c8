"""Count host reads of tensor data and collectives per group while a block runs.

On an accelerator, reading a device tensor's data on the host (``.item()``, ``.tolist()``,
``bool``/``float``/``int`` of a tensor, ``.cpu()``, ``.numpy()``) waits for every kernel queued
before it: a device synchronisation.  On the CPU nothing waits, so such reads cost nothing
there and go unnoticed; :class:`HostReadMeter` counts them anyway, so a CPU run shows what a
GPU would pay.

Two layers catch them:

* the Python methods of ``torch.Tensor`` that read data (:data:`READ_METHODS`) are wrapped
  for the span of the meter, each call recorded with its call site (the first frame outside
  torch and this module);
* a ``TorchDispatchMode`` sees the aten ops that read data on the host whichever code path
  called them (``_local_scalar_dense`` is what ``item``/``bool``/``float``/``int`` become;
  ``nonzero``, ``masked_select``, ``unique`` and ``equal`` have outputs the host must size
  or read): an op issued inside a wrapped method is that method's read, not a second one.

A read of a tensor that a collective on ``side_group`` wrote or sent (the per-call metadata
exchange on a CPU side group) is counted apart as ``side``: on a GPU machine those tensors
live on the host, and reading them waits for the side group's message, not for the device.
Everything else is ``device``.

Collectives are counted per call of a ``torch.distributed`` function (one per
``batch_isend_irecv``), as ``side`` when their group is ``side_group`` and ``device``
otherwise, plus ``c10d`` dispatcher ops issued outside those functions.
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

READ_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "__array__")
READ_OPS = frozenset({"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "_unique", "_unique2",
                      "unique_dim", "unique_consecutive", "equal", "is_nonzero"})
COLLECTIVES = ("all_to_all_single", "all_gather_single", "all_to_all", "batch_isend_irecv", "all_gather",
               "all_gather_into_tensor", "all_gather_object", "reduce_scatter_tensor", "reduce_scatter", "all_reduce",
               "broadcast", "broadcast_object_list", "barrier", "gather", "scatter")
# not wrapped: isend/irecv/send/recv (P2POp checks their identity); a bare one is a c10d op

_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def first_call_kwargs() -> dict:
    """The LongContextAttention keywords for 'check the ranks at the first call only': this
    tree's ``static_shapes=True``, or ``check_ranks="first_call"`` where that replaced it."""
    import inspect

    from ..attention import LongContextAttention
    params = inspect.signature(LongContextAttention.__init__).parameters
    return {"static_shapes": True} if "static_shapes" in params else {"check_ranks": "first_call"}


def _site() -> str:
    """``file:line`` of the innermost frame outside torch and this module."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if path == _HERE or path.startswith(_TORCH_DIR):
            continue
        parts = path.split(os.sep)
        short = os.sep.join(parts[parts.index("usp_hal"):]) if "usp_hal" in parts else os.path.basename(path)
        return f"{short}:{frame.lineno}"
    return "?"


def _tensors(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []


def _storage_key(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:
        return None


def _group_of(name: str, args, kwargs) -> Any:
    if "group" in kwargs:
        return kwargs["group"]
    if name == "batch_isend_irecv" and args and args[0]:
        return getattr(args[0][0], "group", None)
    for a in args:
        if isinstance(a, dist.ProcessGroup):
            return a
    return None


class HostReadMeter(TorchDispatchMode):
    """Counts host reads of tensor data and collectives while active (see the module doc).

    ``reads``: {"device": n, "side": n}; ``sites``: {"kind file:line what": n};
    ``collectives``: {"device": n, "side": n}; ``coll_names``: {"side all_gather": n, ...}.
    """

    def __init__(self, side_group=None):
        super().__init__()
        self.side_group = side_group
        self.reads: Dict[str, int] = {"device": 0, "side": 0}
        self.sites: Dict[str, int] = {}
        self.collectives: Dict[str, int] = {"device": 0, "side": 0}
        self.coll_names: Dict[str, int] = {}
        self._side_storages: set = set()
        self._in_read = 0
        self._in_coll = 0
        self._saved: List[tuple] = []

    # --------------------------------------------------------------------- records
    def _kind_of(self, t) -> str:
        if isinstance(t, torch.Tensor) and _storage_key(t) in self._side_storages:
            return "side"
        return "device"

    def _record_read(self, what: str, t) -> None:
        kind = self._kind_of(t)
        self.reads[kind] += 1
        key = f"{kind} {_site()} {what}"
        self.sites[key] = self.sites.get(key, 0) + 1

    def total_reads(self, kind: str = "device") -> int:
        return self.reads[kind]

    # --------------------------------------------------------------------- dispatch layer
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.namespace == "c10d" and self._in_coll == 0:
            self.collectives["device"] += 1
            self.coll_names[f"device c10d.{name}"] = self.coll_names.get(f"device c10d.{name}", 0) + 1
        elif self._in_read == 0 and name in READ_OPS:
            first = args[0] if args else None
            self._record_read(f"aten.{name}", first)
        return func(*args, **kwargs)

    # --------------------------------------------------------------------- method wrappers
    def _wrap_read(self, name: str, orig):
        meter = self

        def wrapped(t, *args, **kwargs):
            if meter._in_read == 0 and meter._in_coll == 0:
                meter._record_read(f"{name.strip('_')}(tensor)" if name.startswith("__") else f".{name}()", t)
            meter._in_read += 1
            try:
                return orig(t, *args, **kwargs)
            finally:
                meter._in_read -= 1
        wrapped.__name__ = name
        return wrapped

    def _wrap_coll(self, name: str, orig):
        meter = self

        def wrapped(*args, **kwargs):
            if meter._in_coll == 0:
                group = _group_of(name, args, kwargs)
                side = meter.side_group is not None and group is meter.side_group
                kind = "side" if side else "device"
                meter.collectives[kind] += 1
                meter.coll_names[f"{kind} {name}"] = meter.coll_names.get(f"{kind} {name}", 0) + 1
                if side:
                    for t in _tensors(list(args) + list(kwargs.values())):
                        key = _storage_key(t)
                        if key is not None:
                            meter._side_storages.add(key)
            meter._in_coll += 1
            try:
                return orig(*args, **kwargs)
            finally:
                meter._in_coll -= 1
        wrapped.__name__ = name
        return wrapped

    def __enter__(self):
        for name in READ_METHODS:
            orig = getattr(torch.Tensor, name, None)
            if orig is not None:
                self._saved.append((torch.Tensor, name, torch.Tensor.__dict__.get(name)))
                setattr(torch.Tensor, name, self._wrap_read(name, orig))
        for name in COLLECTIVES:
            orig = getattr(dist, name, None)
            if orig is not None:
                self._saved.append((dist, name, orig))
                setattr(dist, name, self._wrap_coll(name, orig))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, name, orig in reversed(self._saved):
                if orig is None:
                    try:
                        delattr(owner, name)
                    except AttributeError:
                        pass
                else:
                    setattr(owner, name, orig)
            self._saved.clear()

    def summary(self) -> dict:
        return {"reads": dict(self.reads), "collectives": dict(self.collectives),
                "sites": dict(sorted(self.sites.items())), "coll_names": dict(sorted(self.coll_names.items()))}

