"""Attention masks over *global* positions, and the block plan they give the ring.

Two ways to say which keys a query sees, both over global token positions (usp-hal maps
every rank's local rows to their global positions through the layout, so a mask never
mentions shards):

* a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (:meth:`Mask.from_mod`).
  It is called with broadcastable integer tensors (``b`` ``[B|1, 1, 1, 1]``, ``h``
  ``[1, H|1, 1, 1]``, ``q_idx`` ``[1, 1, Lq, 1]``, ``kv_idx`` ``[1, 1, 1, Lk]``), so any
  function written with tensor operations (comparisons, ``//``, indexing a tensor of
  document ids by ``q_idx``) works unchanged.  ``b``/``h`` are 0 unless the mask is built
  with ``batch=B`` / ``heads=H`` (then it may depend on them).
* Magi-style slices ``(q_range, k_range, kind)`` (:meth:`Mask.from_slices`): the union of
  rectangles, each ``"full"``, ``"causal"`` (bottom-right aligned: the last query of the
  rectangle sees its last key), ``"inv_causal"`` (top-left aligned, the other triangle:
  query ``m`` sees keys from ``m``'s own offset on) or ``"bi_causal"`` (both: a band).

How a masked call runs: the mask (and'ed with ``causal``, the window and the documents of
``cu_seqlens``) is classified once per global length on a tile grid (``tile`` tokens a
side): a tile is *empty* (no pair), *full* (every pair) or *partial*.  Each rank's kernel
calls then cover, per query band of one tile row and per pair of contiguous segments, the
runs of non-empty tiles: a run of full tiles is a plain kernel call (no mask), a run with a
partial tile one call with a dense boolean mask for just that run, empty tiles none at all
(a ring step whose block is empty for every row makes no call).  Calls on the same rows
are merged by lse like every ring block.

:func:`balanced_layout` cuts the sequence into chunks and hands them to ring ranks by mask
area (a greedy min-heap), so every rank scores about the same number of pairs.
"""
from __future__ import annotations

import dis
import functools
import hashlib
import heapq
import itertools
import operator
import types
import weakref
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..bounded import BoundedCache
from .blocks import BlockCall
from .positions import Segment

KINDS = ("full", "causal", "inv_causal", "bi_causal")
EMPTY, FULL, PARTIAL = 0, 1, 2
_HANDLES = itertools.count(1)
#: live masks by handle, for the compiled op (which carries its options as a string)
_BY_HANDLE: "weakref.WeakValueDictionary[int, Mask]" = weakref.WeakValueDictionary()

__all__ = ["Mask", "KINDS", "prefix_lm", "block_causal", "chunked_local", "random_block_sparse", "sliding",
           "and_masks", "or_masks", "balanced_layout", "dense_mask", "mask_work", "plan_masked", "tile_size",
           "ring_work", "masked_ring", "Predicate"]


class Mask:
    """A mask over global positions (see the module doc).  Built by :meth:`from_mod` /
    :meth:`from_slices` or the helpers (:func:`prefix_lm`, ...); pass it as
    ``LongContextAttention.forward(..., mask=m)``.  Every rank must give a mask that selects
    the same pairs: the cross-rank check compares a digest of what the mask selects (its tile
    classification and the bits of its partial tiles), whatever form the mask takes.  The
    classification is cached per global length and per *state* of what the mask reads
    (:meth:`state`: the values of its closure, defaults, ``functools.partial`` arguments,
    attributes of a callable object and globals the function reads, tensors by their version),
    so a mask whose data change between calls is classified again."""

    def __init__(self, fn: Optional[Callable] = None, slices: Optional[Sequence] = None, *,
                 batch: Optional[int] = None, heads: Optional[int] = None, name: str = "", key: Tuple = (),
                 data=None):
        if (fn is None) == (slices is None):
            raise ValueError("a Mask needs exactly one of mask_mod and slices")
        if data is not None and fn is None:
            raise ValueError("Mask(data=...) goes with a mask_mod (slices hold their own values)")
        self.data: Tuple = _data_tuple(data)
        self.fn = fn
        self.slices: Optional[Tuple[Tuple[int, int, int, int, str], ...]] = None
        if slices is not None:
            self.slices = tuple(_check_slice(s) for s in slices)
        for label, n in (("batch", batch), ("heads", heads)):
            if n is not None and (not isinstance(n, int) or n < 1):
                raise ValueError(f"Mask({label}=...) must be a positive int or None, got {n!r}")
        self.batch, self.heads = batch, heads
        self.name = name or (getattr(fn, "__name__", "mask_mod") if fn is not None else "slices")
        self.key = key
        self._fp: Optional[int] = None
        self._tiles: BoundedCache[Tuple, Tuple[object, torch.Tensor, int]] = BoundedCache(8)
        #: an integer naming this mask in this process (how a compiled graph refers to it)
        self.handle: int = next(_HANDLES)
        _BY_HANDLE[self.handle] = self

    @staticmethod
    def by_handle(handle: int) -> "Mask":
        got = _BY_HANDLE.get(int(handle))
        if got is None:
            raise RuntimeError(f"usp_hal: mask handle {handle} of a compiled graph no longer exists; build masks "
                               "once (outside the compiled function) and reuse them")
        return got

    # constructors --------------------------------------------------------------------
    @classmethod
    def from_mod(cls, mask_mod: Callable, *, batch: Optional[int] = None, heads: Optional[int] = None,
                 name: str = "", data=None) -> "Mask":
        """``data``: a tensor or NumPy array, or a sequence of them, that ``mask_mod`` reads and
        that may change without a version bump (written through ``.data``, through a NumPy view
        of the tensor's memory, or refilled by a loader): their *content* is digested on every
        call (one pass over them, and a host read for device tensors), so any change is seen."""
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable (b, h, q_idx, kv_idx) -> bool, got {type(mask_mod).__name__}")
        return cls(fn=mask_mod, batch=batch, heads=heads, name=name, data=data)

    @classmethod
    def from_slices(cls, slices: Sequence) -> "Mask":
        """``slices``: ``[((q_start, q_stop), (k_start, k_stop), kind), ...]`` in global positions."""
        return cls(slices=list(slices))

    @classmethod
    def of(cls, mask) -> "Mask":
        """A :class:`Mask` from what ``forward(mask=...)`` accepts: a Mask, a mask_mod, or slices."""
        if isinstance(mask, Mask):
            return mask
        if callable(mask):
            return cls.from_mod(mask)
        if isinstance(mask, (list, tuple)):
            return cls.from_slices(mask)
        raise TypeError(f"mask must be a usp_hal.sequence.masks.Mask, a mask_mod(b, h, q_idx, kv_idx) or a list of "
                        f"(q_range, k_range, kind) slices, got {type(mask).__name__}")

    # identity across ranks -----------------------------------------------------------
    def fingerprint(self) -> int:
        """A digest of what the mask is (kind, code, parameters), compared across ranks."""
        if self._fp is None:
            h = hashlib.blake2b(digest_size=7)
            h.update(repr((self.name, self.batch, self.heads, self.key, self.slices)).encode())
            code = getattr(self.fn, "__code__", None)
            if code is not None:
                h.update(code.co_code)
                h.update(repr(code.co_consts).encode())
                for cell in getattr(self.fn, "__closure__", None) or ():
                    try:
                        v = cell.cell_contents
                    except ValueError:
                        continue
                    if isinstance(v, (int, float, str, bool, tuple)):
                        h.update(repr(v).encode())
                    elif isinstance(v, Mask):
                        h.update(v.fingerprint().to_bytes(8, "little"))
            self._fp = int.from_bytes(h.digest(), "little") | 1
        return self._fp

    def state(self):
        """A token that changes whenever what the mask reads may have changed: the values its
        function reads (closure cells, defaults, ``functools.partial`` arguments, a callable
        object's attributes, the globals its code loads, recursively), with tensors as
        ``(identity, version, storage pointer, shape)``.  A value it cannot see into makes the
        token unique per call (the mask is then classified on every call: never stale)."""
        if self.slices is not None:
            return ()
        acc: list = []
        if not _walk(self.fn, acc, 0, set(), [0]):
            return _Unseen()
        acc.append((self.batch, self.heads))
        acc += [("data", _content(d)) for d in self.data]
        return tuple(acc)

    def __repr__(self) -> str:
        return f"Mask({self.name}{', slices' if self.slices else ''})"

    # evaluation ----------------------------------------------------------------------
    def keep(self, qpos: torch.Tensor, kpos: torch.Tensor, batch: int = 1,
             heads: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Bool ``[B|1, H|1, Lq, Lk]``: query at global ``qpos`` sees the key at ``kpos``.
        ``heads``: the global head indices to evaluate (a head-dependent mask only)."""
        q = qpos.view(1, 1, -1, 1)
        k = kpos.view(1, 1, 1, -1)
        if self.slices is not None:
            out = torch.zeros(q.shape[2], k.shape[3], dtype=torch.bool, device=q.device).view(1, 1, q.shape[2], -1)
            for qa, qb, ka, kb, kind in self.slices:
                inside = (q >= qa) & (q < qb) & (k >= ka) & (k < kb)
                if kind in ("causal", "bi_causal"):
                    inside = inside & (k - kb <= q - qb)
                if kind in ("inv_causal", "bi_causal"):
                    inside = inside & (k - ka >= q - qa)
                out = out | inside
            return out
        b = torch.arange(batch, device=q.device).view(-1, 1, 1, 1) if self.batch is not None else \
            torch.zeros(1, 1, 1, 1, dtype=torch.long, device=q.device)
        if self.heads is not None:
            hs = torch.as_tensor(list(heads) if heads is not None else range(self.heads), device=q.device)
            h = hs.view(1, -1, 1, 1)
        else:
            h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=q.device)
        assert self.fn is not None
        got = self.fn(b, h, q, k)
        if not isinstance(got, torch.Tensor) or got.dtype != torch.bool:
            raise TypeError(f"mask_mod {self.name!r} must return a bool tensor, got "
                            f"{getattr(got, 'dtype', type(got).__name__)}")
        want = (b.shape[0], h.shape[1], q.shape[2], k.shape[3])
        have = (1,) * (4 - got.dim()) + tuple(got.shape) if got.dim() <= 4 else tuple(got.shape)
        if len(have) != 4 or any(x not in (1, w) for x, w in zip(have, want)):
            raise ValueError(f"mask_mod {self.name!r} returned a tensor of shape {tuple(got.shape)}; it must "
                             f"broadcast to [B|1, H|1, Lq, Lk] = [{want[0]}|1, {want[1]}|1, {want[2]}, {want[3]}] "
                             f"(it is called with b {list(b.shape)}, h {list(h.shape)}, q_idx {list(q.shape)}, "
                             f"kv_idx {list(k.shape)}: write it with elementwise tensor operations)")
        return torch.broadcast_to(got.reshape(have), (have[0], have[1], want[2], want[3]))


def _data_tuple(data) -> Tuple:
    """``Mask(data=...)`` as a tuple of tensors / arrays (checked)."""
    if data is None:
        return ()
    items = tuple(data) if isinstance(data, (list, tuple)) else (data,)
    for d in items:
        if not (isinstance(d, torch.Tensor) or (type(d).__module__ == "numpy" and hasattr(d, "tobytes"))):
            raise TypeError(f"Mask(data=...) takes tensors or NumPy arrays (what the mask_mod reads), got "
                            f"{type(d).__name__}")
    return items


def _content(d) -> Tuple:
    """A digest of a tensor's or an array's values (with its shape and dtype)."""
    if isinstance(d, torch.Tensor):
        t = d.detach()
        raw = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b""
        return ("values", hashlib.blake2b(raw, digest_size=8).digest(), tuple(t.shape), t.dtype, t.device)
    return ("values", hashlib.blake2b(d.tobytes(), digest_size=8).digest(), getattr(d, "shape", ()), str(d.dtype))


def _external(t: torch.Tensor) -> bool:
    """A CPU tensor over memory torch does not own (``torch.from_numpy``, DLPack): writes to
    that memory from outside do not bump the tensor's version."""
    try:
        return t.device.type == "cpu" and not t.untyped_storage().resizable()
    except (RuntimeError, NotImplementedError):      # e.g. a tensor subclass without storage
        return False


class _Unseen:
    """A state token equal to nothing but itself (a mask whose data cannot be tracked)."""

    __slots__ = ()


_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_LOADED: BoundedCache[int, Tuple[object, Tuple[str, ...]]] = BoundedCache(4096)
_BUDGET = 200_000       # values walked per state token, at most (then: untracked, classified every call)


def _globals_loaded(code) -> Tuple[str, ...]:
    """The global names ``code`` (and the code nested in it) loads, computed once per code object."""
    got = _LOADED.get(id(code))
    if got is not None and got[0] is code:
        return got[1]
    names: List[str] = []
    stack = [code]
    while stack:
        c = stack.pop()
        names += [i.argval for i in dis.get_instructions(c) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    out = tuple(dict.fromkeys(n for n in names if isinstance(n, str)))
    _LOADED.put(id(code), (code, out))
    return out


def _walk(obj, acc: list, depth: int, seen: set, count: List[int]) -> bool:
    """Append to ``acc`` what ``obj`` holds that a mask function may read; False when some
    value cannot be tracked (see :meth:`Mask.state`)."""
    count[0] += 1
    if count[0] > _BUDGET or depth > 8:
        return False
    if isinstance(obj, _SCALARS):
        acc.append(obj)
        return True
    if isinstance(obj, torch.Tensor):
        if _external(obj):      # by value, as a NumPy array: its owner may refill it unversioned
            acc.append(("tensor", id(obj), _content(obj)))
            return True
        ptr = obj.data_ptr() if obj.device.type != "meta" else 0
        acc.append(("tensor", id(obj), obj._version, ptr, tuple(obj.shape), obj.dtype, obj.device))
        return True
    if isinstance(obj, (types.ModuleType, type, types.BuiltinFunctionType, types.BuiltinMethodType)) or \
            callable(obj) and type(obj).__module__ in ("torch._ops", "torch") and not hasattr(obj, "__code__"):
        acc.append(("code", id(obj)))           # code, not data
        return True
    if id(obj) in seen:
        acc.append(("seen", id(obj)))
        return True
    seen.add(id(obj))
    if isinstance(obj, (list, tuple, set, frozenset)):
        acc.append((type(obj).__name__, len(obj)))
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        return all(_walk(x, acc, depth + 1, seen, count) for x in items)
    if isinstance(obj, dict):
        acc.append(("dict", len(obj)))
        return all(_walk(k, acc, depth + 1, seen, count) and _walk(v, acc, depth + 1, seen, count)
                   for k, v in obj.items())
    if isinstance(obj, Mask):
        acc.append(("mask", obj.batch, obj.heads, obj.slices))
        return obj.fn is None or _walk(obj.fn, acc, depth + 1, seen, count)
    if isinstance(obj, functools.partial):
        acc.append("partial")
        return (_walk(obj.func, acc, depth + 1, seen, count) and _walk(obj.args, acc, depth + 1, seen, count)
                and _walk(obj.keywords, acc, depth + 1, seen, count))
    if isinstance(obj, types.MethodType):
        return _walk(obj.__func__, acc, depth + 1, seen, count) and _walk(obj.__self__, acc, depth + 1, seen, count)
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        acc.append(("fn", id(code)))
        for cell in obj.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:
                acc.append("empty cell")
                continue
            if not _walk(value, acc, depth + 1, seen, count):
                return False
        if not (_walk(obj.__defaults__, acc, depth + 1, seen, count)
                and _walk(obj.__kwdefaults__, acc, depth + 1, seen, count)):
            return False
        g = obj.__globals__
        for name in _globals_loaded(code):
            if name in g:
                acc.append(name)
                if not _walk(g[name], acc, depth + 1, seen, count):
                    return False
        return True
    if type(obj).__module__ == "numpy" and hasattr(obj, "tobytes"):
        acc.append(("array", hashlib.blake2b(obj.tobytes(), digest_size=8).digest(), getattr(obj, "shape", ())))
        return True
    if callable(obj) and hasattr(obj, "__dict__"):       # a callable object: its class's __call__ and its attributes
        call = type(obj).__call__
        acc.append(("object", type(obj)))
        return _walk(call, acc, depth + 1, seen, count) and _walk(vars(obj), acc, depth + 1, seen, count)
    if hasattr(obj, "__dict__") and not callable(obj):
        acc.append(("value", type(obj)))
        return _walk(vars(obj), acc, depth + 1, seen, count)
    return False


def _check_slice(s) -> Tuple[int, int, int, int, str]:
    try:
        (qa, qb), (ka, kb), kind = s
        qa, qb, ka, kb = int(qa), int(qb), int(ka), int(kb)
    except (TypeError, ValueError):
        raise ValueError(f"a mask slice is ((q_start, q_stop), (k_start, k_stop), kind), got {s!r}") from None
    if kind not in KINDS:
        raise ValueError(f"mask slice kind {kind!r}; valid: {', '.join(KINDS)}")
    if not (0 <= qa <= qb and 0 <= ka <= kb):
        raise ValueError(f"mask slice {s!r}: ranges must be 0 <= start <= stop")
    return qa, qb, ka, kb, kind


# --------------------------------------------------------------------------------- helpers
def prefix_lm(prefix: int) -> Mask:
    """Bidirectional over the first ``prefix`` tokens, causal after them."""
    p = int(prefix)

    def prefix_lm_mod(b, h, q, kv):
        return (kv < p) | (kv <= q)
    return Mask.from_mod(prefix_lm_mod, name=f"prefix_lm({p})")


def block_causal(block: int) -> Mask:
    """Frames of ``block`` tokens: a token sees every token of its own and earlier frames
    (autoregressive video diffusion)."""
    n = int(block)

    def block_causal_mod(b, h, q, kv):
        return kv // n <= q // n
    return Mask.from_mod(block_causal_mod, name=f"block_causal({n})")


def chunked_local(chunk: int) -> Mask:
    """Causal within chunks of ``chunk`` tokens, nothing across them (Llama 4's chunked attention)."""
    n = int(chunk)

    def chunked_local_mod(b, h, q, kv):
        return (kv // n == q // n) & (kv <= q)
    return Mask.from_mod(chunked_local_mod, name=f"chunked_local({n})")


def sliding(left: int, right: int = 0) -> Mask:
    """Keys within ``left`` before and ``right`` after the query (a window as a mask)."""
    a, c = int(left), int(right)

    def sliding_mod(b, h, q, kv):
        return (kv >= q - a) & (kv <= q + c)
    return Mask.from_mod(sliding_mod, name=f"sliding({a},{c})")


def random_block_sparse(seqlen: int, block: int, density: float, seed: int = 0) -> Mask:
    """Block pairs kept at random with probability ``density`` (every query block keeps its
    diagonal block, so no row is empty); the same on every rank for the same seed."""
    n = int(block)
    nb = -(-int(seqlen) // n)
    g = torch.Generator().manual_seed(int(seed))
    table = torch.rand(nb, nb, generator=g) < float(density)
    table |= torch.eye(nb, dtype=torch.bool)

    def random_block_sparse_mod(b, h, q, kv):
        return table.to(q.device)[q // n, kv // n]
    return Mask(fn=random_block_sparse_mod, name="random_block_sparse", key=(int(seqlen), n, float(density), seed))


def and_masks(*masks: Mask) -> Mask:
    """Pairs every mask keeps."""
    return _combine(masks, "and", operator.and_)


def or_masks(*masks: Mask) -> Mask:
    """Pairs any mask keeps."""
    return _combine(masks, "or", operator.or_)


def _combine(masks, label: str, op) -> Mask:
    ms = tuple(Mask.of(m) for m in masks)

    def combined_mod(b, h, q, kv):
        got = [m.fn(b, h, q, kv) if m.fn is not None else _slices_mod(m, q, kv) for m in ms]
        return functools.reduce(op, got)
    return Mask(fn=combined_mod, name=f"{label}(" + ",".join(m.name for m in ms) + ")",
                key=(label,) + tuple(m.fingerprint() for m in ms), batch=_first(m.batch for m in ms),
                heads=_first(m.heads for m in ms))


def _first(xs):
    for x in xs:
        if x is not None:
            return x
    return None


def _slices_mod(m: Mask, q, kv):
    return m.keep(q.reshape(-1), kv.reshape(-1))


# --------------------------------------------------------------------------------- the call's predicate
@dataclass(frozen=True)
class Predicate:
    """What a masked call keeps: the mask and'ed with causal, the window and the documents."""

    mask: Mask
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    cu_seqlens: Optional[Tuple[int, ...]] = None
    batch: int = 1

    def keep(self, qpos: torch.Tensor, kpos: torch.Tensor, heads: Optional[Sequence[int]] = None) -> torch.Tensor:
        out = self.mask.keep(qpos, kpos, self.batch, heads)
        q = qpos.view(1, 1, -1, 1)
        k = kpos.view(1, 1, 1, -1)
        if self.causal:
            out = out & (k <= q)
        left, right = self.window
        if left >= 0:
            out = out & (k >= q - left)
        if right >= 0:
            out = out & (k <= q + right)
        if self.cu_seqlens is not None and len(self.cu_seqlens) > 2:
            cu = torch.tensor(self.cu_seqlens[1:-1], device=qpos.device)
            out = out & (torch.bucketize(q, cu, right=True) == torch.bucketize(k, cu, right=True))
        return out

    def tiles(self, seqlen: int, tile: int) -> torch.Tensor:
        """``[nT, nT]`` uint8 over the global grid: EMPTY, FULL or PARTIAL (cached on the mask
        per length, tile, options and :meth:`Mask.state`)."""
        return self.classify(seqlen, tile)[0]

    def digest(self, seqlen: int) -> int:
        """A non-zero 63-bit digest of what the predicate keeps over ``seqlen`` tokens: its tile
        classification and the bits of its partial tiles (at the tile size the plan uses), so
        two predicates that keep different pairs differ, whatever their form."""
        return self.classify(seqlen, tile_size(seqlen))[1]

    def classify(self, seqlen: int, tile: int) -> Tuple[torch.Tensor, int]:
        """``(tiles, digest)`` (see :meth:`tiles` and :meth:`digest`), computed once per length,
        tile, options and mask state."""
        state = self.mask.state()
        key = (seqlen, tile, self.causal, self.window, self.cu_seqlens, self.batch)
        got = self.mask._tiles.get(key)
        if got is not None and got[0] == state:
            return got[1], got[2]
        nt = -(-seqlen // tile)
        h = hashlib.blake2b(repr((seqlen, tile)).encode(), digest_size=8)
        dims = (self.batch if self.mask.batch is not None else 1, self.mask.heads or 1)
        if (self.mask.slices is not None and not self.causal and tuple(self.window) == (-1, -1)
                and (self.cu_seqlens is None or len(self.cu_seqlens) <= 2) and _disjoint(self.mask.slices)):
            out = _slice_tiles(self.mask.slices, seqlen, tile)
            h.update(out.numpy().tobytes())
            kpos = torch.arange(seqlen)
            for t in range(nt):
                cols = _partial_columns(out[t], tile, seqlen)
                if cols is not None:
                    a, z = t * tile, min(seqlen, (t + 1) * tile)
                    _update_bits(h, self.keep(torch.arange(a, z), kpos.index_select(0, cols)), dims)
        else:
            out = torch.empty(nt, nt, dtype=torch.uint8)
            kpos = torch.arange(seqlen)
            pad = nt * tile - seqlen
            rows = []
            for t in range(nt):
                a, z = t * tile, min(seqlen, (t + 1) * tile)
                keep = self.keep(torch.arange(a, z), kpos)
                m = keep.reshape(-1, z - a, seqlen)
                anyk = m.any(0).any(0)
                allk = m.all(0).all(0)
                if pad:
                    anyk = torch.cat([anyk, anyk.new_zeros(pad)])
                    allk = torch.cat([allk, allk.new_ones(pad)])
                anyt = anyk.view(nt, tile).any(1)
                allt = allk.view(nt, tile).all(1)
                out[t] = torch.where(allt, FULL, torch.where(anyt, PARTIAL, EMPTY)).to(torch.uint8)
                cols = _partial_columns(out[t], tile, seqlen)
                rows.append(None if cols is None else keep.index_select(-1, cols.to(keep.device)))
            h.update(out.numpy().tobytes())
            for bits in rows:
                if bits is not None:
                    _update_bits(h, bits, dims)
        digest = (int.from_bytes(h.digest(), "little") >> 1) | 1
        self.mask._tiles.put(key, (state, out, digest))
        return out, digest


def _partial_columns(row: torch.Tensor, tile: int, seqlen: int) -> Optional[torch.Tensor]:
    """The key positions of a tile row's partial tiles (None: there are none)."""
    us = (row == PARTIAL).nonzero().view(-1).tolist()
    if not us:
        return None
    return torch.cat([torch.arange(u * tile, min(seqlen, (u + 1) * tile)) for u in us])


def _update_bits(h, keep: torch.Tensor, dims: Tuple[int, int]) -> None:
    """Hash a bool ``[B|1, H|1, rows, cols]`` tensor's values over ``dims`` (batch rows, heads)."""
    full = keep.detach().expand(dims[0], dims[1], keep.shape[2], keep.shape[3])
    h.update(full.to("cpu", torch.uint8).contiguous().numpy().tobytes())


def _disjoint(slices) -> bool:
    """No two slices' rectangles overlap (then each tile's pairs are the sum over slices)."""
    for i, (qa, qb, ka, kb, _) in enumerate(slices):
        for qa2, qb2, ka2, kb2, _ in slices[i + 1:]:
            if max(qa, qa2) < min(qb, qb2) and max(ka, ka2) < min(kb, kb2):
                return False
    return True


def _clamped_prefix(n: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum over t < n of clamp(t, 0, w)`` (elementwise, int64)."""
    n = n.clamp(min=0)
    low = n * (n - 1) // 2
    high = w * (w + 1) // 2 + (n - w - 1) * w
    return torch.where(n <= w + 1, low, high)


def _slice_tiles(slices, seqlen: int, tile: int) -> torch.Tensor:
    """The tile classification of disjoint slices, counted exactly per tile without
    evaluating any pair: per slice, the pairs of its rectangle inside each tile, with the
    causal edges summed in closed form (an arithmetic series clamped to the tile's width)."""
    nt = -(-seqlen // tile)
    edges = torch.arange(nt + 1, dtype=torch.int64) * tile
    edges[-1] = seqlen
    r0, r1 = edges[:-1].view(-1, 1), edges[1:].view(-1, 1)
    c0, c1 = edges[:-1].view(1, -1), edges[1:].view(1, -1)
    count = torch.zeros(nt, nt, dtype=torch.int64)
    for qa, qb, ka, kb, kind in slices:
        A, B = r0.clamp(min=qa), r1.clamp(max=qb)            # rows of the slice in the tile
        C0, C1 = c0.clamp(min=ka), c1.clamp(max=kb)
        live = (B > A) & (C1 > C0)
        w = (C1 - C0).clamp(min=0)
        if kind == "full":
            n = (B - A).clamp(min=0) * w
        else:
            d = kb - qb            # causal: k <= q + d
            e = ka - qa            # inv_causal: k >= q + e
            below = _clamped_prefix(B + d + 1 - C0, w) - _clamped_prefix(A + d + 1 - C0, w)   # k <= q + d
            if kind == "causal":
                n = below
            else:
                before = _clamped_prefix(B + e - C0, w) - _clamped_prefix(A + e - C0, w)      # k < q + e
                n = (B - A).clamp(min=0) * w - before if kind == "inv_causal" else \
                    (below - before if e <= d else torch.zeros_like(below))
        count += torch.where(live, n, torch.zeros_like(n))
    area = (r1 - r0) * (c1 - c0)
    return torch.where(count == area, FULL, torch.where(count > 0, PARTIAL, EMPTY)).to(torch.uint8)


def tile_size(seqlen: int) -> int:
    """The tile side for a global length: 128 from 2048 tokens, down to 16 for short ones."""
    t = 16
    while t < 128 and t * 16 < seqlen:
        t *= 2
    return t


def _contiguous(segs: Sequence[Segment]) -> List[Tuple[int, int, int]]:
    """(global start, count, local offset) of each segment (step 1 required)."""
    out, off = [], 0
    for s in segs:
        if s.count > 1 and s.step != 1:
            raise ValueError("masks need contiguous shards (basic, zigzag or a balanced_layout), not a strided one")
        if s.count:
            out.append((s.start, s.count, off))
        off += s.count
    return out


def plan_masked(q_segs: Sequence[Segment], k_segs: Sequence[Segment], tiles, tile: int, *,
                split_runs: bool = True) -> List[BlockCall]:
    """Kernel calls of local queries (``q_segs``) against one key block (``k_segs``) under a
    tile classification (:meth:`Predicate.tiles`).  ``split_runs=False`` (a kernel without
    an lse): one call per query band over its non-empty tiles, so no two calls share a row."""
    classes = tiles.tolist() if isinstance(tiles, torch.Tensor) else tiles   # converted once by masked_ring
    calls: List[BlockCall] = []
    for qa, nq, qo in _contiguous(q_segs):
        for ka, nk, ko in _contiguous(k_segs):
            band_calls: List[Tuple[int, int, List[Tuple[int, int, bool]]]] = []
            r = qa
            while r < qa + nq:
                t = r // tile
                r1 = min(qa + nq, (t + 1) * tile)
                row = classes[t]
                pieces = []
                c = ka
                while c < ka + nk:
                    u = c // tile
                    c1 = min(ka + nk, (u + 1) * tile)
                    pieces.append((c, c1, row[u]))
                    c = c1
                runs = _runs(pieces, split_runs)
                band_calls.append((r, r1, runs))
                r = r1
            # merge vertically adjacent bands with the same runs
            merged: List[Tuple[int, int, List[Tuple[int, int, bool]]]] = []
            for r0, r1, runs in band_calls:
                if merged and merged[-1][2] == runs and merged[-1][1] == r0:
                    merged[-1] = (merged[-1][0], r1, runs)
                else:
                    merged.append((r0, r1, runs))
            for r0, r1, runs in merged:
                for c0, c1, masked in runs:
                    calls.append(BlockCall(qo + r0 - qa, qo + r1 - qa, ko + c0 - ka, ko + c1 - ka, False,
                                           c0 - r0, masked=masked))
    return calls


def _runs(pieces, split_runs: bool) -> List[Tuple[int, int, bool]]:
    """Runs of non-empty tiles of one band: (k start, k stop, needs a mask)."""
    runs: List[Tuple[int, int, bool]] = []
    if not split_runs:
        live = [p for p in pieces if p[2] != EMPTY]
        if not live:
            return []
        a, z = live[0][0], live[-1][1]
        masked = any(p[2] != FULL for p in pieces if a <= p[0] and p[1] <= z)
        return [(a, z, masked)]
    for c0, c1, cls in pieces:
        if cls == EMPTY:
            continue
        if runs and runs[-1][1] == c0:
            a, _, m = runs[-1]
            runs[-1] = (a, c1, m or cls == PARTIAL)
        else:
            runs.append((c0, c1, cls == PARTIAL))
    return runs


def dense_mask(pred: Predicate, q_segs: Sequence[Segment], k_segs: Sequence[Segment], call: BlockCall,
               heads: Optional[Sequence[int]] = None, device=None) -> torch.Tensor:
    """The bool mask ``[B|1, H|1, Sq, Sk]`` of one masked call (its rows and keys mapped to global positions)."""
    qpos = _local_positions(q_segs)[call.q_start:call.q_stop]
    kpos = _local_positions(k_segs)[call.k_start:call.k_stop]
    m = pred.keep(qpos, kpos, heads)
    return m.to(device) if device is not None else m


def _local_positions(segs: Sequence[Segment]) -> torch.Tensor:
    parts = [torch.arange(s.start, s.start + s.count * s.step, s.step) for s in segs if s.count]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def masked_ring(pred: Predicate, segments: Sequence[Sequence[Segment]], seqlen: int, *, split_runs: bool = True):
    """Every ring rank's calls against every source block under the predicate
    (``[rank][src]`` lists of :class:`~usp_hal.sequence.blocks.BlockCall`), and whether no rank needs
    another's keys (then the ring exchanges nothing)."""
    tile = tile_size(seqlen)
    classes = pred.tiles(seqlen, tile).tolist()
    R = len(segments)
    every = [[plan_masked(segments[a], segments[src], classes, tile, split_runs=split_runs) for src in range(R)]
             for a in range(R)]
    local = R > 1 and all(not every[a][b] for a in range(R) for b in range(R) if a != b)
    return every, local


def ring_work(mask, layout, seqlen: int, ring_size: int, causal: bool = False,
              cu_seqlens: Optional[Tuple[int, ...]] = None, split_runs: bool = True):
    """What the planner prices for a masked call: per ring rank, per step (step ``s`` meets
    the block of rank ``(r - s) mod R``), the ``(rows, cols, False)`` of every kernel call
    of the masked plan (empty tiles cost nothing, a partial run is priced as its whole
    rectangle); the shard lengths; and whether no rank needs another's keys."""
    from .positions import ring_segments
    m = Mask.of(mask)
    cu = None if cu_seqlens is None else tuple(cu_seqlens)
    segs = [ring_segments(layout, seqlen, ring_size, r, cu_seqlens=cu) for r in range(ring_size)]
    every, local = masked_ring(Predicate(m, causal=bool(causal), cu_seqlens=cu), segs, seqlen,
                               split_runs=split_runs)
    R = ring_size
    steps = tuple(tuple(tuple((c.q_stop - c.q_start, c.k_stop - c.k_start, False) for c in every[r][(r - s) % R])
                        for s in range(R)) for r in range(R))
    return steps, tuple(sum(x.count for x in sg) for sg in segs), local


# --------------------------------------------------------------------------------- balance
def _area(pred: Predicate, start: int, stop: int, kpos: torch.Tensor) -> int:
    """The (query, key) pairs the predicate keeps for queries ``start .. stop`` against ``kpos``
    (any batch row or head), evaluated 1024 query rows at a time."""
    total = 0
    for a in range(start, stop, 1024):
        z = min(stop, a + 1024)
        total += int(pred.keep(torch.arange(a, z), kpos).any(0).any(0).sum())
    return total


def mask_work(pred: Predicate, segments: Sequence[Sequence[Segment]]) -> List[int]:
    """Per ring rank: the (query, key) pairs its rows score under the predicate (per batch row and head)."""
    kpos = torch.arange(sum(s.count for segs in segments for s in segs))
    return [sum(_area(pred, s.start, s.start + s.count, kpos) for s in segs) for segs in segments]


def balanced_layout(mask, seqlen: int, ring_size: int, *, chunks_per_rank: int = 8, causal: bool = False,
                    cu_seqlens=None, name: Optional[str] = None, register: bool = True):
    """A layout that gives every ring rank about the same mask area: the sequence is cut into
    ``ring_size * chunks_per_rank`` chunks, and chunks, largest area first, go to the rank
    with the least work so far among those with a chunk slot left (a min-heap), so ranks
    hold equal token counts.  Registered under ``name`` (default ``"balanced-<digest>"``)
    for ``LongContextAttention(ring_impl_type=...)`` and ``usp_hal.shard(x, layout=...)``;
    valid for this ``seqlen`` and ``ring_size`` only.  Returns the
    :class:`~usp_hal.sequence.positions.Layout`."""
    from .positions import LAYOUTS, Layout, register_layout
    m = Mask.of(mask)
    S, R = int(seqlen), int(ring_size)
    C = R * int(chunks_per_rank)
    if S < C:
        raise ValueError(f"balanced_layout: {S} tokens cannot be cut into {C} chunks; lower chunks_per_rank")
    cu = None if cu_seqlens is None else tuple(int(x) for x in cu_seqlens)
    pred = Predicate(m, causal=bool(causal), cu_seqlens=cu)
    bounds = [S * i // C for i in range(C + 1)]
    kpos = torch.arange(S)
    area = [_area(pred, bounds[i], bounds[i + 1], kpos) for i in range(C)]
    heap = [(0, r) for r in range(R)]
    slots = [int(chunks_per_rank)] * R
    owner = [0] * C
    for i in sorted(range(C), key=lambda j: (-area[j], j)):
        held = []
        while True:
            work, r = heapq.heappop(heap)
            if slots[r]:
                break
            held.append((work, r))
        owner[i] = r
        slots[r] -= 1
        heapq.heappush(heap, (work + area[i], r))
        for item in held:
            heapq.heappush(heap, item)
    per_rank: List[List[Segment]] = [[] for _ in range(R)]
    for i in range(C):
        segs = per_rank[owner[i]]
        a, z = bounds[i], bounds[i + 1]
        if segs and segs[-1].start + segs[-1].count == a:
            segs[-1] = Segment(segs[-1].start, segs[-1].count + z - a)
        else:
            segs.append(Segment(a, z - a))
    table = tuple(tuple(s) for s in per_rank)
    digest = hashlib.blake2b(repr((S, R, table)).encode(), digest_size=4).hexdigest()
    label = name or f"balanced-{digest}"

    def split(n: int, ring: int, rank: int) -> List[Segment]:
        if (n, ring) != (S, R):
            raise ValueError(f"layout {label!r} was balanced for {S} tokens over {R} ring ranks, not {n} over {ring}")
        return list(table[rank])

    layout = Layout(label, split, contiguous=True, balances_causal=causal,
                    description=f"chunks balanced by mask area ({m.name}, {S} tokens, {R} ring ranks)", fixed=(S, R))
    if register:
        if label in LAYOUTS and LAYOUTS[label].description != layout.description:
            raise ValueError(f"layout {label!r} is already registered for another mask")
        register_layout(layout, override=True)
    return layout
