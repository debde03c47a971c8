"""Wire codecs: how a tensor travels in the Ulysses all-to-all and around the ring.

A codec turns a ``[B, S, H, D]`` tensor into one or more wire parts, each
``[B, S, H, d_i]`` (so the exchange can split every part by heads or by tokens exactly like
the tensor itself), and back.  ``identity`` sends the tensor as it is.  ``fp8`` sends
``float8_e4m3fn`` values (as raw bytes, so it works on every dist backend, gloo included)
with one float32 scale per token and head::

    scale = max(|x[b, s, h, :]|) / 448        (448 = the largest float8_e4m3fn value)
    wire  = (x / scale) -> float8_e4m3fn,  scale
    x'    = float(wire) * scale                (in the input dtype)

At head dim 64 that is 64 + 4 bytes per token and head instead of 128 for bf16 (0.53x).
A new codec is one subclass registered with :func:`register_codec`.
"""
from __future__ import annotations

from typing import Dict, List

import torch


class Codec:
    """Identity: the tensor travels as it is."""

    name = "identity"
    identity = True
    lossy = False

    def encode(self, x: torch.Tensor) -> List[torch.Tensor]:
        return [x]

    def decode(self, parts: List[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return parts[0].to(dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What the receiver gets for ``x`` (used where data stays local, so every token is
        coded alike whichever rank holds it)."""
        return x

    def wire_bytes(self, shape, dtype: torch.dtype) -> int:
        n = 1
        for s in shape:
            n *= int(s)
        return n * torch.empty((), dtype=dtype).element_size()

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0


class Float8Codec(Codec):
    """float8_e4m3fn values with a float32 scale per token and head (see the module doc)."""

    name = "fp8"
    identity = False
    lossy = True

    def __init__(self) -> None:
        if FP8_DTYPE is None:  # pragma: no cover - torch < 2.1
            raise RuntimeError("this torch has no float8_e4m3fn dtype; the fp8 wire format needs torch >= 2.1")
        self.fp8: torch.dtype = FP8_DTYPE

    def encode(self, x: torch.Tensor) -> List[torch.Tensor]:
        xf = x.float()
        amax = xf.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (xf / scale).to(self.fp8)
        return [q.view(torch.uint8), scale]

    def decode(self, parts: List[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        q, scale = parts
        return (q.view(self.fp8).float() * scale).to(dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x), x.dtype)

    def wire_bytes(self, shape, dtype: torch.dtype) -> int:
        n = 1
        for s in shape[:-1]:
            n *= int(s)
        return n * (int(shape[-1]) + 4)


IDENTITY = Codec()
CODECS: Dict[str, type] = {"identity": Codec, "fp8": Float8Codec}


def get_codec(name) -> Codec:
    if isinstance(name, Codec):
        return name
    if name is None:
        return IDENTITY
    try:
        cls = CODECS[str(name)]
    except KeyError:
        raise ValueError(f"unknown wire codec {name!r}; valid: {', '.join(CODECS)}") from None
    return IDENTITY if cls is Codec else cls()


def register_codec(cls: type, *, override: bool = False) -> type:
    """Add a :class:`Codec` subclass to :data:`CODECS` under its ``name``; from then on
    ``LongContextAttention(wire_codecs={...: name})`` accepts it."""
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise TypeError(f"register_codec needs a Codec subclass, got {cls!r}")
    name = str(cls.name)
    if name in CODECS and CODECS[name] is not cls and not override:
        raise ValueError(f"wire codec {name!r} is already registered (pass override=True to replace it)")
    CODECS[name] = cls
    return cls
