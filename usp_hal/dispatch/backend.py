"""The backend base class and the kernel contract every adapter implements.

Contract (what the USP core relies on, whichever kernel runs underneath)::

    forward(q, k, v, call) -> (out, lse)
    backward(dout, q, k, v, out, lse, call) -> (dq, dk, dv)

``call`` is a :class:`~usp_hal.dispatch.capabilities.KernelCall`: every option of the call
(scale, causal, window, alibi slopes, key offset, mask, ...) in one frozen value, which the
plan builds once per call and the ring derives per block.

* ``q`` is ``[B, Sq, H, D]``, ``k``/``v`` are ``[B, Sk, Hkv, D]`` (``H % Hkv == 0``), with any
  strides: the base class makes them acceptable to the kernel (``INPUT_LAYOUT``), copying
  only when the kernel needs it.
* ``out`` is ``[B, Sq, H, D]`` in the input dtype; ``lse`` is ``[B, H, Sq]`` float32
  (float64 for float64 inputs), natural log of the sum over keys of ``exp(scale * q.k)``,
  and ``-inf`` for a row that sees no key (whatever the kernel itself writes there).  A
  kernel without an lse (``RETURNS_LSE`` False, or a version-dependent :class:`Limit` on
  ``"lse"``) gives an lse of NaN: dispatch never hands such a backend a call that needs one,
  and any use of it would show as NaN rather than as a plausible number.
* ``call.causal`` on ``Sq != Sk`` means top-left alignment (key ``n`` visible to query ``m``
  when ``n <= m``); the core only asks for causal on square diagonal blocks, and a backend
  whose kernel aligns differently declares it in ``POSITIONS`` (translated or refused per call).
* ``call.window=(left, right)`` keeps key ``n`` for query ``m`` when
  ``m - left <= n + key_offset <= m + right`` (``-1`` = unbounded on that side);
  ``call.alibi_slopes`` adds ``-slope * |n + key_offset - m|``.  ``call.key_offset`` (global
  key position minus global query position of the two blocks) matters only with
  window/alibi, and only backends that declare ``SUPPORTS_KEY_OFFSET`` get a non-zero one there.
* ``call.mask`` (only for backends that declare ``SUPPORTS_MASK``) is a bool tensor
  broadcastable to ``[B, H, Sq, Sk]``, True where the query attends the key, combined (and)
  with causal/window; a row it leaves without any key has out 0 and lse ``-inf``.
* ``backward`` may be given the *global* (ring-merged) ``out``/``lse``; rows whose lse is
  ``-inf`` (they saw no key at all) must contribute nothing (see ``lse_for_backward``).
* ``dk``/``dv`` come back with ``Hkv`` heads; all grads in the input dtype.

Capabilities are class attributes (data), plus per-version and per-device :class:`Limit`
entries and the :class:`Positions` of the kernel's masks.  ``not_supported_reasons`` reads
them (subclasses extend it with ``super()`` for anything that is not data); dispatch, the
probe, the docs, the CI matrices and the per-call check of ``forward``/``backward`` all go
through it.  An adapter implements ``kernel_forward(q, k, v, call)`` /
``kernel_backward(dout, q, k, v, out, lse, call)`` (``call.scale`` then a float) and never
repeats a check: ``forward``/``backward`` validate each distinct call signature (shapes,
dtypes, device, ``call.key``) once, then a tuple lookup per call, and only then run the kernel.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any, ClassVar, Optional

import torch

from ..bounded import BoundedCache
from . import platform as _platform
from .capabilities import (
    TOP_LEFT,
    AttnRequest,
    Availability,
    KernelCall,
    Package,
    Positions,
    RuleContext,
    Unsupported,
    capability_row,
    declared_reasons,
    sorted_dtypes,
)

__all__ = ["AttentionBackend", "BackendUnavailable", "KernelCall", "Unsupported", "Refusal", "refusal_text",
           "installed_version", "parse_version", "normalize_lse", "lse_for_backward",
           "pad_head_dim", "position_mask", "no_lse"]

#: INPUT_LAYOUT values: what strides the kernel accepts for q/k/v (and dout/out in backward).
INPUT_LAYOUTS = ("strided", "last-dim-contiguous", "contiguous")


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
    """Base class: declare capabilities as data, implement ``kernel_forward``/``kernel_backward``."""

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
    #: the kernel takes ``mask=`` (bool, broadcastable to [B, H, Sq, Sk], True = attend): the
    #: core hands it the partial blocks of a masked call; without it only calls whose blocks
    #: are all full or empty can run (they need no mask), and ``mask=`` calls are refused
    SUPPORTS_MASK: ClassVar[bool] = False
    RETURNS_LSE: ClassVar[bool] = True
    HAS_BACKWARD: ClassVar[bool] = True
    IS_DETERMINISTIC: ClassVar[bool] = False
    SUPPORTS_DETERMINISTIC: ClassVar[bool] = False
    MIN_COMPUTE_CAPABILITY: ClassVar[dict] = {}
    MAX_COMPUTE_CAPABILITY: ClassVar[dict] = {}
    REQUIRED_PACKAGES: ClassVar[tuple] = ()
    #: per-version / per-device limits (:class:`usp_hal.dispatch.capabilities.Limit`)
    LIMITS: ClassVar[tuple] = ()
    #: where the kernel anchors causal/window masks when Sq != Sk
    POSITIONS: ClassVar[Positions] = TOP_LEFT
    #: "strided" | "last-dim-contiguous" | "contiguous": what the kernel takes without a copy
    INPUT_LAYOUT: ClassVar[str] = "strided"
    #: device types on which the kernel turns a query row holding NaN/inf into a NaN output
    #: and lse row by itself; elsewhere the core adds a guard (one extra pass over q per call)
    PROPAGATES_NAN: ClassVar[frozenset] = frozenset()
    #: which facts were checked against which upstream source: (fact, source) pairs (docs)
    UPSTREAM_CHECKED: ClassVar[tuple] = ()
    # packed documents (cu_seqlens): the block plan cuts every call at document boundaries, so
    # a kernel that honours the contract on dense blocks serves them; False refuses them
    SUPPORTS_VARLEN: ClassVar[bool] = True
    #: the kernel has a packed-sequence (varlen) entry point (``kernel_forward_packed`` /
    #: ``kernel_backward_packed``): the ring then runs each step's per-document calls as one
    #: packed call per kind (causal squares, full rectangles) instead of one call per piece
    VARLEN_KERNEL: ClassVar[bool] = False

    # ---------------------------------------------------------------- declarations
    @classmethod
    def kernel_version(cls) -> Optional[str]:
        """Installed version of the kernel package (the first required package), or None."""
        for pkg in cls.REQUIRED_PACKAGES:
            return installed_version(pkg)
        return None

    @classmethod
    def rule_context(cls) -> RuleContext:
        return RuleContext(version=cls.kernel_version(), torch_version=_platform.torch_version())

    @classmethod
    def not_supported_reasons(cls, request: AttnRequest) -> list:
        """Every reason this backend refuses ``request`` (empty: supported).  Subclasses
        extend it with ``super().not_supported_reasons(request) + [...]``."""
        return declared_reasons(cls, request, cls.rule_context()) + list(cls.extra_reasons(request))

    @classmethod
    def supports(cls, request: AttnRequest) -> bool:
        return not cls.not_supported_reasons(request)

    @classmethod
    def extra_reasons(cls, request: AttnRequest) -> list:
        """Kept for out-of-tree backends written against the first API; prefer overriding
        ``not_supported_reasons`` with ``super()`` or declaring a :class:`Limit`."""
        return []

    @classmethod
    def capabilities(cls) -> dict:
        return capability_row(cls)

    # ---------------------------------------------------------------- availability
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
            devices = "/".join(sorted(cls.SUPPORTED_DEVICES))
            return Availability(False, f"needs a {devices} device, found {found}", version)
        dev = present[0]
        cc = _platform.compute_capability(dev)
        if cc is not None:
            lo = cls.MIN_COMPUTE_CAPABILITY.get(dev)
            if lo is not None and tuple(cc) < tuple(lo):
                return Availability(False, f"needs {dev} compute capability >= {lo[0]}.{lo[1]}, "
                                           f"found {cc[0]}.{cc[1]}", version)
            hi = cls.MAX_COMPUTE_CAPABILITY.get(dev)
            if hi is not None and tuple(cc) > tuple(hi):
                return Availability(False, f"built for {dev} compute capability <= {hi[0]}.{hi[1]} only, "
                                           f"found {cc[0]}.{cc[1]}", version)
        # declared limits that hold for the device itself (no feature, no head dim): e.g. the
        # architectures of the installed version
        plain = AttnRequest(dtype=sorted_dtypes(cls.SUPPORTED_DTYPES)[0] if cls.SUPPORTED_DTYPES else torch.float32,
                            device_type=dev, compute_capability=tuple(cc) if cc else None,
                            device_model=_platform.device_model(dev))
        ctx = RuleContext(version=version, torch_version=_platform.torch_version())
        for limit in cls.LIMITS:
            if not limit.uses and limit.head_dims is None:
                why = limit.fires(plain, ctx)
                if why:
                    return Availability(False, why, version)
        extra = cls.extra_availability(dev, version)
        if extra:
            return Availability(False, extra, version)
        return Availability(True, "", version, {"device": dev})

    @classmethod
    def extra_availability(cls, device_type: str, version: Optional[str]) -> str:
        """Backend-specific availability check; return a reason or ''."""
        return ""

    # ---------------------------------------------------------------- per-call admission
    _admitted_calls: Optional[BoundedCache] = None    # per instance once used

    def _admit(self, q, k, v, call: KernelCall, grad: bool) -> None:
        """Validate one call against the declarations: the first call of each signature
        (shapes, dtypes, device, ``call.key``, forward or backward) builds the request and
        asks ``not_supported_reasons``; a repeated signature is one tuple lookup.  Lengths are
        part of the signature, so the rules on Sq/Sk are cached with the rest."""
        try:
            sig = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, call.key, grad)
            seen = self._admitted_calls
            if seen is not None and sig in seen:
                return
        except (AttributeError, TypeError):
            sig = None
        self._admit_slow(q, k, v, call, grad)
        if sig is not None:
            if self._admitted_calls is None:
                self._admitted_calls = BoundedCache(1024)
            self._admitted_calls.add(sig)

    def _admit_slow(self, q, k, v, call: KernelCall, grad: bool) -> None:
        name = self.NAME
        if not isinstance(call, KernelCall):
            raise TypeError(f"{name}: the call's options must be a usp_hal KernelCall, got {type(call).__name__} "
                            "(forward(q, k, v, KernelCall(scale=..., causal=...)))")
        for label, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name}: {label} must be a [B, S, H, D] tensor, got {shape}")
        if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
            raise ValueError(f"{name}: shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)} (expected q [B, Sq, H, D], k/v [B, Sk, Hkv, D])")
        if not (q.dtype == k.dtype == v.dtype):
            raise ValueError(f"{name}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        slopes, mask = call.alibi_slopes, call.mask
        if slopes is not None and tuple(slopes.shape) not in ((q.shape[2],), (q.shape[0], q.shape[2])):
            raise ValueError(f"{name}: alibi_slopes must be (H,) or (B, H) = {(q.shape[0], q.shape[2])}, "
                             f"got {tuple(slopes.shape)}")
        if mask is not None:
            want = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
            if (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4
                    or any(m not in (1, w) for m, w in zip(mask.shape, want)) or tuple(mask.shape[2:]) != want[2:]):
                got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise ValueError(f"{name}: mask must be a bool tensor broadcastable to [B, H, Sq, Sk] = {want} "
                                 f"(Sq and Sk in full), got {got}")
        # a forward is checked as a forward (whatever the call's gradients need later), a backward
        # as a gradient call; the lse as the call says
        req = AttnRequest.of(q, k, v, call, needs_grad=grad)
        reasons = list(type(self).not_supported_reasons(req))     # includes the Sq/Sk rules (POSITIONS)
        if reasons:
            raise self._refusal(req, reasons)

    #: the registry that made this instance (:meth:`~usp_hal.dispatch.registry.Registry.instance`),
    #: asked for the message of a refusal (it adds the backends that would run the call); None
    #: for an instance made directly: the reasons and a pointer to ``usp-hal probe``
    registry: Any = None

    def _refusal(self, req: AttnRequest, reasons: list) -> Unsupported:
        registry = self.registry
        message = None if registry is None else registry.refusal_message(self.NAME, req, reasons)
        return Refusal(self.NAME, req, reasons, message)

    def _conform(self, *xs):
        """The inputs in a layout the kernel takes (``INPUT_LAYOUT``), copying only those that
        are not; the common case (nothing to copy) returns ``xs`` itself."""
        layout = type(self).INPUT_LAYOUT
        if layout == "strided":
            return xs
        if layout == "contiguous":
            if all(x.is_contiguous() for x in xs):
                return xs
            return tuple(x.contiguous() for x in xs)
        if all(x.stride(-1) == 1 for x in xs):
            return xs
        return tuple(x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous() for x in xs)

    # ---------------------------------------------------------------- kernel contract
    def forward(self, q, k, v, call: KernelCall):
        self._admit(q, k, v, call, False)
        layout = type(self).INPUT_LAYOUT
        if layout != "strided" and not (q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
                                        and (layout != "contiguous" or (q.is_contiguous() and k.is_contiguous()
                                                                        and v.is_contiguous()))):
            q, k, v = self._conform(q, k, v)
        if call.scale is None:
            call = call.with_(scale=call.scale_for(q.shape[-1]))
        out, lse = self.kernel_forward(q, k, v, call)
        if lse is None:
            lse = no_lse(q)
        return out, lse

    def binds_forward(self) -> bool:
        """Whether :meth:`bind` stands for :meth:`forward` here: the class keeps the contract's
        forward (an adapter or a test's counting subclass with a forward of its own keeps that)
        and nothing has wrapped ``forward`` on this instance since (the harness's kernel timer)."""
        return type(self).forward is AttentionBackend.forward and "forward" not in vars(self)

    def bind(self, q, k, v, call: KernelCall, want_lse: bool = True):
        """A callable ``(q, k, v) -> (out, lse)`` for repeated forward calls of ``call`` with
        these shapes, dtypes and device (what the core's per-signature fast path calls):
        validated once, here, so each call runs the kernel and little else.  Strides may
        differ between calls (each call lays them out as ``INPUT_LAYOUT`` needs).
        ``want_lse=False``: the caller drops the lse, so it may come back in any layout."""
        self._admit(q, k, v, call, False)
        return self._bound_forward(q, call.with_(scale=call.scale_for(q.shape[-1])), want_lse)

    def _bound_forward(self, q, call: KernelCall, want_lse: bool):
        """The callable :meth:`bind` returns for calls like ``q`` (adapters may specialise it by
        its device and dtype; the default lays the inputs out and calls ``kernel_forward``)."""
        kernel, conform = self.kernel_forward, self._conform
        strided = type(self).INPUT_LAYOUT == "strided"

        def run(q, k, v):
            if not strided:
                q, k, v = conform(q, k, v)
            out, lse = kernel(q, k, v, call)
            return out, (lse if lse is not None else no_lse(q))
        return run

    def backward(self, dout, q, k, v, out, lse, call: KernelCall):
        if not type(self).HAS_BACKWARD:
            raise Unsupported(f"{self.NAME} is forward-only: it has no backward")
        self._admit(q, k, v, call, True)
        want = (q.shape[0], q.shape[2], q.shape[1])
        if tuple(lse.shape) != want:
            raise ValueError(f"{self.NAME}: lse must be [B, H, Sq] = {want}, got {tuple(lse.shape)}")
        dout, q, k, v, out = self._conform(dout, q, k, v, out)
        if call.scale is None:
            call = call.with_(scale=call.scale_for(q.shape[-1]))
        return self.kernel_backward(dout, q, k, v, out, lse, call)

    def kernel_forward(self, q, k, v, call: KernelCall):
        """The kernel call alone: inputs are validated and laid out as ``INPUT_LAYOUT`` says,
        ``call.scale`` is a float.  Return ``(out, lse)`` (lse None when the kernel has none)."""
        raise NotImplementedError(f"{self.NAME}: kernel_forward not implemented")

    def kernel_backward(self, dout, q, k, v, out, lse, call: KernelCall):
        raise Unsupported(f"{self.NAME} is forward-only: it has no backward")

    # ---------------------------------------------------------------- packed (varlen) contract
    def forward_packed(self, q, k, v, call: KernelCall):
        """Sequences packed back to back: ``q`` [Tq, H, D], ``k``/``v`` [Tk, Hkv, D], sequence
        ``i`` being rows ``cu_q[i]:cu_q[i+1]`` against keys ``cu_k[i]:cu_k[i+1]`` of
        ``call.packing`` (:class:`usp_hal.parallel.ring.Packing`).  ``call.causal`` and ``call.window``
        are asked only when every sequence has as many queries as keys (the masks of the
        contract, per sequence, key offset 0; no alibi, no mask).  Returns ``out`` [Tq, H, D]
        and ``lse`` [H, Tq] (float32)."""
        self._admit(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), call, False)
        q, k, v = self._conform(q, k, v)
        return self.kernel_forward_packed(q, k, v, call.with_(scale=call.scale_for(q.shape[-1])))

    def backward_packed(self, dout, q, k, v, out, lse, call: KernelCall):
        """Gradients of :meth:`forward_packed` from the given ``out``/``lse`` [H, Tq] (which
        may be the ring-merged ones): ``(dq [Tq, H, D], dk, dv [Tk, Hkv, D])``."""
        if not type(self).HAS_BACKWARD:
            raise Unsupported(f"{self.NAME} is forward-only: it has no backward")
        self._admit(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), call, True)
        want = (q.shape[1], q.shape[0])
        if tuple(lse.shape) != want:
            raise ValueError(f"{self.NAME}: packed lse must be [H, Tq] = {want}, got {tuple(lse.shape)}")
        dout, q, k, v, out = self._conform(dout, q, k, v, out)
        return self.kernel_backward_packed(dout, q, k, v, out, lse, call.with_(scale=call.scale_for(q.shape[-1])))

    def kernel_forward_packed(self, q, k, v, call: KernelCall):
        """The varlen kernel call; the default runs one dense call per sequence (what an
        adapter falls back to when its kernel build has no varlen support)."""
        outs, lses = [], []
        one = call.with_(packing=None)
        for (a, b), (c, d) in _packed_ranges(call.packing):
            o, lse = self.forward(q[None, a:b], k[None, c:d], v[None, c:d], one)
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    def kernel_backward_packed(self, dout, q, k, v, out, lse, call: KernelCall):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        one = call.with_(packing=None)
        for (a, b), (c, d) in _packed_ranges(call.packing):
            gq, gk, gv = self.backward(dout[None, a:b], q[None, a:b], k[None, c:d], v[None, c:d], out[None, a:b],
                                       lse[None, :, a:b], one)
            dq[a:b], dk[c:d], dv[c:d] = gq[0], gk[0], gv[0]
        return dq, dk, dv

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.NAME!r}>"


def _packed_ranges(packing):
    """((q_start, q_stop), (k_start, k_stop)) of every packed sequence, from its host lengths."""
    qa = ka = 0
    for nq, nk in zip(packing.q_lens, packing.k_lens):
        yield (qa, qa + nq), (ka, ka + nk)
        qa += nq
        ka += nk


class Refusal(Unsupported):
    """A backend's refusal of one call: its name, the request and the reasons (what
    ``not_supported_reasons`` returned).  ``message``: the registry's (it adds the backends
    that would run the call instead); without one, the reasons and a pointer to ``usp-hal probe``."""

    def __init__(self, backend: str, request: AttnRequest, reasons, message: Optional[str] = None):
        self.backend, self.request, self.reasons = backend, request, list(reasons)
        super().__init__(message if message is not None else _plain_refusal(backend, request, self.reasons))


def refusal_text(backend: str, request: AttnRequest, reasons) -> str:
    """``attn_type='x' cannot run this call (<request>):`` and one line per reason."""
    return (f"attn_type={backend!r} cannot run this call ({request.describe()}):\n  - " + "\n  - ".join(reasons))


def _plain_refusal(backend: str, request: AttnRequest, reasons) -> str:
    return refusal_text(backend, request, reasons) + "; run `usp-hal probe` to see what each backend supports"


def no_lse(q: torch.Tensor) -> torch.Tensor:
    """The lse a kernel without one returns: NaN, ``[B, H, Sq]`` (see the module docstring)."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), dtype=dt, device=q.device)


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


def pad_to(x: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad the last dim to exactly ``size`` (a no-op when it already is)."""
    d = x.shape[-1]
    return x if d == size else torch.nn.functional.pad(x, (0, size - d))


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """Rows that saw no key (lse = -inf) must give zero gradient: exp(s - (+inf)) = 0."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def position_mask(sq: int, sk: int, *, causal: bool, window, key_offset: int, alibi_slopes,
                  batch: int, heads: int, dtype: torch.dtype, device,
                  keep: Optional[torch.Tensor] = None) -> "tuple[torch.Tensor, torch.Tensor]":
    """Additive float mask for the contract's causal/window/alibi semantics, and'ed with a
    boolean ``keep`` mask (the contract's ``mask=``, broadcastable to ``[B, H, Sq, Sk]``).

    Returns ``(mask, empty_rows)``: mask broadcastable to ``[B, H, Sq, Sk]`` and a bool
    ``empty_rows`` broadcastable to ``[B, H, Sq]`` for query rows that see no key.
    """
    m = torch.arange(sq, device=device).unsqueeze(1)
    n = torch.arange(sk, device=device).unsqueeze(0) + key_offset
    dist = n - m                      # key position minus query position
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        allowed &= dist <= 0
    left, right = window
    if left >= 0:
        allowed &= dist >= -left
    if right >= 0:
        allowed &= dist <= right
    allowed = allowed.view(1, 1, sq, sk)
    if keep is not None:
        allowed = allowed & keep.to(device)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    mask = torch.zeros(allowed.shape, dtype=work, device=device)
    mask.masked_fill_(~allowed, float("-inf"))
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=device, dtype=work)
        slopes = slopes.view(1, heads, 1, 1) if slopes.dim() == 1 else slopes.view(batch, heads, 1, 1)
        mask = mask - slopes * dist.abs().to(work)
    empty = (~allowed).all(dim=-1)
    return mask.to(dtype), empty
