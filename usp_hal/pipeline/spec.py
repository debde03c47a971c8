"""The call spec: everything about one attention call that every rank of the
sequence-parallel group must agree on, as one frozen, typed object.

``LongContextAttention`` builds a :class:`CallSpec` from its arguments once per call (after
validating them locally): the fields the pipeline reads by name, and the rest of the call's
:class:`KernelCall` as one field of values (:data:`CALL_VALUES`), so a new scalar option of
the call is agreed on without a field here.  Its integer metadata vector (:meth:`CallSpec.meta`) is derived
from the fields, one encoder per field type, and is what the ranks exchange: one small
all-gather tells every rank every rank's local length and shows any disagreement, which
:func:`compare` turns into one error naming each differing field and each rank's value.
A rank that failed its local validation sends the error flag with zeros instead.
"""
from __future__ import annotations

import functools
import struct
import typing
import zlib
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..bounded import BoundedCache
from ..dispatch.capabilities import KernelCall
from ..parallel.comm import digest_ints, dtype_code

# fields that may differ between ranks (everything else must agree)
PER_RANK = ("local_len", "positions")

#: :class:`KernelCall` fields a spec does not hold as they are: its tensors and its packing,
#: which a spec agrees on as digests of its own (``alibi``, ``mask``, ``docs``), and
#: ``key_offset``, which only a ring block has (0 for a whole call)
NOT_AS_VALUES = ("alibi_slopes", "mask", "packing", "key_offset")

#: the metadata of a spec field (``field(metadata=CALL_VALUES)``) that holds the rest of its
#: call's :class:`KernelCall` values: every call field the spec neither declares by name nor
#: lists in :data:`NOT_AS_VALUES`, in the call's field order (:func:`call_names`).  Each is
#: encoded, compared and named in errors as if the spec declared it, so a new scalar option of
#: a kernel call is agreed on by the ranks without a spec field of its own.
CALL_VALUES = {"call_values": True}


@dataclass(frozen=True)
class CallSpec:
    """One attention call, as seen by one rank (validated)."""

    batch: int
    local_len: int
    heads: int
    kv_heads: int
    head_dim: int
    v_dim: int
    dtype: torch.dtype
    device_type: str
    causal: bool
    window: Tuple[int, int]
    call_values: Tuple[Any, ...] = field(metadata=CALL_VALUES)   # the call's other values: call_names()
    alibi: int                 # 0: none; else a digest of the slope values
    needs_grad: bool
    return_lse: bool
    layout: str
    rotation: str
    ulysses: int
    ring: int
    wire: str                  # wire codecs, e.g. "q=fp8,v=fp8,out=fp8"
    positions: int = 0         # 0: not given; else a digest of this rank's global positions
    docs: int = 0              # 0: one sequence; else a digest of the document boundaries
    joint: str = ""            # "": none; else joint strategy and joint token count
    mask: int = 0              # 0: no mask=; else a digest of what the mask selects (validate.mask_digest)
    sinks: int = 0             # per-head sink logits: 0 none; else a digest of their values and requires_grad

    @property
    def positional(self) -> bool:
        return tuple(self.window) != (-1, -1) or self.alibi != 0

    @classmethod
    def of(cls, call: KernelCall, **rest) -> "CallSpec":
        """The spec of a call whose options are ``call``: the fields it shares with the
        :class:`KernelCall` (by name) from it, the others from ``rest``."""
        return spec_of(cls, call, **rest)

    def meta(self) -> List[int]:
        """The metadata vector: error flag 0, then every field encoded as integers."""
        return meta_vector(self)


def spec_of(cls, call: KernelCall, **rest):
    """An instance of the spec dataclass ``cls`` whose fields named like a :class:`KernelCall`
    field come from ``call``, and whose :data:`CALL_VALUES` field (if it has one) holds the
    call's other values (:func:`call_names`); ``rest``: the other fields."""
    shared, holder, names = _shape(cls).call_fields
    got = {name: getattr(call, name) for name in shared if name not in rest}
    if holder is not None and holder not in rest:
        got[holder] = tuple(getattr(call, name) for name in names)
    return cls(**got, **rest)


def call_names(cls=None) -> Tuple[str, ...]:
    """The :class:`KernelCall` fields that the :data:`CALL_VALUES` field of the spec dataclass
    ``cls`` (by default :class:`CallSpec`) holds, in order."""
    return _shape(cls if cls is not None else CallSpec).call_fields[2]


class _Unit(NamedTuple):
    """One named value of a spec's metadata vector: a field, or one call value of the
    :data:`CALL_VALUES` field."""
    name: str
    width: int          # integers it takes (an (int, int) pair: 2)
    real: bool          # a float (or an optional one): encoded as its IEEE bits, shown as a number
    label: str          # what the spec's field says it is ("": its name alone)
    per_rank: bool      # may differ between ranks (:data:`PER_RANK`, :class:`CallSpec` only)


class _Shape(NamedTuple):
    units: Tuple[_Unit, ...]
    call_fields: Tuple[Tuple[str, ...], Optional[str], Tuple[str, ...]]   # (shared, holder, held names)


def _unit(name: str, hint, label: str, per_rank: bool) -> _Unit:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    width = len(args) if typing.get_origin(hint) is tuple and Ellipsis not in args else 1
    real = hint is float or (typing.get_origin(hint) is typing.Union and args == [float])
    return _Unit(name, width, real, label, per_rank)


@functools.lru_cache(maxsize=None)
def _shape(cls) -> _Shape:
    """The units of ``cls``'s metadata vector and how its fields come from a :class:`KernelCall`."""
    own = {f.name: f for f in fields(cls)}
    hints, call_hints = typing.get_type_hints(cls), typing.get_type_hints(KernelCall)
    values = [f.name for f in fields(KernelCall) if f.name not in NOT_AS_VALUES]
    shared = tuple(name for name in values if name in own)
    holders = [f.name for f in fields(cls) if f.metadata.get("call_values")]
    holder = holders[0] if holders else None
    held = tuple(name for name in values if name not in own) if holder is not None else ()
    units: List[_Unit] = []
    for f in fields(cls):
        label = f.metadata.get("label", "")
        if f.name == holder:
            units += [_unit(name, call_hints[name], label, False) for name in held]
        else:
            units.append(_unit(f.name, hints[f.name], label, cls is CallSpec and f.name in PER_RANK))
    return _Shape(tuple(units), (shared, holder, held))


def meta_vector(spec) -> List[int]:
    """A frozen spec dataclass's metadata vector: error flag 0, then every field encoded as
    integers, one encoder per field type (a tuple gives one integer per item; the
    :data:`CALL_VALUES` field, each value as its own field)."""
    out = [0]
    for f in fields(spec):
        value = getattr(spec, f.name)
        if f.metadata.get("call_values"):
            for item in value:
                out += _encode(item)
        else:
            out += _encode(value)
    return out


@functools.lru_cache(maxsize=None)
def field_index(name: str) -> int:
    """Index of field ``name`` in a metadata vector (after the error flag)."""
    i = 1
    for u in _shape(CallSpec).units:
        if u.name == name:
            return i
        i += u.width
    raise KeyError(name)


@functools.lru_cache(maxsize=None)
def meta_length() -> int:
    """Length of every rank's metadata vector (the same for a rank that failed)."""
    return 1 + sum(u.width for u in _shape(CallSpec).units)


def error_meta() -> List[int]:
    return [1] + [0] * (meta_length() - 1)


def _encode(value) -> List[int]:
    if isinstance(value, bool):
        return [int(value)]
    if isinstance(value, int):
        return [value]
    if isinstance(value, float):
        return [struct.unpack("<q", struct.pack("<d", value))[0]]
    if isinstance(value, torch.dtype):
        return [dtype_code(value)]
    if isinstance(value, str):
        return [zlib.crc32(value.encode()) if value else 0]
    if isinstance(value, tuple):
        return [int(x) for x in value]
    raise TypeError(f"cannot encode {value!r} in the call metadata")


def decode_rows(rows: Sequence[Sequence[int]], kind: type = CallSpec) -> List[Dict[str, int]]:
    """Per rank: field name -> encoded value(s) (tuple for multi-int fields) of a ``kind`` spec
    (the values of its :data:`CALL_VALUES` field by their :class:`KernelCall` names)."""
    out = []
    for row in rows:
        i = 1
        d: dict = {}
        for u in _shape(kind).units:
            d[u.name] = tuple(row[i:i + u.width]) if u.width > 1 else row[i]
            i += u.width
        out.append(d)
    return out


def compare(rows: Sequence[Sequence[int]], ranks: Sequence[object], local=None, kind: Optional[type] = None
            ) -> List[str]:
    """Human-readable differences between the ranks' specs: one line per differing field,
    every rank's value (the metadata vectors of a ``kind`` spec, by default :class:`CallSpec`,
    whose per-rank ``local_len`` and ``positions`` are not compared).  A field whose metadata
    has a ``label`` (what the decode spec's fields say they are) is named by it too."""
    kind = kind if kind is not None else type(local) if local is not None else CallSpec
    decoded = decode_rows(rows, kind)
    diffs = []
    for u in _shape(kind).units:
        if u.per_rank:
            continue
        vals = [d[u.name] for d in decoded]
        if len(set(vals)) > 1:
            mine = _value(local, u.name) if local is not None else None
            shown = ", ".join(f"rank {r}={_show(u, v, mine, local)}" for r, v in zip(ranks, vals))
            diffs.append(f"{u.label} ({u.name}): {shown}" if u.label else f"{u.name}: {shown}")
    return diffs


def _value(spec, name: str):
    """A spec's value of field ``name``, or of that call value of its :data:`CALL_VALUES` field."""
    kind: type = type(spec)
    _, holder, held = _shape(kind).call_fields
    if holder is not None and name in held:
        return getattr(spec, holder)[held.index(name)]
    return getattr(spec, name)


def _show(unit: _Unit, enc, mine, local) -> str:
    """Readable value of an encoded field (exact for numbers; names for known strings)."""
    name = unit.name
    if unit.real:
        return repr(struct.unpack("<d", struct.pack("<q", enc))[0])
    if name == "dtype":
        for dt in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            if dtype_code(dt) == enc:
                return str(dt).replace("torch.", "")
        return f"code {enc}"
    if name in ("layout", "rotation", "device_type", "wire", "joint"):
        for cand in _known_strings():
            if (zlib.crc32(cand.encode()) if cand else 0) == enc:
                return repr(cand)
        if local is not None and _encode(mine) == [enc]:
            return repr(mine)
        return f"<{enc:#x}>"
    if name == "docs":     # the document boundaries of a packed call
        return "none (no cu_seqlens)" if enc == 0 else f"cu_seqlens digest {enc & 0xffffffff:08x}"
    if name == "mask":      # what the mask selects (usp_hal.sequence.masks.Predicate.digest)
        return "none" if enc == 0 else "a mask" if enc == 1 else \
            f"a mask selecting different pairs, digest {enc & 0xffffffff:08x}"
    if name == "sinks":
        return "none" if enc == 0 else f"sink logits with digest {enc & 0xffffffff:08x} (values and requires_grad)"
    if name in ("alibi", "positions"):
        return "none" if enc == 0 else f"digest {enc & 0xffffffff:08x}"
    return str(enc)


def _known_strings() -> List[str]:
    from ..parallel.codec import CODECS
    from ..parallel.rotation import ROTATIONS
    from ..sequence.positions import LAYOUTS
    names = list(LAYOUTS) + list(ROTATIONS) + ["cpu", "cuda", "rocm", "npu", "xpu", ""]
    names += [f"q={c},k={d},v={c},out={c}" for c in CODECS for d in CODECS]
    return names


def fingerprint(*ts: torch.Tensor) -> int:
    """Cheap exact-ish fingerprint of tensors (the same inputs give the same ints on every
    rank: replicated tensors are computed by the same ops): two weighted sums per tensor,
    read to the host together (one device->host copy)."""
    sums = []
    for t in ts:
        x = t.detach().to(torch.float64).reshape(-1)
        w = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device)
        sums += [x.sum(), (x * w).sum()]
    vals = torch.stack(sums).tolist() if sums else []
    return digest_ints(list(struct.unpack(f"<{len(vals)}q", struct.pack(f"<{len(vals)}d", *vals))))


def digest_tensor(t: torch.Tensor) -> int:
    """A non-zero 63-bit digest of a tensor's values (exact: any changed bit changes it)."""
    data = t.detach().to("cpu", torch.float64).contiguous()
    h = zlib.crc32(struct.pack("<q", data.numel()) + bytes(data.view(torch.uint8).tolist()))
    h2 = zlib.adler32(bytes(data.view(torch.uint8).tolist()))
    return ((h << 31) ^ h2) | 1


class TensorDigests:
    """:func:`digest_tensor` of small tensors that calls pass again and again (alibi slopes,
    sink logits), cached per tensor object and version, so a reused tensor costs no
    device->host copy after its first call."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self._seen: BoundedCache[tuple, int] = BoundedCache(limit)

    def __call__(self, t: torch.Tensor) -> int:
        key = (id(t), t.data_ptr(), getattr(t, "_version", 0), tuple(t.shape), t.dtype)
        return self._seen.get_or(key, lambda: digest_tensor(t))


__all__ = ["CALL_VALUES", "CallSpec", "NOT_AS_VALUES", "TensorDigests", "call_names", "compare", "decode_rows",
           "digest_ints", "digest_tensor", "error_meta", "field_index", "fingerprint", "meta_length", "meta_vector",
           "spec_of"]
