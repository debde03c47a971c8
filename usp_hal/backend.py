"""The backend base class and the kernel contract every adapter implements.

Contract (what the USP core relies on, whichever kernel runs underneath)::

    forward(q, k, v, *, softmax_scale, causal=False, window=(-1, -1), softcap=0.0,
            alibi_slopes=None, dropout_p=0.0, key_offset=0) -> (out, lse)
    backward(dout, q, k, v, out, lse, *, softmax_scale, causal=False, window=(-1, -1),
             softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False,
             key_offset=0) -> (dq, dk, dv)

* ``q`` is ``[B, Sq, H, D]``, ``k``/``v`` are ``[B, Sk, Hkv, D]`` (``H % Hkv == 0``).
* ``out`` is ``[B, Sq, H, D]`` in the input dtype; ``lse`` is ``[B, H, Sq]`` float32
  (float64 for float64 inputs),
  natural log of the sum over keys of ``exp(scale * q.k)``, and ``-inf`` for a row that
  sees no key (whatever the kernel itself writes there).
* ``causal`` is only requested with ``Sq == Sk`` (the core splits every causal block into
  square diagonal blocks and full rectangles), so top-left vs bottom-right alignment never
  matters to the core.
* ``window=(left, right)`` keeps key ``n`` for query ``m`` when
  ``m - left <= n + key_offset <= m + right`` (``-1`` = unbounded on that side);
  ``alibi_slopes`` adds ``-slope * |n + key_offset - m|``.  ``key_offset`` (global key
  position minus global query position of the two blocks) is non-zero only for backends
  that declare ``SUPPORTS_KEY_OFFSET``.
* ``backward`` may be given the *global* (ring-merged) ``out``/``lse``; rows whose lse is
  ``-inf`` (they saw no key at all) must contribute nothing (see ``lse_for_backward``).
* ``dk``/``dv`` come back with ``Hkv`` heads; all grads in the input dtype.

Capabilities are class attributes (data).  ``not_supported_reasons`` and the probe read
them; nothing else restates them.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import ClassVar, Optional

import torch

from . import platform as _platform
from .capabilities import Availability, AttnRequest, Package, capability_row, not_supported_reasons


class BackendUnavailable(RuntimeError):
    """Raised when a backend is asked to run where it cannot."""


def installed_version(pkg: Package) -> Optional[str]:
    for name in (pkg.dist,) + tuple(pkg.alt_dists):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def parse_version(text: str):
    """Numeric version parsing (never compare version strings as strings)."""
    from packaging.version import InvalidVersion, Version
    try:
        return Version(text)
    except InvalidVersion:
        # local builds such as '2.7.4.post1+cu12torch2.6' parse; anything else: keep the numbers
        import re
        nums = re.findall(r"\d+", text)
        return Version(".".join(nums[:3]) if nums else "0")


class AttentionBackend:
    """Base class: declare capabilities as data, implement forward/backward."""

    NAME: ClassVar[str] = "base"
    DESCRIPTION: ClassVar[str] = ""
    SUPPORTED_DEVICES: ClassVar[frozenset] = frozenset()
    SUPPORTED_DTYPES: ClassVar[frozenset] = frozenset()
    HEAD_DIM_MIN: ClassVar[int] = 1
    HEAD_DIM_MAX: ClassVar[Optional[int]] = None
    HEAD_DIM_MULTIPLE: ClassVar[int] = 1
    SUPPORTS_DIFFERENT_V_DIM: ClassVar[bool] = False
    SUPPORTS_CAUSAL: ClassVar[bool] = True
    SUPPORTS_WINDOW: ClassVar[bool] = False
    SUPPORTS_SOFTCAP: ClassVar[bool] = False
    SUPPORTS_ALIBI: ClassVar[bool] = False
    SUPPORTS_DROPOUT: ClassVar[bool] = False
    SUPPORTS_GQA: ClassVar[bool] = True
    SUPPORTS_KEY_OFFSET: ClassVar[bool] = False
    RETURNS_LSE: ClassVar[bool] = True
    HAS_BACKWARD: ClassVar[bool] = True
    IS_DETERMINISTIC: ClassVar[bool] = False
    SUPPORTS_DETERMINISTIC: ClassVar[bool] = False
    MIN_COMPUTE_CAPABILITY: ClassVar[dict] = {}
    REQUIRED_PACKAGES: ClassVar[tuple] = ()
    # packed documents (cu_seqlens): the block plan cuts every call at document boundaries, so
    # a kernel that honours the contract on dense blocks serves them; False refuses them
    SUPPORTS_VARLEN: ClassVar[bool] = True

    # ---------------------------------------------------------------- declarations
    @classmethod
    def not_supported_reasons(cls, request: AttnRequest) -> list:
        return not_supported_reasons(cls, request)

    @classmethod
    def supports(cls, request: AttnRequest) -> bool:
        return not cls.not_supported_reasons(request)

    @classmethod
    def extra_reasons(cls, request: AttnRequest) -> list:
        """Rules that are not plain capability flags (version-dependent features...)."""
        return []

    @classmethod
    def capabilities(cls) -> dict:
        return capability_row(cls)

    # ---------------------------------------------------------------- availability
    @classmethod
    def package_versions(cls) -> dict:
        return {p.dist: installed_version(p) for p in cls.REQUIRED_PACKAGES}

    @classmethod
    def availability(cls) -> Availability:
        """Can this backend run on this machine?  Cheap: metadata and find_spec only."""
        version = None
        for pkg in cls.REQUIRED_PACKAGES:
            ver = installed_version(pkg)
            if ver is None or importlib.util.find_spec(pkg.module) is None:
                hint = f" (pip install 'usp-hal[{pkg.extra}]')" if pkg.extra else ""
                return Availability(False, f"{pkg.dist} not installed{hint}")
            if pkg.min_version and parse_version(ver) < parse_version(pkg.min_version):
                return Availability(False, f"{pkg.dist} {ver} too old (needs >= {pkg.min_version})", ver)
            version = version or ver
        present = [d for d in _platform.available_device_types() if d in cls.SUPPORTED_DEVICES]
        if not present:
            found = ", ".join(_platform.available_device_types())
            return Availability(False, f"needs a {'/'.join(sorted(cls.SUPPORTED_DEVICES))} device, found {found}", version)
        dev = present[0]
        mincc = cls.MIN_COMPUTE_CAPABILITY.get(dev)
        if mincc is not None:
            cc = _platform.compute_capability(dev)
            if cc is not None and tuple(cc) < tuple(mincc):
                return Availability(False, f"needs {dev} compute capability >= {mincc[0]}.{mincc[1]}, "
                                           f"found {cc[0]}.{cc[1]}", version)
        extra = cls.extra_availability(dev, version)
        if extra:
            return Availability(False, extra, version)
        return Availability(True, "", version, {"device": dev})

    @classmethod
    def extra_availability(cls, device_type: str, version: Optional[str]) -> str:
        """Backend-specific availability check; return a reason or ''."""
        return ""

    # ---------------------------------------------------------------- kernel contract
    def forward(self, q, k, v, *, softmax_scale, causal=False, window=(-1, -1), softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, key_offset=0):
        raise NotImplementedError(f"{self.NAME}: forward not implemented")

    def backward(self, dout, q, k, v, out, lse, *, softmax_scale, causal=False, window=(-1, -1),
                 softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False, key_offset=0):
        raise NotImplementedError(f"{self.NAME} is forward-only: it has no backward")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.NAME!r}>"


def normalize_lse(lse: torch.Tensor, empty_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Canonical lse: float32 (float64 stays float64), contiguous [B, H, S]; +inf (FA2's empty-row value) -> -inf;
    rows flagged in ``empty_rows`` (bool, broadcastable) -> -inf."""
    lse = lse.to(torch.promote_types(lse.dtype, torch.float32)).contiguous()
    lse = lse.masked_fill(lse == float("inf"), float("-inf"))
    if empty_rows is not None:
        lse = lse.masked_fill(empty_rows, float("-inf"))
    return lse


def pad_head_dim(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last dim to a multiple (kernels that reject odd head dims)."""
    d = x.shape[-1]
    pad = (-d) % multiple
    if pad == 0:
        return x
    return torch.nn.functional.pad(x, (0, pad))


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """Rows that saw no key (lse = -inf) must give zero gradient: exp(s - (+inf)) = 0."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def position_mask(sq: int, sk: int, *, causal: bool, window, key_offset: int, alibi_slopes,
                  batch: int, heads: int, dtype: torch.dtype, device) -> "tuple[torch.Tensor, torch.Tensor]":
    """Additive float mask for the contract's causal/window/alibi semantics.

    Returns ``(mask, empty_rows)``: mask broadcastable to ``[B, H, Sq, Sk]`` and a bool
    ``empty_rows`` broadcastable to ``[B, H, Sq]`` for query rows that see no key.
    """
    m = torch.arange(sq, device=device).unsqueeze(1)
    n = torch.arange(sk, device=device).unsqueeze(0) + key_offset
    dist = n - m                      # key position minus query position
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        keep &= dist <= 0
    left, right = window
    if left >= 0:
        keep &= dist >= -left
    if right >= 0:
        keep &= dist <= right
    work = torch.float64 if dtype == torch.float64 else torch.float32
    mask = torch.zeros(sq, sk, dtype=work, device=device)
    mask.masked_fill_(~keep, float("-inf"))
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=device, dtype=work)
        slopes = slopes.view(1, heads, 1, 1) if slopes.dim() == 1 else slopes.view(batch, heads, 1, 1)
        mask = mask - slopes * dist.abs().to(work)
    else:
        mask = mask.view(1, 1, sq, sk)
    empty = (~keep).all(dim=-1).view(1, 1, sq)
    return mask.to(dtype), empty
