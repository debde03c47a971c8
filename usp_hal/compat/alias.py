"""``import yunchang`` served by usp-hal, for code that imports yunchang's submodules.

:func:`install_yunchang_alias` puts module objects under ``yunchang`` and the submodule names
xDiT (xfuser 0.7.0) and other yunchang consumers import into ``sys.modules``; nothing is
installed by importing usp-hal.  Each name is backed by usp-hal's own code with yunchang 0.6.4's
signature (the file of yunchang 0.6.4 it mirrors is named beside it); the functions that take
yunchang's attention keywords are defined in :mod:`usp_hal.compat.yunchang`, with the top-level
ones, so this module maps module names to objects.  A function usp-hal cannot honour raises
:class:`YunchangUnsupported` naming why and what to call instead.

========================================  ===============================================
``yunchang``                              yunchang's top-level names (usp_hal's)
``yunchang.globals``                      ``PROCESS_GROUP``, ``set_seq_parallel_pg``, ``HAS_*``
``yunchang.kernels``                      ``AttnType``, ``select_flash_attn_impl``
``yunchang.comm``, ``.comm.all_to_all``   ``all_to_all_4D``, ``SeqAllToAll4D``, ``all_to_all_5D``,
                                          ``SeqAllToAll5D``; ``.comm.extract_local``
``yunchang.ring``, ``.ring.utils``        ``RingComm``, ``update_out_and_lse``, ...
``yunchang.ring.ring_flash_attn``         ``ring_flash_attn_forward``/``_backward``,
                                          ``RingFlashAttnFunc``, the ring functions
``yunchang.ring.ring_npu_flash_attn``     ``RingNpuFlashAttnFunc``, ``ring_npu_flash_attn_func``
``yunchang.ring.ring_pytorch_attn``       ``ring_pytorch_attn_func``
========================================  ===============================================

It logs the names it serves (logger ``usp_hal.compat.alias``, INFO).  While it is installed, a
``yunchang`` submodule it does not serve (``import yunchang.hybrid``) raises
:class:`YunchangAliasModuleNotFound` (a ``ModuleNotFoundError``, so ``except ImportError`` still
takes it) naming the alias and listing what it serves.
"""
from __future__ import annotations

import importlib.abc
import logging
import sys
import types
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..dispatch.platform import synchronize
from ..parallel import comm as _comm
from . import yunchang as _yc
from .yunchang import (
    RingFlashAttnFunc,
    YunchangUnsupported,
    ring_flash_attn_backward,
    ring_flash_attn_forward,
    select_flash_attn_impl,
)

__all__ = ["install_yunchang_alias", "remove_yunchang_alias", "YunchangUnsupported", "YunchangAliasModuleNotFound",
           "ALIAS_MODULES"]

log = logging.getLogger(__name__)


def _refuse(name: str, why: str, instead: str):
    def refused(*args, **kwargs):
        raise YunchangUnsupported(f"yunchang.{name} (usp-hal alias): {why}; use {instead}")
    refused.__name__ = refused.__qualname__ = name.rsplit(".", 1)[-1]
    refused.__doc__ = f"Refused: {why}; use {instead}."
    return refused


# --------------------------------------------------------------------------- yunchang.globals

class ProcessGroupSingleton:
    """yunchang/globals.py (v0.6.4) ``ProcessGroupSingleton``: the Ulysses and ring groups of
    the last :func:`set_seq_parallel_pg` (one instance)."""
    _instance: Optional["ProcessGroupSingleton"] = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
            cls._instance.ULYSSES_PG = None
            cls._instance.RING_PG = None
        return cls._instance

    ULYSSES_PG: Any
    RING_PG: Any


PROCESS_GROUP = ProcessGroupSingleton()


# yunchang/globals.py (v0.6.4): set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, rank, world_size,
#                                                   use_ulysses_low=True)
def set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, rank, world_size, use_ulysses_low=True):
    """usp-hal's :func:`usp_hal.set_seq_parallel_pg` (builds the default mesh), then stores the
    mesh's Ulysses and ring groups in ``PROCESS_GROUP`` as yunchang's does."""
    from ..parallel.mesh import get_default_mesh
    from ..parallel.mesh import set_seq_parallel_pg as usp_set
    usp_set(sp_ulysses_degree, sp_ring_degree, rank, world_size, use_ulysses_low=use_ulysses_low)
    mesh = get_default_mesh()
    PROCESS_GROUP.ULYSSES_PG = mesh.ulysses_group
    PROCESS_GROUP.RING_PG = mesh.ring_group


def _flags() -> Dict[str, bool]:
    from usp_hal.backends.yunchang_flags import yunchang_flags
    return yunchang_flags()


# ------------------------------------------------------------------------ yunchang.comm.all_to_all

def _a2a(x: torch.Tensor, group) -> torch.Tensor:
    """``x [P, ...]``: block p goes to rank p; returns the blocks received, in rank order."""
    out = torch.empty_like(x)
    _comm.collective("yunchang all_to_all", "Ulysses group", dist.all_to_all_single, out, x, group=group)
    return out


# yunchang/comm/all_to_all.py (v0.6.4): all_to_all_4D(input, scatter_idx=2, gather_idx=1, group=None,
#                                                      use_sync=False)
def all_to_all_4D(input: torch.Tensor, scatter_idx: int = 2, gather_idx: int = 1, group=None,
                  use_sync: bool = False) -> torch.Tensor:
    """Ulysses' exchange of ``[B, S/P, H, D]`` to ``[B, S, H/P, D]`` (``scatter_idx=2,
    gather_idx=1``) and back (``1, 2``); rank order is the group's.  ``use_sync`` synchronises
    the device after the exchange, as yunchang's does."""
    if input.dim() != 4:
        raise ValueError(f"all_to_all_4D: input must be 4D [B, S, H, D], got shape {tuple(input.shape)}")
    P = dist.get_world_size(group)
    if (scatter_idx, gather_idx) == (2, 1):
        B, s, H, D = input.shape
        if H % P:
            raise ValueError(f"all_to_all_4D: {H} heads do not split over {P} ranks")
        # [B, s, P, H/P, D] -> [P, B, s, H/P, D]: block p holds the heads of rank p
        send = input.reshape(B, s, P, H // P, D).permute(2, 0, 1, 3, 4).contiguous()
        got = _a2a(send, group) if P > 1 else send
        if use_sync:
            synchronize(got.device.type)
        # got[p] is rank p's sequence chunk of my heads: [P, B, s, h, D] -> [B, P*s, h, D]
        return got.permute(1, 0, 2, 3, 4).reshape(B, P * s, H // P, D)
    if (scatter_idx, gather_idx) == (1, 2):
        B, S, h, D = input.shape
        if S % P:
            raise ValueError(f"all_to_all_4D: sequence length {S} does not split over {P} ranks")
        send = input.reshape(B, P, S // P, h, D).permute(1, 0, 2, 3, 4).contiguous()
        got = _a2a(send, group) if P > 1 else send
        if use_sync:
            synchronize(got.device.type)
        # got[p] is my sequence chunk of rank p's heads: [P, B, s, h, D] -> [B, s, P*h, D]
        return got.permute(1, 2, 0, 3, 4).reshape(B, S // P, P * h, D)
    raise RuntimeError("scatter_idx must be 1 or 2 and gather_idx must be 1 or 2")


class SeqAllToAll4D(torch.autograd.Function):
    """yunchang/comm/all_to_all.py (v0.6.4): ``SeqAllToAll4D.apply(group, input, scatter_idx,
    gather_idx, use_sync=False)``; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, group, input, scatter_idx, gather_idx, use_sync=False):
        ctx.group, ctx.scatter_idx, ctx.gather_idx, ctx.use_sync = group, scatter_idx, gather_idx, use_sync
        return all_to_all_4D(input, scatter_idx, gather_idx, group=group, use_sync=use_sync)

    @staticmethod
    def backward(ctx, *grad_output):
        g = SeqAllToAll4D.apply(ctx.group, *grad_output, ctx.gather_idx, ctx.scatter_idx, ctx.use_sync)
        return None, g, None, None, None


# yunchang/comm/all_to_all.py (v0.6.4): all_to_all_5D(input, scatter_idx=3, gather_idx=1, group=None,
#                                                      use_sync=False) on packed qkv [B, S, 3, H, D]
def all_to_all_5D(input: torch.Tensor, scatter_idx: int = 3, gather_idx: int = 1, group=None,
                  use_sync: bool = False) -> torch.Tensor:
    """:func:`all_to_all_4D` on packed ``[B, S, 3, H, D]`` (heads at ``scatter_idx=3``)."""
    if input.dim() != 5:
        raise ValueError(f"all_to_all_5D: input must be 5D [B, S, 3, H, D], got shape {tuple(input.shape)}")
    if (scatter_idx, gather_idx) not in ((3, 1), (1, 3)):
        raise RuntimeError("scatter_idx must be 1 or 3 and gather_idx must be 1 or 3")
    T = input.shape[2]     # each of q, k, v is exchanged on its own: heads stay within it
    parts = [all_to_all_4D(input[:, :, t], 2 if scatter_idx == 3 else 1, 1 if gather_idx == 1 else 2,
                           group=group, use_sync=use_sync) for t in range(T)]
    return torch.stack(parts, dim=2)


class SeqAllToAll5D(torch.autograd.Function):
    """yunchang/comm/all_to_all.py (v0.6.4): ``SeqAllToAll5D.apply(group, input, scatter_idx=3,
    gather_idx=1, use_sync=False)``."""

    @staticmethod
    def forward(ctx, group, input, scatter_idx=3, gather_idx=1, use_sync=False):
        ctx.group, ctx.scatter_idx, ctx.gather_idx, ctx.use_sync = group, scatter_idx, gather_idx, use_sync
        return all_to_all_5D(input, scatter_idx, gather_idx, group=group, use_sync=use_sync)

    @staticmethod
    def backward(ctx, *grad_output):
        g = SeqAllToAll5D.apply(ctx.group, *grad_output, ctx.gather_idx, ctx.scatter_idx, ctx.use_sync)
        return None, g, None, None, None


# --------------------------------------------------------------------------- yunchang.ring.utils

# yunchang/ring/utils.py (v0.6.4): update_out_and_lse(out, lse, block_out, block_lse, slice_=None)
# out [B, S, H, D] float32 and lse [B, S, H, 1] are the running pair (None at first); block_lse [B, H, S]
def update_out_and_lse(out, lse, block_out, block_lse, slice_=None):
    """The online-softmax merge of a block into ``(out, lse)`` with yunchang's shapes, by
    usp-hal's :func:`usp_hal.parallel.ring.merge_block`."""
    from ..parallel.ring import merge_block
    if out is None:
        if slice_ is not None:
            raise RuntimeError("first update_out_and_lse should not pass slice_ args")
        return block_out.to(torch.float32), block_lse.transpose(-2, -1).unsqueeze(dim=-1)
    if slice_ is not None:
        sub_out, sub_lse = update_out_and_lse(out[slice_], lse[slice_], block_out, block_lse)
        out[slice_], lse[slice_] = sub_out, sub_lse
        return out, lse
    acc_out = out.clone()
    # [B, H, S], merge_block's layout; a copy: merge_block writes it in place, and ``lse`` may be a
    # view of the caller's first block_lse
    acc_lse = lse.squeeze(-1).transpose(1, 2).clone(memory_format=torch.contiguous_format)
    merge_block(acc_out, acc_lse, slice(None), block_out, block_lse)
    return acc_out, acc_lse.transpose(1, 2).unsqueeze(-1)


class RingComm:
    """yunchang/ring/utils.py (v0.6.4) ``RingComm(process_group)``: ``send_recv(to_send,
    recv_tensor=None)`` queues a send to the next rank and a receive from the previous one,
    ``commit()`` starts them, ``wait()`` waits (failures name the ring, usp-hal's
    :func:`usp_hal.parallel.comm.wait`)."""

    def __init__(self, process_group):
        self._process_group = process_group
        self._ops: List[Any] = []
        self._reqs: Optional[List[Any]] = None
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.send_rank = (self.rank + 1) % self.world_size
        self.recv_rank = (self.rank - 1) % self.world_size
        if process_group is not None:
            self.send_rank = dist.get_global_rank(process_group, self.send_rank)
            self.recv_rank = dist.get_global_rank(process_group, self.recv_rank)

    def send_recv(self, to_send: torch.Tensor, recv_tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
        res = torch.empty_like(to_send) if recv_tensor is None else recv_tensor
        self._ops.append(dist.P2POp(dist.isend, to_send, self.send_rank, group=self._process_group))
        self._ops.append(dist.P2POp(dist.irecv, res, self.recv_rank, group=self._process_group))
        return res

    def commit(self):
        if self._reqs is not None:
            raise RuntimeError("commit called twice")
        self._reqs = _comm.collective("yunchang RingComm send/recv", "ring group", dist.batch_isend_irecv, self._ops)

    def wait(self):
        if self._reqs is None:
            raise RuntimeError("wait called before commit")
        _comm.wait("yunchang RingComm send/recv", "ring group", self._reqs)
        self._reqs = None
        self._ops = []


_NPU_STATS = ("the Ascend fused-attention kernel keeps (softmax_max, softmax_sum) per row; usp-hal's ring keeps "
              "one log-sum-exp and has no counterpart to these statistics")

# not in yunchang 0.6.4 (xfuser 0.7.0 imports it from yunchang.ring.utils for its NPU ring)
update_npu_out = _refuse("ring.utils.update_npu_out", _NPU_STATS,
                         "yunchang.ring.ring_npu_flash_attn.ring_npu_flash_attn_func or "
                         "usp_hal.LongContextAttention(attn_type='npu')")


# --------------------------------------------------------------- yunchang.ring.ring_npu_flash_attn

# yunchang/ring/ring_npu_flash_attn.py (v0.6.4): ring_npu_flash_attn_forward(group, q, k, v, head_num=None,
#     input_layout="BSND") -> (out, softmax_max, softmax_sum, scale); ring_npu_flash_attn_backward(group, q, k,
#     v, grad_attention_out, head_num=None, input_layout="BSND", softmax_max=None, softmax_sum=None,
#     attn_out=None, scale=None)
ring_npu_flash_attn_forward = _refuse("ring.ring_npu_flash_attn.ring_npu_flash_attn_forward", _NPU_STATS,
                                      "ring_npu_flash_attn_func (usp-hal's ring with the 'npu' kernel)")
ring_npu_flash_attn_backward = _refuse("ring.ring_npu_flash_attn.ring_npu_flash_attn_backward", _NPU_STATS,
                                       "ring_npu_flash_attn_func (usp-hal's ring with the 'npu' kernel) and "
                                       "autograd")


class RingNpuFlashAttnFunc(torch.autograd.Function):
    """yunchang/ring/ring_npu_flash_attn.py (v0.6.4): ``RingNpuFlashAttnFunc.apply(group, q, k, v,
    head_num, input_layout="BSND")``: the basic ring with the ``npu`` backend (usp-hal refuses it
    where that backend is unavailable, naming what runs instead).  Its backward needs the NPU statistics
    and is refused (differentiate :func:`ring_npu_flash_attn_func` instead)."""

    @staticmethod
    def forward(ctx, group, q, k, v, head_num, input_layout="BSND"):
        return _yc.ring_npu_flash_attn_func(group, q, k, v, head_num, input_layout)

    @staticmethod
    def backward(ctx, grad_attention_out):
        return ring_npu_flash_attn_backward()


# ------------------------------------------------------------------------------ the module table

def _module(name: str, doc: str, names: Dict[str, Any], package: bool = False) -> types.ModuleType:
    mod = types.ModuleType(name, doc)
    mod.__dict__.update(names)
    mod.__dict__["__all__"] = [n for n in names if not n.startswith("_")]
    mod.__dict__["__usp_hal_alias__"] = True
    if package:
        mod.__dict__["__path__"] = []
    return mod


def _tables() -> Dict[str, Dict[str, Any]]:
    import usp_hal

    from .. import kernels
    top = {n: getattr(usp_hal, n) for n in (
        "LongContextAttention", "LongContextAttentionQKVPacked", "UlyssesAttention", "AsyncLongContextAttention",
        "EXTRACT_FUNC_DICT", *_yc.YUNCHANG_NAMES)}
    top["set_seq_parallel_pg"] = set_seq_parallel_pg
    a2a = {"all_to_all_4D": all_to_all_4D, "SeqAllToAll4D": SeqAllToAll4D, "all_to_all_5D": all_to_all_5D,
           "SeqAllToAll5D": SeqAllToAll5D}
    extract = {"EXTRACT_FUNC_DICT": usp_hal.EXTRACT_FUNC_DICT, "basic_extract_local": _yc.basic_extract_local,
               "zigzag_extract_local": _yc.zigzag_extract_local, "stripe_extract_local": _yc.stripe_extract_local}
    utils = {"RingComm": RingComm, "update_out_and_lse": update_out_and_lse, "update_npu_out": update_npu_out}
    rfa = {"ring_flash_attn_forward": ring_flash_attn_forward, "ring_flash_attn_backward": ring_flash_attn_backward,
           "RingFlashAttnFunc": RingFlashAttnFunc, "RingComm": RingComm, "update_out_and_lse": update_out_and_lse,
           "ring_flash_attn_func": _yc.ring_flash_attn_func,
           "ring_flash_attn_kvpacked_func": _yc.ring_flash_attn_kvpacked_func,
           "ring_flash_attn_qkvpacked_func": _yc.ring_flash_attn_qkvpacked_func}
    npu = {"ring_npu_flash_attn_forward": ring_npu_flash_attn_forward,
           "ring_npu_flash_attn_backward": ring_npu_flash_attn_backward,
           "RingNpuFlashAttnFunc": RingNpuFlashAttnFunc, "ring_npu_flash_attn_func": _yc.ring_npu_flash_attn_func}
    ring = {n: top[n] for n in _yc.YUNCHANG_NAMES if n.startswith(("ring_", "zigzag_", "stripe_"))}
    return {
        "yunchang": top,
        "yunchang.globals": {"PROCESS_GROUP": PROCESS_GROUP, "ProcessGroupSingleton": ProcessGroupSingleton,
                             "set_seq_parallel_pg": set_seq_parallel_pg, **_flags()},
        "yunchang.kernels": {"AttnType": kernels.AttnType, "select_flash_attn_impl": select_flash_attn_impl},
        "yunchang.comm": {**a2a, **extract},
        "yunchang.comm.all_to_all": a2a,
        "yunchang.comm.extract_local": extract,
        "yunchang.ring": ring,
        "yunchang.ring.utils": utils,
        "yunchang.ring.ring_flash_attn": rfa,
        "yunchang.ring.ring_npu_flash_attn": npu,
        "yunchang.ring.ring_pytorch_attn": {"ring_pytorch_attn_func": _yc.ring_pytorch_attn_func},
    }


#: the module names :func:`install_yunchang_alias` installs
ALIAS_MODULES: Tuple[str, ...] = (
    "yunchang", "yunchang.globals", "yunchang.kernels", "yunchang.comm", "yunchang.comm.all_to_all",
    "yunchang.comm.extract_local", "yunchang.ring", "yunchang.ring.utils", "yunchang.ring.ring_flash_attn",
    "yunchang.ring.ring_npu_flash_attn", "yunchang.ring.ring_pytorch_attn")

_PACKAGES = {"yunchang", "yunchang.comm", "yunchang.ring", "yunchang.kernels"}


class YunchangAliasModuleNotFound(ModuleNotFoundError):
    """A ``yunchang`` submodule the alias does not serve was imported while it is installed
    (``import yunchang.x`` or ``from yunchang import x``)."""


def _served() -> str:
    return ", ".join(ALIAS_MODULES)


class _UnservedFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` while the alias is installed: a ``yunchang.*`` name that is not
    one of :data:`ALIAS_MODULES` raises :class:`YunchangAliasModuleNotFound` instead of the bare
    ``No module named ...`` the alias's empty package paths would give."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("yunchang.") or fullname in ALIAS_MODULES:
            return None
        if not getattr(sys.modules.get("yunchang"), "__usp_hal_alias__", False):
            return None      # the alias was taken out of sys.modules by hand: not ours to answer
        raise YunchangAliasModuleNotFound(
            f"No module named {fullname!r}: 'yunchang' is usp-hal's alias (usp_hal.compat.alias."
            f"install_yunchang_alias), which serves only {_served()}; import those names, call usp_hal directly, "
            "or take the alias out (remove_yunchang_alias()) and install yunchang itself")
        # no name=: CPython's importlib._bootstrap._handle_fromlist drops a ModuleNotFoundError whose
        # .name is the submodule tried, so `from yunchang import hybrid` would end in its generic
        # "cannot import name" (which names neither the alias nor what it serves)


_FINDER = _UnservedFinder()


def install_yunchang_alias() -> List[str]:
    """Make ``import yunchang`` and its submodules in :data:`ALIAS_MODULES` resolve to usp-hal;
    returns the module names it put in ``sys.modules`` and logs them (INFO, logger
    ``usp_hal.compat.alias``).  Any other ``yunchang.*`` import then raises
    :class:`YunchangAliasModuleNotFound` naming the alias and what it serves.  Refused while a
    real ``yunchang`` is imported (remove it from ``sys.modules`` first, or do not install the
    alias).  Calling it again reinstalls the alias (``PROCESS_GROUP`` is the same object)."""
    real = sys.modules.get("yunchang")
    if real is not None and not getattr(real, "__usp_hal_alias__", False):
        raise RuntimeError("install_yunchang_alias: the real yunchang package is already imported "
                           f"({getattr(real, '__file__', real)!r}); the alias would leave its modules mixed with "
                           "usp-hal's: install the alias before anything imports yunchang, or keep yunchang")
    tables = _tables()
    mods = {name: _module(name, f"yunchang 0.6.4's {name} served by usp-hal (usp_hal.compat.alias)",
                          tables[name], package=name in _PACKAGES) for name in ALIAS_MODULES}
    for name, mod in mods.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(mods[parent], child, mod)
    sys.modules.update(mods)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    log.info("install_yunchang_alias: 'import yunchang' now resolves to usp-hal for these modules: %s "
             "(any other yunchang submodule is refused)", _served())
    return list(ALIAS_MODULES)


def remove_yunchang_alias() -> List[str]:
    """Remove the alias's modules from ``sys.modules`` (and its finder from ``sys.meta_path``);
    returns the names removed."""
    gone = [n for n in ALIAS_MODULES if getattr(sys.modules.get(n), "__usp_hal_alias__", False)]
    for n in gone:
        del sys.modules[n]
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    if gone:
        log.info("remove_yunchang_alias: took out %s", ", ".join(gone))
    return gone
