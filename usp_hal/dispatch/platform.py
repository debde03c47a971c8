"""Device facts in one place: one :class:`Platform` entry per device type.

A platform entry holds everything the rest of the package needs to know about a kind of
device: the torch device name, the torch.distributed backend, the build flag and the
``torch.<module>`` that provide it, the ``attn_type="auto"`` priority, the CI profiles,
and a small integer code for cross-rank metadata.  Every other module reads device facts
from here (capabilities, registry, the CLI); adding a device is adding one entry to
:data:`PLATFORMS`.

This is the only module of the core that touches a device API.  Synchronisation, device
selection and memory statistics go through ``torch.accelerator`` when this torch has it and
it drives the device in question, else through the device's own ``torch.<module>``.
Detection is cheap: nothing here creates a device context until a caller asks for
something that needs one (compute capability, memory statistics, device model).

:func:`emulate` is the test seam: inside it, a CPU tensor reports the emulated device type,
compute capability, device model and torch version, so an adapter and the whole USP core can
run on the CPU against a stand-in kernel without any special case in the core.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class CIProfile:
    """A CI device: what a self-hosted runner labelled ``name`` provides."""

    name: str
    device_type: str
    compute_capability: Optional[tuple] = None
    hardware: str = ""


@dataclass(frozen=True)
class Platform:
    """Everything usp-hal knows about one device type (see the module docstring)."""

    name: str                         # usp-hal device type
    torch_device: str                 # torch device string
    dist_backend: str                 # torch.distributed backend
    code: int                         # stable small integer for cross-rank metadata
    module: Optional[str] = None      # torch.<module> with the device API
    build: Optional[str] = None       # torch.version.<build> that must be set for this device
    excludes_build: Optional[str] = None   # ... and one that must not be (ROCm builds also run "cuda")
    auto_priority: tuple = ()         # attn_type="auto" tries these backends in order
    ci_profiles: tuple = ()
    has_compute_capability: bool = False
    legacy_dist_backends: tuple = ()  # (backend, module that registers it) used when the native one is absent
    dist_backend_from_plugin: bool = False  # the backend is registered by the device plugin on import
    device_model: Optional[Callable] = field(default=None, compare=False)  # (torch module, index) -> str

    # ------------------------------------------------------------------ detection
    def torch_module(self):
        return getattr(torch, self.module, None) if self.module else None

    def present(self) -> bool:
        """Whether this machine has a device of this type (a built and working torch module)."""
        if self.module is None:
            return True
        if self.build is not None and not getattr(torch.version, self.build, None):
            return False
        if self.excludes_build is not None and getattr(torch.version, self.excludes_build, None):
            return False
        mod = self.torch_module()
        try:
            return bool(mod is not None and mod.is_available())
        except Exception:   # a half-installed device plugin
            return False

    # ------------------------------------------------------------------ hooks
    def _accelerator(self, name: str):
        """``torch.accelerator.<name>`` when it exists and drives this device, else None."""
        acc = getattr(torch, "accelerator", None)
        fn = getattr(acc, name, None) if acc is not None else None
        if fn is None:
            return None
        try:
            current = acc.current_accelerator()  # type: ignore[union-attr]
        except Exception:
            return None
        return fn if current is not None and current.type == self.torch_device else None

    def _call(self, accelerator_name: str, module_name: str, *args):
        if self.module is None:
            return None
        fn = self._accelerator(accelerator_name) or getattr(self.torch_module(), module_name)
        return fn(*args)

    def device_count(self) -> int:
        if self.module is None:
            return 1
        return int(self._call("device_count", "device_count")) if self.present() else 0

    def set_device(self, index: int) -> None:
        self._call("set_device_index", "set_device", index)

    def synchronize(self) -> None:
        self._call("synchronize", "synchronize")

    def reset_peak_memory(self) -> None:
        self._call("reset_peak_memory_stats", "reset_peak_memory_stats")

    def peak_memory_bytes(self) -> Optional[int]:
        out = self._call("max_memory_allocated", "max_memory_allocated")
        return None if out is None else int(out)

    def device_name(self, index: int = 0) -> str:
        if self.module is not None and self.present():
            return str(self.torch_module().get_device_name(index))
        import platform as _pyplatform
        return _pyplatform.processor() or _pyplatform.machine()

    def compute_capability(self, index: int = 0) -> Optional[tuple]:
        if self.has_compute_capability and self.present():
            return tuple(self.torch_module().get_device_capability(index))
        return None

    def model(self, index: int = 0) -> Optional[str]:
        if self.device_model is None or not self.present():
            return None
        try:
            return self.device_model(self.torch_module(), index)
        except Exception:
            return None


# ---------------------------------------------------------------------------- device models
def _cuda_model(mod, index: int) -> str:
    major, minor = mod.get_device_capability(index)
    return f"sm{major}{minor}"


# SYCL's experimental ``architecture`` ids of the Intel GPUs (GMDID in bits 8..39: arch, release,
# revision).  Source: intel/llvm sycl/include/sycl/ext/oneapi/experimental/device_architecture.def.
# Matching ignores the 6-bit revision so that steppings of one model map to one name.
XPU_ARCHITECTURES = {
    0x000000030F000700: "intel_gpu_pvc",
    0x000000030F400700: "intel_gpu_pvc_vg",
    0x0000000500400400: "intel_gpu_bmg_g21",
    0x0000000500800000: "intel_gpu_bmg_g31",
    0x000000030DC00800: "intel_gpu_acm_g10",
    0x000000030E000500: "intel_gpu_acm_g11",
    0x000000030E400000: "intel_gpu_acm_g12",
    0x0000000501000400: "intel_gpu_lnl_m",
}
_XPU_REVISION_MASK = ~(0x3F << 8)


def xpu_model_from_architecture(arch: int) -> Optional[str]:
    """The SYCL architecture name of an ``_XpuDeviceProperties.architecture`` id, or None."""
    key = int(arch) & _XPU_REVISION_MASK
    for code, name in XPU_ARCHITECTURES.items():
        if code & _XPU_REVISION_MASK == key:
            return name
    return None


def _xpu_model(mod, index: int) -> Optional[str]:
    return xpu_model_from_architecture(getattr(mod.get_device_properties(index), "architecture", -1))


def _npu_model(mod, index: int) -> str:
    return str(mod.get_device_name(index))


# ---------------------------------------------------------------------------- the entries
PLATFORMS = {p.name: p for p in (
    Platform("cpu", "cpu", "gloo", code=1, auto_priority=("sdpa",),
             ci_profiles=(CIProfile("cpu", "cpu", None, "any x86-64 or aarch64 CPU (gloo)"),)),
    Platform("cuda", "cuda", "nccl", code=2, module="cuda", build="cuda", excludes_build="hip",
             auto_priority=("fa3", "fa2", "sdpa", "flashinfer"), has_compute_capability=True,
             device_model=_cuda_model,
             ci_profiles=(CIProfile("cuda-sm80", "cuda", (8, 0), "NVIDIA Ampere, e.g. A100"),
                          CIProfile("cuda-sm90", "cuda", (9, 0), "NVIDIA Hopper, e.g. H100/H200"))),
    Platform("rocm", "cuda", "nccl", code=3, module="cuda", build="hip", auto_priority=("fa2", "sdpa"),
             ci_profiles=(CIProfile("rocm", "rocm", None, "AMD Instinct, e.g. MI250/MI300"),)),
    Platform("npu", "npu", "hccl", code=4, module="npu", auto_priority=("npu",), device_model=_npu_model,
             dist_backend_from_plugin=True,
             ci_profiles=(CIProfile("npu", "npu", None, "Ascend Atlas A2 (910B)"),)),
    Platform("xpu", "xpu", "xccl", code=5, module="xpu", build="xpu", auto_priority=("xpu",),
             legacy_dist_backends=(("ccl", "oneccl_bindings_for_pytorch"),), device_model=_xpu_model,
             ci_profiles=(CIProfile("xpu", "xpu", None, "Intel GPU, e.g. Data Center GPU Max / Arc B-series"),)),
)}

DEVICE_TYPES = tuple(PLATFORMS)
DIST_BACKEND = {name: p.dist_backend for name, p in PLATFORMS.items()}


def get_platform(device_type: str) -> Platform:
    try:
        return PLATFORMS[device_type]
    except KeyError:
        raise ValueError(f"unknown device type {device_type!r}; valid: {', '.join(DEVICE_TYPES)}") from None


# ---------------------------------------------------------------------------- emulation (tests)
@dataclass(frozen=True)
class Emulation:
    device_type: str
    compute_capability: Optional[tuple] = None
    device_model: Optional[str] = None
    torch_version: Optional[str] = None


_EMULATION: list = []


@contextlib.contextmanager
def emulate(device_type: str, *, compute_capability: Optional[tuple] = None, device_model: Optional[str] = None,
            torch_version: Optional[str] = None):
    """Make this process report CPU tensors as ``device_type`` (with this compute capability,
    device model and torch version) while the context is active.

    This is how adapters are tested on the CPU, through the whole USP core, against stand-in
    kernels: the core asks the platform for the device type of its inputs and gets the
    emulated one, the registry checks availability against the emulated device, and rules
    that depend on the compute capability, the device model or the torch version see the
    emulated values.  Nothing else changes (CPU tensors stay CPU tensors)."""
    get_platform(device_type)
    if device_type == "cpu":
        raise ValueError("emulate() is for accelerator device types; cpu needs no emulation")
    if compute_capability is None and PLATFORMS[device_type].has_compute_capability:
        compute_capability = (9, 0)
    if device_model is None and compute_capability is not None:
        device_model = f"sm{compute_capability[0]}{compute_capability[1]}"
    _EMULATION.append(Emulation(device_type, tuple(compute_capability) if compute_capability else None,
                                device_model, torch_version))
    try:
        yield _EMULATION[-1]
    finally:
        _EMULATION.pop()


def emulated() -> Optional[Emulation]:
    """The active emulation, or None."""
    return _EMULATION[-1] if _EMULATION else None


# ---------------------------------------------------------------------------- module-level facts
@functools.lru_cache(maxsize=None)
def _torch_name_to_types() -> dict:
    out: dict = {}
    for p in PLATFORMS.values():
        out.setdefault(p.torch_device, []).append(p)
    return out


def torch_device_name(device_type: str) -> str:
    """The torch device string for a usp-hal device type (rocm runs as 'cuda')."""
    return get_platform(device_type).torch_device


_DEVICE_TYPES: dict = {}     # torch.device -> device type, outside emulation (asked on every call)


def device_type_of(device: "torch.device | str") -> str:
    """usp-hal device type of a tensor's device (tells ROCm from CUDA)."""
    if not _EMULATION:
        got = _DEVICE_TYPES.get(device)
        if got is not None:
            return got
    t = device.type if isinstance(device, torch.device) else torch.device(device).type
    if _EMULATION and t == "cpu":
        return _EMULATION[-1].device_type
    name = _device_type(t)
    if isinstance(device, torch.device) and len(_DEVICE_TYPES) < 64:
        _DEVICE_TYPES[device] = name
    return name


def _device_type(t: str) -> str:
    candidates = _torch_name_to_types().get(t)
    if not candidates:
        return t
    if len(candidates) == 1:
        return candidates[0].name
    for p in candidates:
        if (p.build is None or getattr(torch.version, p.build, None)) and not (
                p.excludes_build and getattr(torch.version, p.excludes_build, None)):
            return p.name
    return candidates[0].name


@functools.lru_cache(maxsize=None)
def _present_types() -> tuple:
    found = [p.name for p in PLATFORMS.values() if p.module is not None and p.present()]
    return tuple(found) + ("cpu",)


def available_device_types() -> tuple:
    """Device types present on this machine, accelerator first, 'cpu' always last."""
    if _EMULATION:
        return (_EMULATION[-1].device_type, "cpu")
    return _present_types()


def default_device_type() -> str:
    env = os.environ.get("USP_HAL_DEVICE")
    if env:
        if env not in PLATFORMS:
            raise ValueError(f"USP_HAL_DEVICE={env!r}; valid: {', '.join(DEVICE_TYPES)}")
        return env
    return available_device_types()[0]


def device_count(device_type: str) -> int:
    if _EMULATION and device_type == _EMULATION[-1].device_type:
        return 1
    return get_platform(device_type).device_count()


@functools.lru_cache(maxsize=None)
def _compute_capability(device_type: str, index: int) -> Optional[tuple]:
    return get_platform(device_type).compute_capability(index)


def compute_capability(device_type: str, index: int = 0) -> Optional[tuple]:
    """(major, minor) for CUDA devices; None elsewhere (initialises CUDA when asked)."""
    if _EMULATION and device_type == _EMULATION[-1].device_type:
        return _EMULATION[-1].compute_capability
    if device_type not in PLATFORMS:
        return None
    return _compute_capability(device_type, index)


@functools.lru_cache(maxsize=None)
def _device_model(device_type: str, index: int) -> Optional[str]:
    return get_platform(device_type).model(index)


def device_model(device_type: str, index: int = 0) -> Optional[str]:
    """The device model a kernel's support depends on: ``smXY`` on CUDA, the SYCL
    architecture name on XPU (e.g. ``intel_gpu_pvc``), the device name on NPU; None when
    unknown (rules that need it then do not refuse)."""
    if _EMULATION and device_type == _EMULATION[-1].device_type:
        return _EMULATION[-1].device_model
    if device_type not in PLATFORMS:
        return None
    return _device_model(device_type, index)


def torch_version() -> str:
    """The torch version rules are evaluated against (emulatable)."""
    if _EMULATION and _EMULATION[-1].torch_version:
        return _EMULATION[-1].torch_version
    return torch.__version__


def device_name(device_type: str, index: int = 0) -> str:
    if _EMULATION and device_type == _EMULATION[-1].device_type:
        return f"emulated {device_type} ({_EMULATION[-1].device_model or 'cpu'})"
    return get_platform(device_type).device_name(index)


def dist_backend_for(device_type: str) -> str:
    return get_platform(device_type).dist_backend


def device_code(device_type: str) -> int:
    """A stable small integer per device type (0 for an unknown one), for cross-rank metadata."""
    p = PLATFORMS.get(device_type)
    return p.code if p is not None else 0


def dist_backend_available(name: str) -> bool:
    """Whether torch.distributed can create a process group of this backend here."""
    import torch.distributed as dist
    if not dist.is_available():
        return False
    for p in PLATFORMS.values():
        for legacy, module in p.legacy_dist_backends:
            if name == legacy:
                return importlib.util.find_spec(module) is not None
        if name == p.dist_backend and p.dist_backend_from_plugin:
            # registered by the device plugin on import; never trust dist.Backend(name) alone
            return p.torch_module() is not None and name in getattr(dist.Backend, "backend_list", [])
    try:
        return bool(dist.is_backend_available(name))
    except Exception:  # older torch without is_backend_available for this name
        return False


def dist_backend_string(device_type: str) -> str:
    """Backend string for init_process_group: the device's backend, plus cpu:gloo when both exist."""
    p = get_platform(device_type)
    if p.module is None:
        if not dist_backend_available(p.dist_backend):
            raise RuntimeError(f"torch.distributed has no {p.dist_backend} backend in this build; "
                               f"{device_type} runs need {p.dist_backend}")
        return p.dist_backend
    acc = p.dist_backend
    if not dist_backend_available(acc):
        for legacy, _module in p.legacy_dist_backends:
            if dist_backend_available(legacy):
                acc = legacy
                break
    if not dist_backend_available(acc):
        raise RuntimeError(f"the {acc} backend for {device_type} is not available in this torch build; "
                           f"install the {device_type} build of torch (or run on cpu with gloo)")
    if dist_backend_available("gloo"):
        return f"cpu:gloo,{p.torch_device}:{acc}"
    return acc


def set_device(device_type: str, local_rank: int) -> "torch.device":
    """Bind this process to its accelerator (no-op on CPU) and return the torch.device."""
    p = get_platform(device_type)
    if p.module is None or (_EMULATION and device_type == _EMULATION[-1].device_type):
        return torch.device("cpu")
    p.set_device(local_rank)
    return torch.device(p.torch_device, local_rank)


def _hook_platform(device_type: str) -> Optional[Platform]:
    if _EMULATION and device_type == _EMULATION[-1].device_type:
        return None
    p = get_platform(device_type)
    return p if p.module is not None else None


def synchronize(device_type: str) -> None:
    p = _hook_platform(device_type)
    if p is not None:
        p.synchronize()


def reset_peak_memory(device_type: str) -> None:
    p = _hook_platform(device_type)
    if p is not None:
        p.reset_peak_memory()


def peak_memory_bytes(device_type: str) -> Optional[int]:
    """Peak allocated device memory since the last reset; None on CPU (use a tracker there)."""
    p = _hook_platform(device_type)
    return None if p is None else p.peak_memory_bytes()


@dataclass(frozen=True)
class PlatformInfo:
    torch_version: str
    device_type: str
    device_types: tuple
    device_count: int
    device_name: str
    compute_capability: Optional[tuple]
    cuda_version: Optional[str]
    hip_version: Optional[str]
    xpu_version: Optional[str]
    dist_backends: dict
    device_model: Optional[str] = None


def info() -> PlatformInfo:
    dt = default_device_type()
    names = sorted({p.dist_backend for p in PLATFORMS.values()}
                   | {b for p in PLATFORMS.values() for b, _ in p.legacy_dist_backends}
                   | {"mpi", "ucc"}, key=lambda n: (n != "gloo", n))
    return PlatformInfo(
        torch_version=torch.__version__,
        device_type=dt,
        device_types=available_device_types(),
        device_count=device_count(dt),
        device_name=device_name(dt),
        compute_capability=compute_capability(dt),
        cuda_version=torch.version.cuda,
        hip_version=torch.version.hip,
        xpu_version=getattr(torch.version, "xpu", None),
        dist_backends={n: dist_backend_available(n) for n in names},
        device_model=device_model(dt),
    )
