"""The torch SDPA backend against the float64 reference: forward (out, lse) and backward."""
from __future__ import annotations

import math

import pytest
import torch

from tests.dist_cases import kernel_inputs, merged_key_blocks
from usp_hal import KernelCall
from usp_hal.backends.sdpa import SDPABackend, normalize_cuda_lse
from usp_hal.dispatch.capabilities import AttnRequest
from usp_hal.dispatch.reference import TOLERANCES, reference_attention

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp64", "fp32", "bf16", "fp16"]
KERNEL = SDPABackend()


def _inputs(dtype, b=2, sq=24, sk=None, h=4, hkv=None, d=32, seed=0):
    return kernel_inputs(b, sq, sq if sk is None else sk, h, h if hkv is None else hkv, d, dtype, seed)


def _reference(q, k, v, dout, **kw):
    qr, kr, vr = (x.to(torch.float64).requires_grad_() for x in (q, k, v))
    out, lse = reference_attention(qr, kr, vr, **kw)
    out.backward(dout.to(torch.float64))
    return out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad


def _assert_close(got, ref, dtype, what):
    atol, rtol = TOLERANCES[dtype]
    got = got.to(torch.float64)
    both_inf = torch.isinf(got) & torch.isinf(ref) & (torch.sign(got) == torch.sign(ref))
    diff = (got - ref).abs().masked_fill(both_inf, 0.0)
    bound = atol + rtol * ref.abs().masked_fill(torch.isinf(ref), 0.0)
    assert not torch.isnan(diff).any(), f"{what}: NaN"
    worst = (diff - bound).max()
    assert worst <= 0, f"{what}: max error {diff.max():.3e} over tolerance ({atol}, {rtol})"


def _check(dtype, *, b=2, sq=24, sk=None, h=4, hkv=None, d=32, **kw):
    q, k, v, dout = _inputs(dtype, b=b, sq=sq, sk=sk, h=h, hkv=hkv, d=d)
    scale = kw.pop("softmax_scale", 1.0 / math.sqrt(d))
    ref = _reference(q, k, v, dout, softmax_scale=scale, **kw)
    out, lse = KERNEL.forward(q, k, v, KernelCall(scale=scale, **kw))
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (b, h, sq) and lse.is_contiguous()
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    dq, dk, dv = KERNEL.backward(dout, q, k, v, out, lse, KernelCall(scale=scale, **kw))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == dtype
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref):
        _assert_close(got, want, dtype, name)
    return out, lse, (dq, dk, dv)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_reference(dtype, causal):
    _check(dtype, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("hkv", [2, 1], ids=["gqa", "mqa"])
def test_gqa_and_mqa(dtype, hkv):
    _check(dtype, h=4, hkv=hkv, causal=True)


@pytest.mark.parametrize("d", [5, 13, 72, 100])
def test_odd_head_dims(d):
    _check(torch.float32, d=d, causal=True)
    _check(torch.bfloat16, d=d)


def test_explicit_softmax_scale():
    _check(torch.float32, softmax_scale=0.3)


def test_non_square_block_with_offset():
    # an off-diagonal ring block: fewer queries than keys, keys placed before the queries
    _check(torch.float32, sq=16, sk=24, window=(20, 0), key_offset=-24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_both_sides(dtype):
    _check(dtype, window=(5, 3))
    _check(dtype, window=(4, 0), causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_masked_rows_give_minus_inf_lse_zero_out_and_zero_grads(dtype):
    # keys sit 6 positions ahead of the queries, window keeps only keys at or before the query:
    # query rows 0..5 see no key at all
    out, lse, (dq, dk, dv) = _check(dtype, sq=12, window=(-1, 0), key_offset=6)
    empty = slice(0, 6)
    assert torch.isneginf(lse[:, :, empty]).all()
    assert torch.isfinite(lse[:, :, 6:]).all()
    assert (out[:, empty] == 0).all()
    assert (dq[:, empty] == 0).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_fully_masked_block_gives_zero_everything():
    q, k, v, dout = _inputs(torch.float32, sq=8)
    out, lse = KERNEL.forward(q, k, v, KernelCall(scale=0.2, window=(-1, 0), key_offset=8))
    assert torch.isneginf(lse).all() and (out == 0).all()
    grads = KERNEL.backward(dout, q, k, v, out, lse, KernelCall(scale=0.2, window=(-1, 0), key_offset=8))
    assert all((g == 0).all() for g in grads)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
def test_alibi(dtype):
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    _check(dtype, alibi_slopes=slopes)
    _check(dtype, alibi_slopes=slopes, causal=True)
    _check(dtype, sq=16, sk=24, alibi_slopes=slopes, key_offset=-24)     # across ring blocks


def test_alibi_per_batch_slopes():
    slopes = torch.rand(2, 4)
    _check(torch.float32, alibi_slopes=slopes, causal=True)


def test_backward_with_the_ring_merged_out_and_lse():
    """Two key blocks, merged by lse; each block's backward with the *global* out/lse sums to
    the reference gradients (the contract the ring core relies on)."""
    q, k, v, dout = _inputs(torch.float64, sq=16, sk=32, hkv=2)
    scale = 0.25
    out, lse, dq, dk, dv, _ = merged_key_blocks(KERNEL, q, k, v, dout, ((0, 16), (16, 32)), softmax_scale=scale)
    ref = _reference(q, k, v, dout, softmax_scale=scale)
    _assert_close(out, ref[0], torch.float64, "merged out")
    _assert_close(lse, ref[1], torch.float64, "merged lse")
    _assert_close(dq, ref[2], torch.float64, "dq")
    _assert_close(dk, ref[3], torch.float64, "dk")
    _assert_close(dv, ref[4], torch.float64, "dv")


def test_softcap_and_dropout_are_refused_not_ignored():
    q, k, v, dout = _inputs(torch.float32, sq=8)
    with pytest.raises(NotImplementedError, match="softcap"):
        KERNEL.forward(q, k, v, KernelCall(scale=0.2, softcap=30.0))
    with pytest.raises(NotImplementedError, match="dropout"):
        KERNEL.forward(q, k, v, KernelCall(scale=0.2, dropout_p=0.1))
    out, lse = KERNEL.forward(q, k, v, KernelCall(scale=0.2))
    with pytest.raises(NotImplementedError, match="softcap"):
        KERNEL.backward(dout, q, k, v, out, lse, KernelCall(scale=0.2, softcap=30.0))
    req = AttnRequest(device_type="cpu")
    assert SDPABackend.not_supported_reasons(req.with_(softcap=30.0)) == ["softcap=30.0 not supported"]
    assert SDPABackend.not_supported_reasons(req.with_(dropout_p=0.1)) == ["dropout_p=0.1 not supported"]


def test_device_specific_declarations():
    req = AttnRequest(device_type="cuda", dtype=torch.float64)
    assert any("fp64 is only supported on cpu" in r for r in SDPABackend.not_supported_reasons(req))
    det = AttnRequest(device_type="cuda", dtype=torch.float16, deterministic=True, needs_grad=True)
    assert any("not deterministic" in r for r in SDPABackend.not_supported_reasons(det))
    cpu_det = AttnRequest(device_type="cpu", deterministic=True, needs_grad=True)
    assert SDPABackend.not_supported_reasons(cpu_det) == []


def test_backward_is_deterministic_on_cpu():
    q, k, v, dout = _inputs(torch.float32, sq=16)
    out, lse = KERNEL.forward(q, k, v, KernelCall(scale=0.2, causal=True))
    a = KERNEL.backward(dout, q, k, v, out, lse, KernelCall(scale=0.2, causal=True))
    b = KERNEL.backward(dout, q, k, v, out, lse, KernelCall(scale=0.2, causal=True))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- CUDA lse quirks
def test_normalize_cuda_lse_efficient_padding():
    """The efficient kernel allocates lse as [B, H, ceil(Sq/32)*32]; the tail is garbage."""
    b, h, sq = 2, 3, 40
    true = torch.randn(b, h, sq)
    padded = torch.cat([true, torch.full((b, h, 64 - sq), 123.0)], dim=-1)
    got = normalize_cuda_lse(padded, sq)
    assert got.shape == (b, h, sq) and torch.equal(got, true)
    exact = torch.randn(b, h, 64)                       # already a multiple of 32: untouched
    assert torch.equal(normalize_cuda_lse(exact, 64), exact)


def test_normalize_cuda_lse_cudnn_trailing_dim():
    """cuDNN returns [B, H, Sq, 1] on recent versions, [B, H, Sq] on older ones."""
    true = torch.randn(2, 3, 17)
    assert torch.equal(normalize_cuda_lse(true.unsqueeze(-1), 17), true)
    assert torch.equal(normalize_cuda_lse(true, 17), true)
