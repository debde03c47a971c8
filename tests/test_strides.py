"""Inputs with any strides: every backend declares what its kernel takes (``INPUT_LAYOUT``)
and the base class copies only what the kernel cannot take as it is.

Regression for a silently wrong result: the CPU kernel reads a head dim with a non-unit
stride as if it were contiguous, so a query view ``buf[..., ::2]`` gave output errors of
0.5-0.7 through a ring of 2."""
from __future__ import annotations

import pytest
import torch

from tests.contract import usp_cases
from usp_hal import KernelCall
from usp_hal.backends.sdpa import SDPABackend
from usp_hal.dispatch.backend import INPUT_LAYOUTS, AttentionBackend
from usp_hal.dispatch.reference import TOLERANCES, reference_attention
from usp_hal.dispatch.registry import REGISTRY


def _check(errs):
    bad = {k: v for k, v in errs.items() if k != "unused_columns_grad" and not v <= 1.0}
    assert not bad, f"errors above tolerance (1.0 = limit): {bad} (all: {errs})"
    assert errs["unused_columns_grad"] == 0.0, errs


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_strided_query_through_a_ring_of_two(pools, dtype, causal):
    for errs in pools(2).run(usp_cases.strided_query_case, timeout=120, U=1, R=2, dtype=dtype, causal=causal):
        _check(errs)


@pytest.mark.multirank
@pytest.mark.parametrize("standin,emulate,attn_type", [
    ({"kind": "fa2", "arg": "2.8.3"}, dict(device_type="cuda", compute_capability=(9, 0)), "fa2"),
    ({"kind": "xpu"}, dict(device_type="xpu", device_model="intel_gpu_pvc", torch_version="2.13.0+xpu"), "xpu"),
], ids=["fa2-last-dim-contiguous", "xpu-contiguous"])
def test_strided_inputs_reach_kernels_in_the_layout_they_take(pools, standin, emulate, attn_type):
    for errs in pools(2).run(usp_cases.strided_query_case, timeout=120, U=1, R=2, dtype="fp16", causal=True,
                             attn_type=attn_type, standin=standin, emulate=emulate, D=32):
        _check(errs)


def test_strided_query_single_process():
    """The backend alone: a strided query gives the contiguous query's out and gradients."""
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(2, 12, 3, 16, generator=g)
    q = buf[..., ::2]
    k, v, dout = (torch.randn(2, 12, 3, 8, generator=g) for _ in range(3))
    backend = SDPABackend()
    out, lse = backend.forward(q, k, v, KernelCall(scale=0.3, causal=True))
    grads = backend.backward(dout[..., :], q, k.transpose(1, 2).contiguous().transpose(1, 2), v, out, lse,
                             KernelCall(scale=0.3, causal=True))
    qr, kr, vr = (x.double().requires_grad_() for x in (q.contiguous(), k, v))
    ro, rl = reference_attention(qr, kr, vr, softmax_scale=0.3, causal=True)
    ref_grads = torch.autograd.grad(ro, (qr, kr, vr), dout.double())
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out.double(), ro, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), rl, atol=atol, rtol=rtol)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


def test_every_backend_declares_its_layout_and_copies_only_when_needed():
    for name in REGISTRY.names():
        cls = REGISTRY.get(name)
        assert cls.INPUT_LAYOUT in INPUT_LAYOUTS, (name, cls.INPUT_LAYOUT)

    class Last(AttentionBackend):
        INPUT_LAYOUT = "last-dim-contiguous"

    class Full(AttentionBackend):
        INPUT_LAYOUT = "contiguous"

    base = torch.randn(4, 2, 3, 8)
    permuted = base.permute(1, 0, 2, 3)              # last dim contiguous, not contiguous
    strided = torch.randn(2, 4, 3, 16)[..., ::2]      # head dim stride 2
    (p,) = Last()._conform(permuted)
    assert p.data_ptr() == permuted.data_ptr()         # no copy
    (s,) = Last()._conform(strided)
    assert s.stride(-1) == 1 and torch.equal(s, strided)
    (f,) = Full()._conform(permuted)
    assert f.is_contiguous() and torch.equal(f, permuted)
    contiguous = torch.randn(2, 4, 3, 8)
    (c,) = Full()._conform(contiguous)
    assert c.data_ptr() == contiguous.data_ptr()
