"""Registry: names, yunchang aliases, forced and 'auto' selection with reasons, plugins."""
from __future__ import annotations

import enum

import pytest
import torch

from tests.contract.standin import install_standin, purge_modules
from usp_hal.backends.sdpa import SDPABackend
from usp_hal.dispatch import platform
from usp_hal.dispatch.backend import AttentionBackend
from usp_hal.dispatch.capabilities import AttnRequest
from usp_hal.dispatch.registry import AUTO_PRIORITY, ENTRY_POINT_GROUP, NO_BACKEND, REGISTRY, AttnType, Registry

CPU = AttnRequest(dtype=torch.float32, device_type="cpu", head_dim=64, num_heads=4)


class CudaOnly(AttentionBackend):
    NAME = "cudaonly"
    SUPPORTED_DEVICES = frozenset({"cuda"})
    SUPPORTED_DTYPES = frozenset({torch.float16})


class CpuNoLse(AttentionBackend):
    NAME = "cpunolse"
    SUPPORTED_DEVICES = frozenset({"cpu"})
    SUPPORTED_DTYPES = frozenset({torch.float32})
    RETURNS_LSE = False


@pytest.fixture
def reg():
    return Registry()


def test_builtin_names_are_registered_lazily(reg):
    names = reg.names()
    assert {t.value for t in AttnType} - {"auto"} - set(NO_BACKEND) <= set(names)
    assert names[0] == "sdpa"
    assert reg.get("sdpa") is SDPABackend
    assert reg.get(AttnType.SDPA) is SDPABackend
    assert reg.get("SDPA") is SDPABackend


def test_auto_on_cpu_is_sdpa(reg):
    assert AUTO_PRIORITY["cpu"][0] == "sdpa"
    assert reg.select("auto", CPU) is SDPABackend
    assert reg.select(AttnType.AUTO, CPU.with_(causal=True, num_kv_heads=1, needs_grad=True,
                                               needs_lse=True)) is SDPABackend


def test_forced_choice_is_validated_with_reasons_and_alternatives(reg):
    reg.register("cudaonly", CudaOnly)
    with pytest.raises(NotImplementedError) as info:
        reg.select("cudaonly", CPU)
    msg = str(info.value)
    assert "attn_type='cudaonly' cannot run this call" in msg
    assert "device=cpu (supported: cuda)" in msg
    assert "dtype=fp32 (supported: fp16)" in msg
    assert "unavailable: needs a cuda device" in msg or "cuda" in platform.available_device_types()
    assert "backends that would work: sdpa" in msg


def test_forced_sdpa_refuses_softcap_naming_the_reason(reg):
    with pytest.raises(NotImplementedError, match=r"attn_type='sdpa'.*\n.*softcap=30.0 not supported"):
        reg.select("sdpa", CPU.with_(softcap=30.0))


def test_forced_choice_never_swapped(reg):
    # a supported forced choice returns exactly that backend, not the auto favourite
    reg.register("cpunolse", CpuNoLse)
    assert reg.select("cpunolse", CPU) is CpuNoLse
    with pytest.raises(NotImplementedError, match="does not return a log-sum-exp"):
        reg.select("cpunolse", CPU.with_(needs_lse=True))


def test_unknown_name_lists_valid_options(reg):
    with pytest.raises(ValueError) as info:
        reg.canonical_name("flash_attn_9")
    msg = str(info.value)
    assert "unknown attn_type 'flash_attn_9'" in msg and "valid options are:" in msg
    for name in ("auto", "sdpa", "fa2", "fa3", "sage_fp8", "flashinfer", "npu", "xpu", "FA", "TORCH"):
        assert name in msg
    with pytest.raises(ValueError, match="valid options are"):
        reg.select("nope", CPU)


@pytest.mark.parametrize("alias, name", [
    ("FA", "fa2"), ("FA3", "fa3"), ("TORCH", "sdpa"), ("SAGE_FP8", "sage_fp8"),
    ("FLASHINFER", "flashinfer"), ("NPU", "npu"), ("SAGE_AUTO", "sage_fp8"), ("TORCH_EFFICIENT", "sdpa"),
    ("fa", "fa2"), ("auto", "auto"), ("AUTO", "auto"),
])
def test_yunchang_names(reg, alias, name):
    assert reg.canonical_name(alias) == name


def test_usp_hal_enum_aliases(reg):
    assert AttnType.FA is AttnType.FA2 and AttnType.TORCH is AttnType.SDPA
    assert reg.canonical_name(AttnType.FA) == "fa2"


def test_foreign_enum_member_is_taken_by_name(reg):
    class ForeignAttnType(enum.Enum):   # stands for yunchang.kernels.AttnType
        FA = "fa"
        FA3 = "fa3"
        TORCH = "torch"
        SAGE_FP8 = "sage_fp8"
        FLASHINFER = "flashinfer"
        NPU = "npu"
        NOT_OURS = "not_ours"

    assert reg.canonical_name(ForeignAttnType.FA) == "fa2"
    assert reg.canonical_name(ForeignAttnType.TORCH) == "sdpa"
    assert reg.canonical_name(ForeignAttnType.FLASHINFER) == "flashinfer"
    assert reg.get(ForeignAttnType.TORCH) is SDPABackend
    with pytest.raises(ValueError, match="'NOT_OURS'"):
        reg.canonical_name(ForeignAttnType.NOT_OURS)


def test_auto_error_lists_every_candidate_with_reasons(reg):
    reg.register("cpunolse", CpuNoLse)
    req = CPU.with_(softcap=30.0, needs_lse=True, dropout_p=0.1)      # dropout: the fallback refuses it too
    assert reg.priority("cpu") == ["sdpa", "cpunolse"]
    assert reg.candidates("cpu") == ["sdpa", "cpunolse", "portable"]
    with pytest.raises(NotImplementedError) as info:
        reg.select("auto", req)
    msg = str(info.value)
    assert msg.startswith("No attention backend found for inputs: ")
    assert "softcap=30.0" in msg.splitlines()[0]
    assert "`sdpa` is not supported because:\n    - softcap=30.0 not supported" in msg
    assert "`cpunolse` is not supported because:" in msg
    assert "does not return a log-sum-exp" in msg.split("`cpunolse`")[1]
    assert "`portable` is not supported because:\n    - dropout_p=0.1 not supported" in msg
    assert "`flex (not tried by auto)` is not supported because:" in msg


def test_auto_with_no_candidate_for_a_device(reg):
    with pytest.raises(NotImplementedError, match="no backend is registered for device 'tpu'"):
        reg.select("auto", CPU.with_(device_type="tpu"))


def test_register_rules(reg):
    with pytest.raises(ValueError, match="reserved"):
        reg.register("auto", CpuNoLse)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("sdpa", CpuNoLse)
    reg.register("sdpa", CpuNoLse, override=True)
    assert reg.get("sdpa") is CpuNoLse
    reg.register("notabackend", dict)
    with pytest.raises(TypeError, match="must be an AttentionBackend subclass"):
        reg.get("notabackend")
    assert REGISTRY.get("sdpa") is SDPABackend            # the global one is untouched


PLUGIN_SRC = '''
import torch
from usp_hal.dispatch.backend import AttentionBackend


class PluginBackend(AttentionBackend):
    NAME = "myplugin"
    DESCRIPTION = "out-of-tree test plugin"
    SUPPORTED_DEVICES = frozenset({"cpu"})
    SUPPORTED_DTYPES = frozenset({torch.float32})
    SUPPORTS_SOFTCAP = True
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    site = install_standin(tmp_path, monkeypatch, dist="usp-hal-myplugin", version="0.3.0",
                           files={"usp_hal_myplugin/__init__.py": PLUGIN_SRC})
    (dist_info,) = site.glob("*.dist-info")
    (dist_info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nmyplugin = usp_hal_myplugin:PluginBackend\n"
        f"brokenplugin = usp_hal_myplugin:DoesNotExist\n")
    yield site
    purge_modules(["usp_hal_myplugin"])


def test_plugin_through_an_entry_point(plugin):
    reg = Registry()
    assert "myplugin" in reg.names()
    cls = reg.get("myplugin")
    assert cls.__name__ == "PluginBackend" and cls.DESCRIPTION == "out-of-tree test plugin"
    assert reg.priority("cpu")[0] == "sdpa" and "myplugin" in reg.priority("cpu")
    # explicit choice works; auto prefers the built-in but falls through to the plugin
    assert reg.select("myplugin", CPU.with_(softcap=5.0)) is cls
    assert reg.select("auto", CPU.with_(softcap=5.0)) is cls
    assert reg.select("auto", CPU) is SDPABackend


def test_broken_plugin_fails_with_its_name(plugin):
    reg = Registry()
    with pytest.raises(RuntimeError, match="plugin backend 'brokenplugin'.*failed to load"):
        reg.get("brokenplugin")
    # a broken plugin does not hide the others from auto selection
    assert reg.select("auto", CPU.with_(softcap=5.0)).NAME == "myplugin"


def test_plugin_is_invisible_without_its_distribution():
    assert "myplugin" not in Registry().names()


def test_auto_priority_is_read_from_the_platform_entries():
    from usp_hal.dispatch.platform import PLATFORMS
    assert AUTO_PRIORITY == {name: list(p.auto_priority) for name, p in PLATFORMS.items()}


def test_dispatch_fills_in_the_device_model_the_caller_did_not_pass(reg):
    """Rules on device models apply even when the core's request carries none."""
    from usp_hal.backends.xpu import XPUBackend
    req = AttnRequest(dtype=torch.float16, device_type="xpu", head_dim=64, num_heads=4)
    with platform.emulate("xpu", device_model="intel_gpu_acm_g10", torch_version="2.13.0+xpu"):
        reasons = reg.reasons("xpu", req)
        assert any("device model intel_gpu_acm_g10" in r for r in reasons), reasons
    with platform.emulate("xpu", device_model="intel_gpu_pvc", torch_version="2.13.0+xpu"):
        assert reg.reasons("xpu", req) == [] and reg.select("xpu", req) is XPUBackend
