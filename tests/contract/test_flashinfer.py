"""Contract tests for the FlashInfer adapter (``usp_hal.backends.flashinfer``).

They prove the *adapter*, not the kernel: a stand-in ``flashinfer`` package with the
real import path and the signature of ``single_prefill_with_kv_cache`` keeps FlashInfer's
quirks (no batch dim, base-2 lse shaped ``[S, H]``, bottom-right causal and
``window_left``, kernels for head dims 64/128/256 only) and computes attention on CPU
tensors; the adapter's out and lse are compared with the float64 reference.  The
per-device CI runs the real kernel.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from usp_hal import AttnRequest, KernelCall, get_backend
from usp_hal.backends.flashinfer import FlashInferBackend
from usp_hal.dispatch import backend as backend_mod
from usp_hal.dispatch import platform

from .standins_misc import (
    assert_import_is_clean,
    assert_lse_matches,
    assert_matches,
    flashinfer_files,
    install,
    make_inputs,
    purge_modules,
    reference,
)

pytestmark = pytest.mark.contract
EMULATE = dict(device_type="cuda", compute_capability=(9, 0))

VERSION = "0.6.18"


@pytest.fixture
def flashinfer(tmp_path, monkeypatch):
    """Install the flashinfer stand-in (optionally at another version); returns the module."""
    def _install(version=VERSION):
        install(tmp_path / version, monkeypatch, "flashinfer-python", version, flashinfer_files())
        import flashinfer as mod
        return mod
    yield _install
    purge_modules(["flashinfer", "flashinfer_jit_cache"])


def cuda_request(**kw):
    kw.setdefault("dtype", torch.float16)
    kw.setdefault("device_type", "cuda")
    return AttnRequest(**kw)


def test_contract_registry_entry_is_this_class():
    assert get_backend("flashinfer") is FlashInferBackend
    assert FlashInferBackend.capabilities()["backward"] is False


def test_contract_standin_keeps_the_base2_lse_quirk(flashinfer):
    """Guard the stand-in itself: its raw lse is base 2 and [S, H], as documented."""
    fi = flashinfer()
    q, k, v, _ = make_inputs(1, 12, 12, 2, 2, 64, torch.float16)
    _, lse2 = fi.single_prefill_with_kv_cache(q[0], k[0], v[0], return_lse=True)
    _, ref_lse = reference(q, k, v)
    assert lse2.shape == (12, 2)
    torch.testing.assert_close(lse2.double(), ref_lse[0].t() / math.log(2.0), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,h,hkv,d,kw", [
    (1, 4, 4, 64, dict()),
    (2, 4, 2, 64, dict(causal=True)),                     # B > 1, GQA, causal
    (3, 2, 1, 40, dict(causal=True, window=(5, 0))),      # MQA, padded head dim, causal + window
    (2, 4, 4, 96, dict(window=(6, -1), softcap=3.0)),     # left window + softcap, padded to 128
    (1, 2, 2, 200, dict(softmax_scale=0.05)),             # padded to 256
])
def test_contract_forward_matches_reference(flashinfer, dtype, b, h, hkv, d, kw):
    fi = flashinfer()
    kw = dict(kw)
    q, k, v, _ = make_inputs(b, 20, 20, h, hkv, d, dtype, seed=b + d)
    scale = kw.pop("softmax_scale", None)
    out, lse = FlashInferBackend().forward(q, k, v, KernelCall(scale=scale, **kw))
    ref_out, ref_lse = reference(q, k, v, softmax_scale=scale, **kw)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, h, 20)
    assert_matches(out, ref_out, dtype, "out")
    assert_lse_matches(lse, ref_lse)
    assert len(fi.CALLS) == b and all(c["kv_layout"] == "NHD" and c["return_lse"] for c in fi.CALLS)
    assert all(c["shape"][-1] in (64, 128, 256) for c in fi.CALLS)


def test_contract_causal_reaches_the_kernel(flashinfer):
    fi = flashinfer()
    q, k, v, _ = make_inputs(2, 16, 16, 2, 2, 64, torch.float16, seed=7)
    out, _ = FlashInferBackend().forward(q, k, v, KernelCall(scale=None, causal=True))
    assert all(c["causal"] is True for c in fi.CALLS)
    full, _ = reference(q, k, v)
    assert (out.double() - full).abs().max() > 0.1


def test_contract_unequal_lengths_window_is_top_left(flashinfer):
    """Sq != Sk: the adapter shifts window_left so the kept keys are the contract's
    (top-left) ones, not FlashInfer's bottom-right ones."""
    flashinfer()
    for sq, sk, left in ((20, 16, 6), (10, 16, 3)):
        q, k, v, _ = make_inputs(2, sq, sk, 2, 2, 64, torch.float16, seed=sq)
        out, lse = FlashInferBackend().forward(q, k, v, KernelCall(scale=None, window=(left, -1)))
        ref_out, ref_lse = reference(q, k, v, window=(left, -1))
        assert_matches(out, ref_out, torch.float16, f"out Sq={sq} Sk={sk}")
        assert_lse_matches(lse, ref_lse)
    q, k, v, _ = make_inputs(1, 24, 16, 2, 2, 64, torch.float16)
    with pytest.raises(NotImplementedError, match="negative bound"):    # rows 0..3 would see no key
        FlashInferBackend().forward(q, k, v, KernelCall(scale=None, window=(4, -1)))


@pytest.mark.parametrize("req,needle", [
    (dict(window=(8, 2)), "right bound without causal"),
    (dict(window=(-1, 0)), "right bound without causal"),
    (dict(needs_grad=True), "forward-only"),
    (dict(alibi=True), "alibi"),
    (dict(dropout_p=0.1), "dropout"),
    (dict(head_dim=512), "head_dim=512"),
    (dict(dtype=torch.float32), "dtype=fp32"),
    (dict(window=(8, -1), key_offset=True), "window/alibi across ring blocks"),
    (dict(compute_capability=(7, 0)), "compute capability >= 7.5"),
    (dict(dtype=torch.bfloat16, compute_capability=(7, 5)), "bf16 needs compute capability >= 8.0"),
])
def test_contract_refusal_reasons(flashinfer, req, needle):
    flashinfer()
    reasons = FlashInferBackend.not_supported_reasons(cuda_request(**req))
    assert any(needle in r for r in reasons), reasons


@pytest.mark.parametrize("req", [
    dict(window=(8, 0), causal=True), dict(window=(8, -1)), dict(softcap=30.0), dict(needs_lse=True),
    dict(num_heads=8, num_kv_heads=2), dict(head_dim=80), dict(compute_capability=(7, 5)),
])
def test_contract_supported_requests_have_no_reasons(flashinfer, req):
    flashinfer()
    assert FlashInferBackend.not_supported_reasons(cuda_request(**req)) == []


def test_contract_sm75_large_head_dim_depends_on_version(flashinfer):
    flashinfer("0.6.10")
    reasons = FlashInferBackend.not_supported_reasons(cuda_request(head_dim=192, compute_capability=(7, 5)))
    assert any("needs flashinfer-python >= 0.6.16" in r for r in reasons), reasons
    assert FlashInferBackend.not_supported_reasons(cuda_request(head_dim=192, compute_capability=(8, 0))) == []


def test_contract_forward_refuses_what_flashinfer_cannot_do(flashinfer):
    flashinfer()
    q, k, v, _ = make_inputs(1, 8, 8, 2, 2, 64, torch.float16)
    backend = FlashInferBackend()
    with pytest.raises(NotImplementedError, match="right bound"):
        backend.forward(q, k, v, KernelCall(scale=None, window=(4, 2)))
    with pytest.raises(NotImplementedError, match="alibi"):
        backend.forward(q, k, v, KernelCall(scale=None, alibi_slopes=torch.ones(2)))
    with pytest.raises(NotImplementedError, match="dropout"):
        backend.forward(q, k, v, KernelCall(scale=None, dropout_p=0.1))
    with pytest.raises(NotImplementedError, match="window/alibi across ring blocks"):
        backend.forward(q, k, v, KernelCall(scale=None, window=(4, -1), key_offset=8))
    with pytest.raises(NotImplementedError, match="Sq == Sk"):
        backend.forward(q, k[:, :4], v[:, :4], KernelCall(scale=None, causal=True))
    with pytest.raises(NotImplementedError, match="forward-only"):
        backend.backward(q, q, k, v, q, torch.zeros(1, 2, 8), KernelCall(scale=None))


def test_contract_availability_not_installed(monkeypatch):
    monkeypatch.setattr(backend_mod, "installed_version", lambda pkg: None)
    avail = FlashInferBackend.availability()
    assert not avail.ok and avail.reason == "flashinfer-python not installed (pip install 'usp-hal[flashinfer]')"


def test_contract_availability_too_old(flashinfer):
    flashinfer("0.1.6")
    avail = FlashInferBackend.availability()
    assert not avail.ok and "0.1.6 too old" in avail.reason


def test_contract_availability_needs_a_compiler_or_prebuilt_kernels(tmp_path, monkeypatch):
    """FlashInfer builds its kernels on first use: without flashinfer-jit-cache it needs nvcc."""
    install(tmp_path, monkeypatch, "flashinfer-python", VERSION, flashinfer_files(jit_cache=False))
    try:
        for var in ("CUDA_HOME", "CUDA_PATH"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
        monkeypatch.setattr(os.path, "isfile", lambda p: False if p.endswith("nvcc") else os.path.exists(p))
        avail = FlashInferBackend.availability()
        assert not avail.ok and "needs nvcc" in avail.reason and "flashinfer-jit-cache" in avail.reason
        nvcc = tmp_path / "cuda" / "bin" / "nvcc"
        nvcc.parent.mkdir(parents=True)
        nvcc.write_text("#!/bin/sh\n")
        nvcc.chmod(0o755)
        monkeypatch.undo()
        install(tmp_path / "again", monkeypatch, "flashinfer-python", VERSION, flashinfer_files(jit_cache=False))
        monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
        assert FlashInferBackend.availability().ok
    finally:
        purge_modules(["flashinfer", "flashinfer_jit_cache"])


def test_contract_availability_device_and_gpu(flashinfer, monkeypatch):
    flashinfer()
    monkeypatch.setattr(platform, "available_device_types", lambda: ("cpu",))
    assert "needs a cuda device, found cpu" in FlashInferBackend.availability().reason
    monkeypatch.setattr(platform, "available_device_types", lambda: ("cuda", "cpu"))
    monkeypatch.setattr(platform, "compute_capability", lambda dev, index=0: (7, 0))
    assert "compute capability >= 7.5, found 7.0" in FlashInferBackend.availability().reason
    monkeypatch.setattr(platform, "compute_capability", lambda dev, index=0: (7, 5))
    assert FlashInferBackend.availability().ok


def test_contract_import_does_not_load_flashinfer(flashinfer):
    fi = flashinfer()
    site = fi.__file__.rsplit("/flashinfer/", 1)[0]
    purge_modules(["flashinfer"])
    assert_import_is_clean(site, module="flashinfer", name="flashinfer", device="cuda", kernel="flashinfer")
