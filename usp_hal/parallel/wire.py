"""Byte-packed wire buffers, shared by the Ulysses exchange and the ring rotations.

A tensor whose parts have different dtypes (a codec's payload and its scales, fp8 values
beside their float32 scales) travels as one ``uint8`` buffer: each part starts at a
multiple of :data:`ALIGN` bytes, so that every part can be viewed in its own dtype in
place on the receiving side.  Pure tensor bookkeeping: no collective is issued here.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

ALIGN = 16   # bytes: every part of a byte-packed buffer starts at a multiple of this


def nbytes(shape, dtype: torch.dtype) -> int:
    """Bytes of a ``shape`` tensor of ``dtype``."""
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def typed(buf: torch.Tensor, off: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """A ``dtype`` view of ``shape`` into the uint8 buffer ``buf`` at byte offset ``off``."""
    return buf.narrow(0, off, nbytes(shape, dtype)).view(dtype).view(shape)


def packed_size(specs: Sequence[Tuple[tuple, torch.dtype]]) -> int:
    """Bytes of a buffer holding parts of these (shape, dtype), each aligned."""
    return sum(aligned(nbytes(shape, dtype)) for shape, dtype in specs)


def pack(parts: Sequence[torch.Tensor], device=None) -> torch.Tensor:
    """One uint8 buffer holding ``parts`` one after another, each aligned."""
    dev = device if device is not None else parts[0].device
    buf = torch.empty(packed_size([(p.shape, p.dtype) for p in parts]), dtype=torch.uint8, device=dev)
    off = 0
    for p in parts:
        typed(buf, off, p.shape, p.dtype).copy_(p)
        off += aligned(nbytes(p.shape, p.dtype))
    return buf


def views(buf: torch.Tensor, specs: Sequence[Tuple[tuple, torch.dtype]], off: int = 0) -> List[torch.Tensor]:
    """The parts of a :func:`pack`-ed buffer, as views, from their (shape, dtype)."""
    out = []
    for shape, dtype in specs:
        out.append(typed(buf, off, shape, dtype))
        off += aligned(nbytes(shape, dtype))
    return out
