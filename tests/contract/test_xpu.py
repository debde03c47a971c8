"""Contract tests for the Intel XPU adapter (``usp_hal.backends.xpu``).

They prove the *adapter*, not the kernel: ``usp_hal.backends.xpu.flash_ops`` is replaced
by CPU functions with the signatures of ``aten._scaled_dot_product_flash_attention`` and
its backward, keeping the XPU kernels' behaviour per torch version and device model as
read from intel/torch-xpu-ops release/2.10-2.14 (forward head dims 64/96/128/192 before
2.13, any up to 256 from 2.13; BMG-G31 from 2.12; BSHD/BHSD layouts; bottom-right causal;
lse 0 for fully masked rows; ``cum_seq`` undefined for dense calls; native GQA).  Out, lse
and gradients are compared with the float64 reference.  The per-device CI runs the real
ops on Intel GPUs.
"""
from __future__ import annotations

import pytest
import torch

from usp_hal import AttnRequest, KernelCall, get_backend
from usp_hal.backends import xpu as xpu_mod
from usp_hal.backends.xpu import XPUBackend
from usp_hal.dispatch import platform

from .standins_misc import (
    XPUFlashStandin,
    assert_lse_matches,
    assert_matches,
    make_inputs,
    merge_blocks,
    reference,
    reference_grads,
)

pytestmark = pytest.mark.contract
EMULATE = dict(device_type="xpu", device_model="intel_gpu_pvc", torch_version="2.13.0+xpu")


@pytest.fixture
def ops(monkeypatch):
    standin = XPUFlashStandin()
    monkeypatch.setattr(xpu_mod, "flash_ops", lambda: (standin.forward, standin.backward))
    return standin


def xpu_request(**kw):
    kw.setdefault("dtype", torch.bfloat16)
    kw.setdefault("device_type", "xpu")
    return AttnRequest(**kw)


def test_contract_registry_entry_is_this_class():
    assert get_backend("xpu") is XPUBackend
    caps = XPUBackend.capabilities()
    assert caps["backward"] and caps["lse"] and caps["comm"] == ["xccl"]


def test_contract_real_ops_exist_in_this_torch():
    """The indirection resolves to the aten ops named in the docstring (schema check only)."""
    fwd, bwd = xpu_mod.flash_ops()
    assert "rng_state" in str(fwd.default._schema) and "philox_seed" in str(bwd.default._schema)


@pytest.mark.parametrize("torch_version", ["2.12.1+xpu", "2.13.0+xpu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,h,hkv,d,causal", [
    (1, 4, 4, 64, False),
    (2, 4, 2, 64, True),      # B > 1, GQA, causal
    (2, 3, 1, 40, True),      # MQA, head dim padded to 64
    (1, 2, 2, 80, False),     # padded to 96
])
def test_contract_forward_backward_match_reference(ops, dtype, b, h, hkv, d, causal, torch_version):
    with platform.emulate("xpu", device_model="intel_gpu_bmg_g21", torch_version=torch_version):
        _check_forward_backward(ops, dtype, b, h, hkv, d, causal)
    padded = torch_version.startswith("2.12")
    want = {40: 64, 80: 96}.get(d, d) if padded else d
    assert {c["head_dim"] for c in ops.calls} == {want}


def _check_forward_backward(ops, dtype, b, h, hkv, d, causal):
    q, k, v, dout = make_inputs(b, 20, 20, h, hkv, d, dtype, seed=d + b)
    backend = XPUBackend()
    out, lse = backend.forward(q, k, v, KernelCall(scale=0.2, causal=causal))
    ref_out, ref_lse = reference(q, k, v, softmax_scale=0.2, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, h, 20)
    assert_matches(out, ref_out, dtype, "out")
    assert_lse_matches(lse, ref_lse)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, KernelCall(scale=0.2, causal=causal))
    rdq, rdk, rdv = reference_grads(q, k, v, dout, softmax_scale=0.2, causal=causal)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dk.dtype == dtype
    for name, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert_matches(got, want, dtype, name)
    assert all(c["is_causal"] is causal and c["scale"] == 0.2 for c in ops.calls)
    assert all(c["heads"] == (h, hkv) for c in ops.calls)


def test_contract_gqa_grads_per_query_head_are_summed(monkeypatch):
    """A release that returns dk/dv per query head still gives Hkv-headed, exact grads."""
    standin = XPUFlashStandin(sum_gqa_grads=False)
    monkeypatch.setattr(xpu_mod, "flash_ops", lambda: (standin.forward, standin.backward))
    q, k, v, dout = make_inputs(2, 12, 12, 4, 2, 64, torch.float16, seed=8)
    backend = XPUBackend()
    out, lse = backend.forward(q, k, v, KernelCall(scale=None, causal=True))
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, KernelCall(scale=None, causal=True))
    assert dk.shape == k.shape and dv.shape == v.shape
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), reference_grads(q, k, v, dout, causal=True)):
        assert_matches(got, want, torch.float16, name)


def test_contract_causal_reaches_the_op(ops):
    q, k, v, _ = make_inputs(1, 16, 16, 2, 2, 64, torch.float16, seed=4)
    out, _ = XPUBackend().forward(q, k, v, KernelCall(scale=None, causal=True))
    full, _ = reference(q, k, v)
    assert ops.calls[-1]["is_causal"] is True
    assert (out.double() - full).abs().max() > 0.1


def test_contract_ring_backward_with_the_global_lse(ops):
    """Forward per key block, merge, backward per block with the global out/lse."""
    dtype = torch.bfloat16
    q, k, v, dout = make_inputs(2, 16, 32, 4, 2, 64, dtype, seed=13)
    backend = XPUBackend()
    blocks = [(0, 16), (16, 32)]
    parts = [backend.forward(q, k[:, a:e], v[:, a:e], KernelCall(scale=None)) for a, e in blocks]
    out64, lse64 = merge_blocks([p[0] for p in parts], [p[1] for p in parts])
    ref_out, _ = reference(q, k, v)
    assert_matches(out64, ref_out, dtype, "merged out")
    out, lse = out64.to(dtype), lse64.float()
    grads = [backend.backward(dout, q, k[:, a:e], v[:, a:e], out, lse, KernelCall(scale=None)) for a, e in blocks]
    dq = sum(g[0].double() for g in grads)
    dk = torch.cat([g[1] for g in grads], dim=1)
    dv = torch.cat([g[2] for g in grads], dim=1)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), reference_grads(q, k, v, dout)):
        assert_matches(got, want, dtype, name)


def test_contract_rows_with_minus_inf_lse_contribute_nothing(ops):
    q, k, v, dout = make_inputs(1, 8, 8, 2, 2, 64, torch.float16, seed=6)
    backend = XPUBackend()
    out, lse = backend.forward(q, k, v, KernelCall(scale=None))
    lse = lse.clone()
    lse[:, :, 5:] = float("-inf")
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, KernelCall(scale=None))
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert dq[:, 5:].abs().max() == 0


def test_contract_standin_writes_zero_lse_for_masked_rows_and_adapter_never_sends_one(ops):
    """The XPU op stores lse 0 for a fully masked row (bottom-right causal, Sq > Sk);
    the adapter refuses that call instead of passing a wrong lse on."""
    q, k, v, _ = make_inputs(1, 8, 4, 2, 2, 64, torch.float16)
    res = ops.forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True, False)
    assert (res[1][..., :4] == 0).all()
    with pytest.raises(NotImplementedError, match="Sq == Sk"):
        XPUBackend().forward(q, k, v, KernelCall(scale=None, causal=True))


@pytest.mark.parametrize("req,needle", [
    (dict(window=(8, 0)), "sliding window"),
    (dict(softcap=30.0), "softcap"),
    (dict(alibi=True), "alibi"),
    (dict(dropout_p=0.1), "dropout"),
    (dict(head_dim=512), "head_dim=512"),
    (dict(dtype=torch.float32), "dtype=fp32"),
    (dict(deterministic=True, needs_grad=True), "not deterministic"),
    (dict(num_heads=6, num_kv_heads=4), "multiple of kv_heads"),
])
def test_contract_refusal_reasons(req, needle):
    reasons = XPUBackend.not_supported_reasons(xpu_request(**req))
    assert any(needle in r for r in reasons), reasons


def test_contract_supported_requests_have_no_reasons():
    for req in (dict(needs_grad=True, needs_lse=True, causal=True), dict(head_dim=256, dtype=torch.float16),
                dict(num_heads=8, num_kv_heads=1), dict(head_dim=1)):
        assert XPUBackend.not_supported_reasons(xpu_request(**req)) == [], req


def test_contract_forward_and_backward_refuse_unsupported_arguments(ops):
    q, k, v, dout = make_inputs(1, 8, 8, 2, 2, 64, torch.float16)
    backend = XPUBackend()
    for kw in (dict(window=(2, -1)), dict(softcap=5.0), dict(dropout_p=0.1), dict(alibi_slopes=torch.ones(2))):
        with pytest.raises(NotImplementedError, match="xpu"):
            backend.forward(q, k, v, KernelCall(scale=None, **kw))
        with pytest.raises(NotImplementedError, match="xpu"):
            backend.backward(dout, q, k, v, q, torch.zeros(1, 2, 8), KernelCall(scale=None, **kw))
    with pytest.raises(NotImplementedError, match="head_dim=300"):
        qq, kk, vv, _ = make_inputs(1, 4, 4, 1, 1, 300, torch.float16)
        backend.forward(qq, kk, vv, KernelCall(scale=None))
    assert ops.calls == []


def test_contract_availability_on_a_build_without_xpu(monkeypatch):
    monkeypatch.setattr(platform, "available_device_types", lambda: ("cpu",))
    monkeypatch.setattr(torch.version, "xpu", None)
    avail = XPUBackend.availability()
    assert not avail.ok and "needs a xpu device, found cpu" in avail.reason
    assert "no XPU support" in avail.reason and ">= 2.10" in avail.reason


def test_contract_availability_needs_torch_2_10():
    with platform.emulate("xpu", device_model="intel_gpu_pvc", torch_version="2.9.1+xpu"):
        avail = XPUBackend.availability()
        assert not avail.ok and "torch 2.9.1+xpu has no XPU flash-attention kernel" in avail.reason
        assert "torch >= 2.10" in avail.reason
    with platform.emulate("xpu", device_model="intel_gpu_pvc", torch_version="2.10.0+xpu"):
        assert XPUBackend.availability().ok


@pytest.mark.parametrize("torch_version,head_dim,ok", [
    ("2.10.0+xpu", 192, True), ("2.12.1+xpu", 200, False), ("2.12.1+xpu", 256, False),
    ("2.13.0+xpu", 200, True), ("2.13.0+xpu", 256, True),
])
def test_contract_head_dims_follow_the_torch_version(ops, torch_version, head_dim, ok):
    """Before 2.13 the XPU forward has kernels for 64/96/128/192 only: padding (192, 256] up
    to 256 would crash there, so those head dims are refused; from 2.13 they run."""
    with platform.emulate("xpu", device_model="intel_gpu_pvc", torch_version=torch_version):
        q, k, v, dout = make_inputs(1, 8, 8, 2, 2, head_dim, torch.float16, seed=head_dim)
        reasons = XPUBackend.not_supported_reasons(xpu_request(head_dim=head_dim, needs_grad=True))
        if not ok:
            assert any("head dims 64, 96, 128 and 192 only" in r for r in reasons), reasons
            with pytest.raises(RuntimeError, match="only support headdim 64,96,128,192"):
                ops.forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.1)
            with pytest.raises(NotImplementedError, match=f"head_dim={head_dim}"):
                XPUBackend().forward(q, k, v, KernelCall(scale=None))
            return
        assert reasons == []
        out, lse = XPUBackend().forward(q, k, v, KernelCall(scale=None))
        dq, dk, dv = XPUBackend().backward(dout, q, k, v, out, lse, KernelCall(scale=None))
        ref_out, _ = reference(q, k, v)
        assert_matches(out, ref_out, torch.float16, "out")
        for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), reference_grads(q, k, v, dout)):
            assert_matches(got, want, torch.float16, name)


@pytest.mark.parametrize("torch_version,model,ok", [
    ("2.11.0+xpu", "intel_gpu_bmg_g21", True), ("2.11.0+xpu", "intel_gpu_bmg_g31", False),
    ("2.12.0+xpu", "intel_gpu_bmg_g31", True), ("2.13.0+xpu", "intel_gpu_acm_g10", False),
])
def test_contract_device_models_follow_the_torch_version(ops, torch_version, model, ok):
    with platform.emulate("xpu", device_model=model, torch_version=torch_version):
        q, k, v, _ = make_inputs(1, 8, 8, 2, 2, 64, torch.float16)
        avail = XPUBackend.availability()
        reasons = XPUBackend.not_supported_reasons(xpu_request(device_model=model))
        if ok:
            assert avail.ok and reasons == []
            XPUBackend().forward(q, k, v, KernelCall(scale=None))
            return
        assert not avail.ok and f"device model {model}" in avail.reason
        assert any(f"device model {model}" in r for r in reasons)
        with pytest.raises(RuntimeError, match="does not support flash attention"):
            ops.forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        with pytest.raises(NotImplementedError, match=f"device model {model}"):
            XPUBackend().forward(q, k, v, KernelCall(scale=None))
