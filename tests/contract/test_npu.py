"""Contract tests for the Ascend NPU adapter (``usp_hal.backends.npu``).

They prove the *adapter*, not the kernel: a stand-in ``torch_npu`` package with the real
import path and the signatures of ``npu_fusion_attention`` / ``npu_fusion_attention_grad``
keeps their documented quirks (``softmax_max``/``softmax_sum`` ``[B, N, S, 8]``,
``sparse_mode`` rules with the compressed 2048x2048 mask and full attention when no mask
is given, misspelled ``pre_tockens``/``next_tockens``, ``scale`` vs ``scale_value``, grad
output count that differs between releases) and computes attention on CPU tensors.  Out,
lse and gradients are compared with the float64 reference.  The per-device CI runs the
real kernel on Ascend hardware.
"""
from __future__ import annotations

import sys

import pytest
import torch

from usp_hal import AttnRequest, KernelCall, get_backend
from usp_hal.backends.npu import NPUBackend
from usp_hal.dispatch import backend as backend_mod
from usp_hal.dispatch import platform

from .standins_misc import (
    assert_import_is_clean,
    assert_lse_matches,
    assert_matches,
    install,
    make_inputs,
    merge_blocks,
    npu_files,
    purge_modules,
    reference,
    reference_grads,
)

pytestmark = pytest.mark.contract
EMULATE = dict(device_type="npu")

VERSION = "2.14.0"


@pytest.fixture
def npu(tmp_path, monkeypatch):
    """Install a torch_npu stand-in whose grad op returns 4 or 5 items; returns the module."""
    def _install(grad_outputs=5, version=VERSION):
        install(tmp_path / f"{version}-{grad_outputs}", monkeypatch, "torch-npu", version, npu_files(grad_outputs))
        import torch_npu
        return torch_npu
    yield _install
    purge_modules(["torch_npu"])


def npu_request(**kw):
    kw.setdefault("dtype", torch.float16)
    kw.setdefault("device_type", "npu")
    return AttnRequest(**kw)


def test_contract_registry_entry_is_this_class():
    assert get_backend("npu") is NPUBackend
    caps = NPUBackend.capabilities()
    assert caps["backward"] and caps["lse"] and caps["comm"] == ["hccl"]


@pytest.mark.parametrize("grad_outputs", [4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,h,hkv,d,causal", [
    (1, 4, 4, 64, False),
    (2, 4, 2, 48, True),       # B > 1, GQA, causal
    (2, 3, 1, 16, True),       # MQA
])
def test_contract_forward_backward_match_reference(npu, grad_outputs, dtype, b, h, hkv, d, causal):
    kernel = npu(grad_outputs)
    q, k, v, dout = make_inputs(b, 24, 24, h, hkv, d, dtype, seed=d)
    backend = NPUBackend()
    out, lse = backend.forward(q, k, v, KernelCall(scale=0.17, causal=causal))
    ref_out, ref_lse = reference(q, k, v, softmax_scale=0.17, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, h, 24)
    assert_matches(out, ref_out, dtype, "out")
    assert_lse_matches(lse, ref_lse)

    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, KernelCall(scale=0.17, causal=causal))
    rdq, rdk, rdv = reference_grads(q, k, v, dout, softmax_scale=0.17, causal=causal)
    assert dk.shape == k.shape and dv.shape == v.shape and dq.dtype == dtype
    for name, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert_matches(got, want, dtype, name)
    fwd, grad = kernel.CALLS[0], kernel.CALLS[-1]
    assert fwd["scale"] == 0.17 and grad["scale_value"] == 0.17


def test_contract_causal_goes_through_sparse_mode_2_with_the_compressed_mask(npu):
    """Without the mask the kernel ignores sparse_mode and attends to everything."""
    kernel = npu()
    q, k, v, dout = make_inputs(1, 16, 16, 2, 2, 32, torch.float32, seed=5)
    backend = NPUBackend()
    out, lse = backend.forward(q, k, v, KernelCall(scale=None, causal=True))
    backend.backward(dout, q, k, v, out, lse, KernelCall(scale=None, causal=True))
    for call in kernel.CALLS:
        assert call["sparse_mode"] == 2 and call["mask_shape"] == (2048, 2048)
    full, _ = reference(q, k, v)
    assert (out.double() - full).abs().max() > 0.1
    backend.forward(q, k, v, KernelCall(scale=None, causal=False))
    assert kernel.CALLS[-1]["sparse_mode"] == 0 and kernel.CALLS[-1]["mask_shape"] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contract_ring_backward_with_the_global_lse(npu, dtype):
    """Ring use: forward per key block, merge, then backward per block with the *global*
    out/lse; summed dq and concatenated dk/dv must equal the full attention's gradients."""
    npu()
    q, k, v, dout = make_inputs(2, 16, 24, 4, 2, 32, dtype, seed=9)
    backend = NPUBackend()
    blocks = [(0, 8), (8, 24)]
    parts = [backend.forward(q, k[:, a:e], v[:, a:e], KernelCall(scale=None)) for a, e in blocks]
    out64, lse64 = merge_blocks([p[0] for p in parts], [p[1] for p in parts])
    ref_out, ref_lse = reference(q, k, v)
    assert_matches(out64, ref_out, dtype, "merged out")
    out, lse = out64.to(dtype), lse64.float()
    grads = [backend.backward(dout, q, k[:, a:e], v[:, a:e], out, lse, KernelCall(scale=None)) for a, e in blocks]
    dq = sum(g[0].double() for g in grads)
    dk = torch.cat([g[1] for g in grads], dim=1)
    dv = torch.cat([g[2] for g in grads], dim=1)
    rdq, rdk, rdv = reference_grads(q, k, v, dout)
    tol_dtype = torch.float16 if dtype == torch.float32 else dtype   # out was rounded once more
    for name, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert_matches(got, want, tol_dtype, name)


def test_contract_rows_with_minus_inf_lse_contribute_nothing(npu):
    npu()
    q, k, v, dout = make_inputs(1, 8, 8, 2, 2, 16, torch.float32, seed=2)
    backend = NPUBackend()
    out, lse = backend.forward(q, k, v, KernelCall(scale=None))
    lse = lse.clone()
    lse[:, :, :3] = float("-inf")
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, KernelCall(scale=None))
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert dq[:, :3].abs().max() == 0
    keep = dout.clone()
    keep[:, :3] = 0
    _, dk_ref, dv_ref = backend.backward(keep, q, k, v, out, backend.forward(q, k, v, KernelCall(scale=None))[1],
                                         KernelCall(scale=None))
    torch.testing.assert_close(dk, dk_ref)
    torch.testing.assert_close(dv, dv_ref)


@pytest.mark.parametrize("req,needle", [
    (dict(dropout_p=0.1), "dropout"),
    (dict(window=(8, 0)), "sliding window"),
    (dict(softcap=30.0), "softcap"),
    (dict(alibi=True), "alibi"),
    (dict(head_dim=1024), "head_dim=1024"),
    (dict(dtype=torch.float64), "dtype=fp64"),
    (dict(num_heads=512, num_kv_heads=512), "heads=512 > 256"),
    (dict(num_heads=6, num_kv_heads=4), "multiple of kv_heads"),
    (dict(device_type="cuda"), "device=cuda"),
    (dict(deterministic=True, needs_grad=True), "not deterministic"),
])
def test_contract_refusal_reasons(npu, req, needle):
    npu()
    reasons = NPUBackend.not_supported_reasons(npu_request(**req))
    assert any(needle in r for r in reasons), reasons


def test_contract_supported_requests_have_no_reasons(npu):
    npu()
    for req in (dict(needs_grad=True, needs_lse=True, causal=True), dict(dtype=torch.float32, head_dim=768),
                dict(num_heads=8, num_kv_heads=1), dict(dtype=torch.bfloat16, head_dim=1)):
        assert NPUBackend.not_supported_reasons(npu_request(**req)) == [], req


def test_contract_forward_and_backward_refuse_dropout_and_masks(npu):
    npu()
    q, k, v, dout = make_inputs(1, 8, 8, 2, 2, 16, torch.float16)
    backend = NPUBackend()
    for kw in (dict(dropout_p=0.1), dict(window=(2, 2)), dict(softcap=5.0), dict(alibi_slopes=torch.ones(2))):
        with pytest.raises(NotImplementedError, match="npu"):
            backend.forward(q, k, v, KernelCall(scale=None, **kw))
        with pytest.raises(NotImplementedError, match="npu"):
            backend.backward(dout, q, k, v, q, torch.zeros(1, 2, 8), KernelCall(scale=None, **kw))
    with pytest.raises(NotImplementedError, match="dropout_p=0.1 not supported"):
        backend.forward(q, k, v, KernelCall(scale=None, dropout_p=0.1))


def test_contract_declared_limits_match_the_op_documentation(npu):
    """Head dim 1..768 and at most 256 query heads (the op's documentation): the declarations
    refuse exactly where the stand-in's op raises."""
    kernel = npu()
    assert NPUBackend.not_supported_reasons(npu_request(head_dim=768)) == []
    assert NPUBackend.not_supported_reasons(npu_request(head_dim=769))
    assert NPUBackend.not_supported_reasons(npu_request(num_heads=256, num_kv_heads=256)) == []
    q, k, v, _ = make_inputs(1, 4, 4, 1, 1, 776, torch.float16)
    with pytest.raises(ValueError, match="outside 1..768"):
        kernel.npu_fusion_attention(q, k, v, 1, "BSND")
    with pytest.raises(NotImplementedError, match="head_dim=776"):
        NPUBackend().forward(q, k, v, KernelCall(scale=None))
    assert NPUBackend.REQUIRED_PACKAGES[0].min_version == "2.1.0"


def test_contract_availability_too_old(npu):
    npu(version="2.0.1")
    avail = NPUBackend.availability()
    assert not avail.ok and "torch-npu 2.0.1 too old (needs >= 2.1.0)" == avail.reason


def test_contract_availability_not_installed(monkeypatch):
    monkeypatch.setattr(backend_mod, "installed_version", lambda pkg: None)
    avail = NPUBackend.availability()
    assert not avail.ok and avail.reason == "torch-npu not installed (pip install 'usp-hal[npu]')"


def test_contract_availability_needs_an_npu(npu, monkeypatch):
    npu()
    purge_modules(["torch_npu"])
    monkeypatch.setattr(platform, "available_device_types", lambda: ("cpu",))
    if hasattr(torch, "npu"):
        monkeypatch.delattr(torch, "npu")
    avail = NPUBackend.availability()
    assert not avail.ok and "needs a npu device, found cpu" in avail.reason
    assert "torch_npu was not imported" in avail.reason and "TORCH_DEVICE_BACKEND_AUTOLOAD" in avail.reason
    assert "torch_npu" not in sys.modules          # availability never imports the kernel
    monkeypatch.setattr(platform, "available_device_types", lambda: ("npu", "cpu"))
    assert NPUBackend.availability().ok


def test_contract_import_does_not_load_torch_npu(npu):
    kernel = npu()
    site = kernel.__file__.rsplit("/torch_npu/", 1)[0]
    purge_modules(["torch_npu"])
    assert_import_is_clean(site, module="npu", name="npu", device="npu", kernel="torch_npu")
