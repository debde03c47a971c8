"""The platform layer: one entry per device type, the module-level facts read from it, and
the emulation seam the contract tests use."""
from __future__ import annotations

import pytest
import torch

from usp_hal.dispatch import platform
from usp_hal.dispatch.registry import AUTO_PRIORITY
from usp_hal.harness import matrix


def test_one_entry_per_device_type_holds_every_device_fact():
    assert set(platform.PLATFORMS) == {"cpu", "cuda", "rocm", "npu", "xpu"}
    assert platform.DEVICE_TYPES == tuple(platform.PLATFORMS)
    for name, p in platform.PLATFORMS.items():
        assert p.name == name and p.torch_device and p.dist_backend and p.code > 0
        assert platform.dist_backend_for(name) == p.dist_backend == platform.DIST_BACKEND[name]
        assert platform.torch_device_name(name) == p.torch_device
        assert platform.device_code(name) == p.code
        assert AUTO_PRIORITY[name] == list(p.auto_priority)
        for prof in p.ci_profiles:
            assert matrix.PROFILES[prof.name] is prof and prof.device_type == name
    assert len({p.code for p in platform.PLATFORMS.values()}) == len(platform.PLATFORMS)
    assert platform.torch_device_name("rocm") == "cuda"
    assert platform.device_code("tpu") == 0
    with pytest.raises(ValueError, match="unknown device type 'tpu'"):
        platform.dist_backend_for("tpu")


def test_cpu_facts():
    assert platform.available_device_types()[-1] == "cpu"
    assert platform.device_type_of(torch.zeros(1).device) == "cpu"
    assert platform.compute_capability("cpu") is None and platform.device_model("cpu") is None
    assert platform.set_device("cpu", 3) == torch.device("cpu")
    platform.synchronize("cpu")
    assert platform.peak_memory_bytes("cpu") is None
    assert platform.device_count("cpu") == 1


def test_emulation_makes_cpu_tensors_report_the_device():
    cpu = torch.zeros(1).device
    with platform.emulate("cuda", compute_capability=(8, 6)) as em:
        assert em.device_model == "sm86"
        assert platform.device_type_of(cpu) == "cuda"
        assert platform.compute_capability("cuda") == (8, 6) and platform.device_model("cuda") == "sm86"
        assert platform.available_device_types() == ("cuda", "cpu")
        assert platform.set_device("cuda", 0) == torch.device("cpu")
        with platform.emulate("xpu", device_model="intel_gpu_pvc", torch_version="2.12.0+xpu"):
            assert platform.device_type_of(cpu) == "xpu" and platform.torch_version() == "2.12.0+xpu"
            assert platform.compute_capability("xpu") is None and platform.device_model("xpu") == "intel_gpu_pvc"
        assert platform.device_type_of(cpu) == "cuda" and platform.torch_version() == torch.__version__
    assert platform.device_type_of(cpu) == "cpu" and platform.emulated() is None
    with pytest.raises(ValueError):
        with platform.emulate("cpu"):
            pass


def test_xpu_device_models_ignore_the_stepping():
    assert platform.xpu_model_from_architecture(0x0000000500400400) == "intel_gpu_bmg_g21"
    assert platform.xpu_model_from_architecture(0x0000000500400000) == "intel_gpu_bmg_g21"
    assert platform.xpu_model_from_architecture(0x000000030F000700) == "intel_gpu_pvc"
    assert platform.xpu_model_from_architecture(0x9900000000000000) is None


def test_info_reports_device_model_and_every_dist_backend_name():
    info = platform.info()
    assert {"gloo", "nccl", "hccl", "xccl", "ccl"} <= set(info.dist_backends)
    assert info.dist_backends["gloo"] is True
