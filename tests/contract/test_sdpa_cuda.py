"""Contract tests for the CUDA path of the sdpa backend (``usp_hal.backends.sdpa``).

The aten CUDA ops are replaced (``usp_hal.backends.sdpa.cuda_ops``) by CPU stand-ins that
enforce the real ops' checks (tests/contract/standins_sdpa.py): the flash op's head dim
multiple of 8 and <= 256, sm80+, fp16/bf16; the efficient op's bias dtype and stride
alignment, bf16 only from sm80, equal head counts, top-left causal and padded lse.  The
adapter runs on CPU tensors inside ``usp_hal.dispatch.platform.emulate("cuda", ...)`` and is compared
with the float64 reference.  This proves the adapter, not the kernels.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_cases import kernel_call
from usp_hal import KernelCall
from usp_hal.backends import sdpa as sdpa_mod
from usp_hal.backends.sdpa import SDPABackend
from usp_hal.dispatch import platform
from usp_hal.dispatch.capabilities import AttnRequest

from .standins_misc import assert_lse_matches, assert_matches, make_inputs, reference, reference_grads
from .standins_sdpa import CudaSDPAStandin

pytestmark = pytest.mark.contract
EMULATE = dict(device_type="cuda", compute_capability=(9, 0))


@pytest.fixture
def ops(monkeypatch):
    standin = CudaSDPAStandin()
    monkeypatch.setattr(sdpa_mod, "cuda_ops", lambda: (standin.flash, standin.efficient, standin.efficient_backward))
    return standin


def _check(dtype, *, b=2, sq=16, sk=16, h=4, hkv=4, d=32, grad=True, **kw):
    q, k, v, dout = make_inputs(b, sq, sk, h, hkv, d, dtype, seed=d + sq)
    kw.setdefault("softmax_scale", d ** -0.5)
    backend = SDPABackend()
    out, lse = backend.forward(q, k, v, kernel_call(**kw))
    ref_out, ref_lse = reference(q, k, v, **kw)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, h, sq)
    assert_matches(out, ref_out, dtype, "out")
    assert_lse_matches(lse, ref_lse)
    if grad:
        grads = backend.backward(dout, q, k, v, out, lse, kernel_call(**kw))
        for name, got, want, like in zip(("dq", "dk", "dv"), grads, reference_grads(q, k, v, dout, **kw), (q, k, v)):
            assert got.shape == like.shape and got.dtype == dtype, name
            assert_matches(got, want, dtype, name)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [5, 20, 72, 100, 256])
def test_head_dims_the_flash_op_rejects_are_padded(ops, dtype, d):
    """The flash op takes head dims that are multiples of 8 only (the public SDPA pads them):
    the adapter pads, passes the unpadded scale and slices."""
    _check(dtype, d=d, causal=True)
    flash = [c for c in ops.calls if c["op"] == "flash"]
    assert flash and all(c["head_dim"] % 8 == 0 for c in flash)


def test_the_standin_flash_op_rejects_unpadded_head_dims(ops):
    q, k, v, _ = make_inputs(1, 8, 8, 2, 2, 20, torch.float16)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.2)


def test_head_dims_above_256_and_fp32_use_the_efficient_op(ops):
    _check(torch.float16, d=264, h=2, hkv=2, sq=8, sk=8)
    _check(torch.float32, d=40, causal=True)
    assert {c["op"] for c in ops.calls} == {"efficient", "efficient_backward"}


def test_before_sm80_fp16_runs_and_bf16_is_refused(ops):
    with platform.emulate("cuda", compute_capability=(7, 5)):
        _check(torch.float16, d=64, causal=True)
        assert all(c["op"] != "flash" for c in ops.calls)
        reasons = SDPABackend.not_supported_reasons(
            AttnRequest(dtype=torch.bfloat16, device_type="cuda", compute_capability=(7, 5)))
        assert any("bf16 on cuda needs compute capability >= 8.0" in r for r in reasons), reasons
        q, k, v, _ = make_inputs(1, 8, 8, 2, 2, 64, torch.bfloat16)
        with pytest.raises(NotImplementedError, match="bf16 on cuda needs compute capability"):
            SDPABackend().forward(q, k, v, KernelCall(scale=None))
        with pytest.raises(RuntimeError, match="no bfloat16 kernels below sm80"):
            ops.efficient(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True)


@pytest.mark.parametrize("sk", [13, 12, 5])
def test_bias_is_aligned_for_uneven_ring_shards(ops, sk):
    """A window/alibi bias for Sk % 8 != 0 (uneven ring shards) must still have aligned strides."""
    _check(torch.float16, sq=11, sk=sk, window=(6, 0), key_offset=-sk)
    _check(torch.bfloat16, sq=11, sk=sk, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]), key_offset=3)
    q, k, v, _ = make_inputs(1, 11, sk, 4, 4, 32, torch.float16)
    naive = torch.zeros(1, 1, 11, sk, dtype=torch.float16).expand(1, 4, 11, sk)    # strideM = Sk
    if sk % 8:
        with pytest.raises(RuntimeError, match="not correctly aligned"):
            ops.efficient(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), naive, True)


def test_alibi_in_half_precision_runs_in_fp32(ops):
    """The bias must be in q's dtype: an ALiBi bias in bf16 would round integer distances, so the
    adapter runs those calls in fp32 (as the CPU path does)."""
    slopes = torch.tensor([0.9, 0.7, 0.5, 0.3])
    _check(torch.bfloat16, sq=40, sk=40, alibi_slopes=slopes, causal=True)
    eff = [c for c in ops.calls if c["op"] == "efficient"]
    assert eff and all(c["dtype"] == torch.float32 and c["bias_dtype"] == torch.float32 for c in eff)
    q, k, v, _ = make_inputs(1, 8, 8, 2, 2, 32, torch.bfloat16)
    with pytest.raises(RuntimeError, match="invalid dtype for bias"):
        ops.efficient(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                      torch.zeros(1, 2, 8, 16, dtype=torch.float32)[..., :8], True)


def test_causal_with_unequal_lengths_is_top_left(ops):
    """The flash op aligns causal bottom-right: causal with Sq != Sk goes to the efficient op
    (top-left), which is the contract."""
    _check(torch.float16, sq=20, sk=12, causal=True)
    _check(torch.float16, sq=12, sk=20, causal=True)
    assert all(c["op"] != "flash" for c in ops.calls)


def test_gqa(ops):
    _check(torch.bfloat16, h=4, hkv=1, causal=True)
    _check(torch.float16, h=4, hkv=2, window=(3, 2))


def test_rows_without_keys_give_zero_out_and_minus_inf_lse(ops):
    out, lse = _check(torch.float16, sq=12, sk=12, window=(-1, 0), key_offset=6)
    assert torch.isneginf(lse[:, :, :6]).all() and (out[:, :6] == 0).all()


def test_fp64_is_refused_on_cuda():
    q, k, v, _ = make_inputs(1, 8, 8, 2, 2, 16, torch.float64)
    with pytest.raises(NotImplementedError, match="fp64 is only supported on cpu"):
        SDPABackend().forward(q, k, v, KernelCall(scale=None))
