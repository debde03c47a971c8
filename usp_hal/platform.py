"""Device facts in one place.

This is the only module of the core that names ``torch.cuda``, ``torch.xpu`` or
``torch.npu``.  Detection is cheap: nothing here creates a device context until a caller
asks for something that needs one (compute capability, memory statistics).
"""
from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

import torch

DEVICE_TYPES = ("cpu", "cuda", "rocm", "npu", "xpu")

# device type -> the torch.distributed backend that drives it
DIST_BACKEND = {"cpu": "gloo", "cuda": "nccl", "rocm": "nccl", "npu": "hccl", "xpu": "xccl"}


def torch_device_name(device_type: str) -> str:
    """The torch device string for a usp-hal device type (rocm runs as 'cuda')."""
    return "cuda" if device_type == "rocm" else device_type


def device_type_of(device: "torch.device | str") -> str:
    """usp-hal device type of a tensor's device (tells ROCm from CUDA)."""
    t = torch.device(device).type
    if t == "cuda" and torch.version.hip:
        return "rocm"
    return t


def _npu_module():
    return getattr(torch, "npu", None)


@functools.lru_cache(maxsize=None)
def available_device_types() -> tuple:
    """Device types present on this machine, accelerator first, 'cpu' always last."""
    found = []
    if (torch.version.cuda or torch.version.hip) and torch.cuda.is_available():
        found.append("rocm" if torch.version.hip else "cuda")
    npu = _npu_module()
    if npu is not None and getattr(npu, "is_available", lambda: False)():
        found.append("npu")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and torch.version.xpu and xpu.is_available():
        found.append("xpu")
    found.append("cpu")
    return tuple(found)


def default_device_type() -> str:
    env = os.environ.get("USP_HAL_DEVICE")
    if env:
        if env not in DEVICE_TYPES:
            raise ValueError(f"USP_HAL_DEVICE={env!r}; valid: {', '.join(DEVICE_TYPES)}")
        return env
    return available_device_types()[0]


def device_count(device_type: str) -> int:
    if device_type == "cpu":
        return 1
    if device_type in ("cuda", "rocm"):
        return torch.cuda.device_count() if device_type in available_device_types() else 0
    if device_type == "npu":
        npu = _npu_module()
        return npu.device_count() if npu is not None and device_type in available_device_types() else 0
    if device_type == "xpu":
        return torch.xpu.device_count() if device_type in available_device_types() else 0
    return 0


@functools.lru_cache(maxsize=None)
def compute_capability(device_type: str, index: int = 0) -> Optional[tuple]:
    """(major, minor) for CUDA devices; None elsewhere (initialises CUDA when asked)."""
    if device_type == "cuda" and "cuda" in available_device_types():
        return tuple(torch.cuda.get_device_capability(index))
    return None


def device_name(device_type: str, index: int = 0) -> str:
    if device_type in ("cuda", "rocm") and device_type in available_device_types():
        return torch.cuda.get_device_name(index)
    if device_type == "xpu" and "xpu" in available_device_types():
        return torch.xpu.get_device_name(index)
    if device_type == "npu" and "npu" in available_device_types():
        return _npu_module().get_device_name(index)
    import platform as _pyplatform
    return _pyplatform.processor() or _pyplatform.machine()


def dist_backend_for(device_type: str) -> str:
    try:
        return DIST_BACKEND[device_type]
    except KeyError:
        raise ValueError(f"unknown device type {device_type!r}; valid: {', '.join(DEVICE_TYPES)}") from None


def dist_backend_available(name: str) -> bool:
    """Whether torch.distributed can create a process group of this backend here."""
    import torch.distributed as dist
    if not dist.is_available():
        return False
    if name == "hccl":
        # registered by torch_npu on import; never trust dist.Backend("hccl") alone
        return _npu_module() is not None and "hccl" in getattr(dist.Backend, "backend_list", [])
    if name == "ccl":
        return importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None
    try:
        return bool(dist.is_backend_available(name))
    except Exception:  # older torch without is_backend_available for this name
        return False


def dist_backend_string(device_type: str) -> str:
    """Backend string for init_process_group: the device's backend, plus cpu:gloo when both exist."""
    acc = dist_backend_for(device_type)
    if device_type == "xpu" and not dist_backend_available("xccl") and dist_backend_available("ccl"):
        acc = "ccl"  # older torch: Intel's oneCCL bindings
    if device_type == "cpu":
        if not dist_backend_available("gloo"):
            raise RuntimeError("torch.distributed has no gloo backend in this build; CPU runs need gloo")
        return "gloo"
    if not dist_backend_available(acc):
        raise RuntimeError(f"the {acc} backend for {device_type} is not available in this torch build; "
                           f"install the {device_type} build of torch (or run on cpu with gloo)")
    if dist_backend_available("gloo"):
        return f"cpu:gloo,{torch_device_name(device_type)}:{acc}"
    return acc


def set_device(device_type: str, local_rank: int) -> "torch.device":
    """Bind this process to its accelerator (no-op on CPU) and return the torch.device."""
    if device_type == "cpu":
        return torch.device("cpu")
    name = torch_device_name(device_type)
    if device_type in ("cuda", "rocm"):
        torch.cuda.set_device(local_rank)
    elif device_type == "npu":
        _npu_module().set_device(local_rank)
    elif device_type == "xpu":
        torch.xpu.set_device(local_rank)
    return torch.device(name, local_rank)


def synchronize(device_type: str) -> None:
    if device_type in ("cuda", "rocm"):
        torch.cuda.synchronize()
    elif device_type == "npu":
        _npu_module().synchronize()
    elif device_type == "xpu":
        torch.xpu.synchronize()


def reset_peak_memory(device_type: str) -> None:
    if device_type in ("cuda", "rocm"):
        torch.cuda.reset_peak_memory_stats()
    elif device_type == "npu":
        _npu_module().reset_peak_memory_stats()
    elif device_type == "xpu":
        torch.xpu.reset_peak_memory_stats()


def peak_memory_bytes(device_type: str) -> Optional[int]:
    """Peak allocated device memory since the last reset; None on CPU (use a tracker there)."""
    if device_type in ("cuda", "rocm"):
        return int(torch.cuda.max_memory_allocated())
    if device_type == "npu":
        return int(_npu_module().max_memory_allocated())
    if device_type == "xpu":
        return int(torch.xpu.max_memory_allocated())
    return None


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


def info() -> PlatformInfo:
    dt = default_device_type()
    names = ["gloo", "nccl", "hccl", "xccl", "ccl", "mpi", "ucc"]
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
    )
