"""Backend registry: lazy entries by name, AttnType, plugins, and `auto` selection.

Entries map a name to an import path (``"module:Class"``); the module is imported only
when the backend is used or listed.  Out-of-tree backends register through the
``usp_hal.backends`` entry-point group (the entry point loads to an AttentionBackend
subclass; its ``NAME`` is the registered name).

Backends only say why they refuse a call (``not_supported_reasons``, and a
:class:`~usp_hal.dispatch.backend.Refusal` carrying those reasons); the registry, which knows every
backend, formats the refusal with the alternatives (:meth:`Registry.refusal`, as xformers'
dispatch formats its ``not_supported_reasons``), for :meth:`Registry.select` and for the own
per-call refusal of a backend it made (:meth:`Registry.instance`: the instance asks its
registry for the message).
"""
from __future__ import annotations

import enum
import importlib
import importlib.metadata
import logging

from . import platform as _platform
from .backend import AttentionBackend, Refusal, refusal_text
from .capabilities import AttnRequest

log = logging.getLogger("usp_hal")

ENTRY_POINT_GROUP = "usp_hal.backends"


class AttnType(str, enum.Enum):
    """Attention kernel choice. yunchang's member names are accepted as aliases."""

    AUTO = "auto"
    SDPA = "sdpa"
    FA2 = "fa2"
    FA3 = "fa3"
    SAGE_FP8 = "sage_fp8"
    FLASHINFER = "flashinfer"
    NPU = "npu"
    XPU = "xpu"

    # yunchang 0.6.4's members (yunchang/kernels/__init__.py AttnType) that have no usp-hal
    # backend: choosing one raises (see NO_BACKEND) unless a backend of that name is registered
    AITER = "aiter"
    SAGE_FP16 = "sage_fp16"
    SAGE_FP16_TRITON = "sage_fp16_triton"
    SPARSE_SAGE = "sparse_sage"

    # yunchang-compatible aliases (enum aliases: same value, other name)
    FA = "fa2"
    TORCH = "sdpa"
    TORCH_MATH = "sdpa"
    TORCH_EFFICIENT = "sdpa"
    TORCH_FLASH = "sdpa"
    TORCH_CUDNN = "sdpa"
    SAGE_AUTO = "sage_fp8"
    SAGE_FP8_SM90 = "sage_fp8"

    def __str__(self) -> str:  # pragma: no cover - cosmetic
        return self.value


#: yunchang 0.6.4 kernel choices usp-hal has no backend for, and what to use instead
#: (the yunchang kernels are those of yunchang/kernels/__init__.py ``select_flash_attn_impl``)
NO_BACKEND = {
    "aiter": "yunchang's AttnType.AITER runs AMD aiter's flash_attn_func (forward only); usp-hal has no aiter "
             "backend: use attn_type='auto' or 'sdpa', or register one with usp_hal.register_backend('aiter', cls)",
    "sage_fp16": "yunchang's AttnType.SAGE_FP16 runs SageAttention's int8-QK fp16-PV CUDA kernel "
                 "(sageattn_qk_int8_pv_fp16_cuda); usp-hal's sage backend runs SageAttention's sageattn (yunchang's "
                 "SAGE_AUTO): use attn_type='sage_fp8', or 'auto'/'sdpa' for an exact kernel",
    "sage_fp16_triton": "yunchang's AttnType.SAGE_FP16_TRITON runs SageAttention's int8-QK fp16-PV Triton kernel "
                        "(sageattn_qk_int8_pv_fp16_triton); usp-hal's sage backend runs SageAttention's sageattn "
                        "(yunchang's SAGE_AUTO): use attn_type='sage_fp8', or 'auto'/'sdpa' for an exact kernel",
    "sparse_sage": "yunchang's AttnType.SPARSE_SAGE is its SparseAttentionMeansim module passed as attn_processor: "
                   "pass that module as attn_processor= (usp-hal runs any attn_processor as the kernel, "
                   "forward only, ring degree 1), or use attn_type='auto'/'sdpa'",
}

_BUILTIN = {
    "sdpa": "usp_hal.backends.sdpa:SDPABackend",
    "fa2": "usp_hal.backends.fa2:FlashAttn2Backend",
    "fa3": "usp_hal.backends.fa3:FlashAttn3Backend",
    "sage_fp8": "usp_hal.backends.sage:SageFP8Backend",
    "flashinfer": "usp_hal.backends.flashinfer:FlashInferBackend",
    "npu": "usp_hal.backends.npu:NPUBackend",
    "xpu": "usp_hal.backends.xpu:XPUBackend",
    "flex": "usp_hal.backends.flex:FlexAttentionBackend",
    "fa4": "usp_hal.backends.fa4:FlashAttn4Backend",
    "portable": "usp_hal.backends.portable:PortableBackend",
}

# `auto` tries these in order (each platform entry declares its list); lossy (quantised)
# kernels are never picked automatically.
AUTO_PRIORITY = {name: list(p.auto_priority) for name, p in _platform.PLATFORMS.items()}
#: what `auto` falls back to, on every device, when no backend of the device's list serves a
#: call (plain torch: every option, bounded memory, slow); each reason it does so is logged once
FALLBACK = "portable"
_FELL_BACK: set = set()


class Registry:
    def __init__(self) -> None:
        self._entries: dict = dict(_BUILTIN)
        self._loaded: dict = {}
        self._plugins_loaded = False

    # ------------------------------------------------------------ registration
    def register(self, name: str, backend, *, override: bool = False) -> None:
        """Register a backend class (or a "module:Class" import path) under ``name``."""
        name = str(name).lower()
        if name in ("auto",):
            raise ValueError("'auto' is reserved")
        if name in self._entries and not override:
            raise ValueError(f"backend {name!r} is already registered (pass override=True to replace it)")
        self._entries[name] = backend
        self._loaded.pop(name, None)

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)
        self._loaded.pop(name, None)

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        try:
            eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        except Exception as exc:  # pragma: no cover - broken metadata
            log.warning("could not read entry points %s: %s", ENTRY_POINT_GROUP, exc)
            return
        for ep in eps:
            name = ep.name.lower()
            if name in self._entries:
                log.warning("plugin backend %r ignored: the name is taken", name)
                continue
            self._entries[name] = ep

    def names(self) -> list:
        self._load_plugins()
        return list(self._entries)

    # ------------------------------------------------------------ lookup
    def canonical_name(self, attn_type) -> str:
        """Map an AttnType / yunchang enum / string to a registered name (or 'auto'); a backend
        class itself (an AttentionBackend subclass, registered or not) gives its ``NAME``."""
        self._load_plugins()
        if isinstance(attn_type, type) and issubclass(attn_type, AttentionBackend):
            return attn_type.NAME
        if isinstance(attn_type, AttnType):
            name = attn_type.value
        elif isinstance(attn_type, enum.Enum):  # e.g. yunchang.kernels.AttnType members
            return self.canonical_name(attn_type.name)
        else:
            text = str(attn_type)
            low = text.lower()
            if low == "auto" or low in self._entries:
                return low
            upper = text.upper()
            if upper not in AttnType.__members__:
                name = ""
            else:
                name = AttnType.__members__[upper].value
        if name == "auto" or name in self._entries:
            return name
        if name in NO_BACKEND:
            raise ValueError(f"attn_type {attn_type!r}: {NO_BACKEND[name]}")
        if name:
            return name
        valid = ["auto"] + self.names() + sorted(k for k in AttnType.__members__ if AttnType[k].value != k.lower())
        raise ValueError(f"unknown attn_type {attn_type!r}; valid options are: {', '.join(valid)}")

    def get(self, attn_type) -> "type[AttentionBackend]":
        if isinstance(attn_type, type) and issubclass(attn_type, AttentionBackend):
            return attn_type          # a class given itself (e.g. a module's attn_processor kernel)
        name = self.canonical_name(attn_type)
        if name == "auto":
            raise ValueError("'auto' is not a backend; use select(request)")
        if name in self._loaded:
            return self._loaded[name]
        entry = self._entries[name]
        if isinstance(entry, str):
            mod, _, attr = entry.partition(":")
            cls = getattr(importlib.import_module(mod), attr)
        elif isinstance(entry, importlib.metadata.EntryPoint):
            try:
                cls = entry.load()
            except Exception as exc:
                raise RuntimeError(f"plugin backend {name!r} ({entry.value}) failed to load: {exc}") from exc
        else:
            cls = entry
        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            raise TypeError(f"backend {name!r} must be an AttentionBackend subclass, got {cls!r}")
        self._loaded[name] = cls
        return cls

    def backends(self) -> list:
        return [self.get(n) for n in self.names()]

    # ------------------------------------------------------------ selection
    def priority(self, device_type: str) -> list:
        base = list(AUTO_PRIORITY.get(device_type, []))
        # plugins (and registered extras) that declare this device come after the built-ins
        for name in self.names():
            if name not in _BUILTIN and name not in base:
                try:
                    cls = self.get(name)
                except Exception:
                    continue
                if device_type in cls.SUPPORTED_DEVICES:
                    base.append(name)
        return base

    def candidates(self, device_type: str) -> list:
        """What ``auto`` tries, in order: the device's list (:meth:`priority`), then the fallback."""
        base = self.priority(device_type)
        if FALLBACK in self._entries and FALLBACK not in base:
            try:
                if device_type in self.get(FALLBACK).SUPPORTED_DEVICES:
                    base.append(FALLBACK)
            except Exception:     # replaced by an entry that cannot load here: auto keeps the device's list
                pass
        return base

    @staticmethod
    def _complete(request: AttnRequest) -> AttnRequest:
        """Fill in the device model when the caller did not (rules on device models need it)."""
        if request.device_model is None and request.device_type in _platform.PLATFORMS:
            model = _platform.device_model(request.device_type)
            if model is not None:
                return request.with_(device_model=model)
        return request

    def reasons(self, name: str, request: AttnRequest) -> list:
        """Availability problem (if any) then every capability reason."""
        return self._reasons_of(self.get(name), self._complete(request))

    @staticmethod
    def _reasons_of(cls, request: AttnRequest) -> list:
        out = []
        avail = cls.availability()
        if not avail.ok:
            out.append(f"unavailable: {avail.reason}")
        out.extend(cls.not_supported_reasons(request))
        return out

    def select(self, attn_type, request: AttnRequest) -> "type[AttentionBackend]":
        """Validate an explicit choice, or pick the first fitting backend for 'auto'."""
        name = self.canonical_name(attn_type)
        request = self._complete(request)
        if isinstance(attn_type, type):
            why = self._reasons_of(attn_type, request)
            if why:
                raise self.refusal(name, request, why)
            return attn_type
        if name != "auto":
            why = self.reasons(name, request)
            if why:
                raise self.refusal(name, request, why)
            return self.get(name)
        report: dict = {}
        for cand in self.candidates(request.device_type):
            why = self.reasons(cand, request)
            if not why:
                if cand == FALLBACK and report:
                    _say_fallback(request, report)
                log.info("usp_hal: attn_type='auto' chose %r for %s", cand, request.describe())
                return self.get(cand)
            report[cand] = why
        # every other registered backend of the device: its reasons too (auto does not try it)
        for cand in self.names():
            if cand in report:
                continue
            try:
                cls = self.get(cand)
            except Exception as exc:      # a registered adapter that cannot load here
                report[f"{cand} (not tried by auto)"] = [f"cannot load: {exc}"]
                continue
            if request.device_type in cls.SUPPORTED_DEVICES:
                why = self.reasons(cand, request)
                report[f"{cand} (not tried by auto)"] = why or [f"it would run the call: pass attn_type={cand!r}"]
        raise NotImplementedError(_format_not_supported_reasons(request, report))

    # ------------------------------------------------------------ refusals
    def alternatives(self, request: AttnRequest, exclude=(), *, available: bool = True) -> list:
        """The backends (in ``auto`` order for the request's device, ``exclude`` left out) that
        would run ``request``: available here and declaring support (``available=False``: by
        their declarations alone, installed or not)."""
        request = self._complete(request)
        skip = {exclude} if isinstance(exclude, str) else set(exclude)
        names = []
        for cand in self.candidates(request.device_type):
            if cand in skip:
                continue
            try:
                why = self.reasons(cand, request) if available else self.get(cand).not_supported_reasons(request)
            except Exception:   # a registered adapter module that is not present in this install
                continue
            if not why:
                names.append(cand)
        return names

    def refusal_message(self, name: str, request: AttnRequest, reasons) -> str:
        """Why backend ``name`` refuses ``request`` (its reasons), and what would run it instead."""
        text = refusal_text(name, request, reasons)
        alts = self.alternatives(request, name)
        if alts:
            return text + f"; backends that would work: {', '.join(alts)}"
        declared = self.alternatives(request, name, available=False)
        if declared:
            return text + (f"; backends whose declarations cover it (none is available here): {', '.join(declared)}; "
                           "run `usp-hal probe` to see why")
        return text + "; no registered backend supports it (run `usp-hal probe` to see what each backend supports)"

    def instance(self, attn_type, request: AttnRequest) -> AttentionBackend:
        """A new instance of the backend :meth:`select` picks, which asks this registry for the
        message of its own per-call refusals (naming the alternatives)."""
        backend = self.select(attn_type, request)()
        backend.registry = self
        return backend

    def refusal(self, name: str, request: AttnRequest, reasons) -> Refusal:
        """The error for backend ``name`` refusing ``request`` for ``reasons`` (a NotImplementedError)."""
        return Refusal(name, request, reasons, self.refusal_message(name, self._complete(request), reasons))


def _say_fallback(request: AttnRequest, report: dict) -> None:
    """Log (once per distinct set of reasons) that ``auto`` fell back, and why."""
    key = (request.device_type, tuple((c, tuple(w)) for c, w in report.items()))
    if key in _FELL_BACK:
        return
    _FELL_BACK.add(key)
    why = "; ".join(f"{c}: {', '.join(w)}" for c, w in report.items())
    log.warning("usp_hal: attn_type='auto' runs %s with the slow %r backend, since no faster backend serves it (%s)",
                request.describe(), FALLBACK, why)


def _format_not_supported_reasons(request: AttnRequest, report: dict) -> str:
    """``auto`` found nothing: every candidate and its reasons."""
    lines = [f"`{cand}` is not supported because:\n    - " + "\n    - ".join(why) for cand, why in report.items()]
    return (f"No attention backend found for inputs: {request.describe()}\n"
            + ("\n".join(lines) if lines else f"  no backend is registered for device {request.device_type!r}"))


REGISTRY = Registry()


class Dispatch:
    """One owner's backend instances by request (an attention module's pipeline, a KV cache's
    decode): the registry's choice (:meth:`Registry.select`, which raises the refusal with
    its alternatives) once per distinct request, then a dictionary lookup per call.  Each
    owner keeps its own instances (their per-call admission caches, and anything a harness
    wraps on them, stay its own)."""

    def __init__(self, attn_type, registry: "Registry | None" = None) -> None:
        self.attn_type = attn_type
        self.registry = registry if registry is not None else REGISTRY
        self.instances: dict = {}

    def __call__(self, request: AttnRequest) -> AttentionBackend:
        got = self.instances.get(request)
        if got is None:
            got = self.instances[request] = self.registry.instance(self.attn_type, request)
        return got


def register_backend(name: str, backend, *, override: bool = False) -> None:
    REGISTRY.register(name, backend, override=override)


def get_backend(attn_type) -> "type[AttentionBackend]":
    return REGISTRY.get(attn_type)


def select_backend(attn_type, request: AttnRequest) -> "type[AttentionBackend]":
    return REGISTRY.select(attn_type, request)


def list_backends() -> list:
    return REGISTRY.names()
