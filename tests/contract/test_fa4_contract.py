"""Contract tests for the FlashAttention-4 adapter (``usp_hal.backends.fa4``).

These prove the *adapter*, not the kernel: flash-attn-4 is replaced by a stand-in
(tests/contract/fa4_standin.py) under the real import path ``flash_attn.cute.interface``,
with the real distribution metadata, the signatures of ``_flash_attn_fwd``/``_flash_attn_bwd``
of 4.0.0b36 and their checks (dtypes, head dims per architecture, arch gates, lse layout
and natural log, bottom-right masks, window sides open only as ``None``), computing in
float64 on the CPU inside ``platform.emulate("cuda")``.  Results are compared with the
float64 reference of usp_hal.dispatch.reference, directly, packed, and through
``LongContextAttention`` on one process and on a 2-rank ring.  The real kernel has not run
here.
"""
from __future__ import annotations

import importlib

import pytest
import torch

import usp_hal
from tests.dist_cases import kernel_call, merged_key_blocks
from usp_hal import KernelCall
from usp_hal.backends.fa4 import FlashAttn4Backend
from usp_hal.dispatch import platform
from usp_hal.dispatch.backend import Refusal
from usp_hal.dispatch.capabilities import AttnRequest
from usp_hal.dispatch.reference import LSE_TOLERANCES, TOLERANCES, reference_attention
from usp_hal.parallel.ring import Packing

from . import fa4_standin
from .standin import install_standin, purge_modules

pytestmark = pytest.mark.contract
EMULATE = dict(device_type="cuda", compute_capability=(9, 0))
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# name -> (input shape kwargs, call kwargs)
CASES = {
    "gqa_causal": (dict(h=4, hkv=2), dict(causal=True)),
    "window": (dict(), dict(window=(3, 2))),
    "left_window_only": (dict(), dict(window=(4, -1))),
    "right_window_only": (dict(h=2, hkv=1), dict(window=(-1, 2))),
    "causal_window_softcap": (dict(), dict(causal=True, window=(4, -1), softcap=1.5)),
    "head_dim_20_padded": (dict(d=20), dict(causal=True)),
    "rect_causal": (dict(sq=20, sk=12), dict(causal=True)),
    "rect_window": (dict(sq=12, sk=20), dict(window=(4, 10))),
    "mla_192_128": (dict(h=2, hkv=1, d=192, dv=128, sq=9), dict(causal=True)),
    "mla_20_12_padded": (dict(d=20, dv=12), dict(causal=True, softcap=1.5)),
}


@pytest.fixture
def fa4(tmp_path, monkeypatch):
    install_standin(tmp_path, monkeypatch, dist=fa4_standin.DIST, version=fa4_standin.VERSION,
                    files=fa4_standin.files())
    yield FlashAttn4Backend()
    purge_modules(fa4_standin.TOP_LEVEL)


def _iface():
    return importlib.import_module("flash_attn.cute.interface")


def _inputs(dtype, b=2, sq=16, sk=None, h=4, hkv=None, d=32, seed=0, dv=None):
    sk = sq if sk is None else sk
    hkv = h if hkv is None else hkv
    dv = d if dv is None else dv
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g).to(dtype) for s in ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, dv),
                                                                  (b, sq, h, dv)))


def _reference(q, k, v, dout, **kw):
    qr, kr, vr = (x.to(torch.float64).requires_grad_() for x in (q, k, v))
    out, lse = reference_attention(qr, kr, vr, **kw)
    grads = torch.autograd.grad(out, (qr, kr, vr), dout.to(torch.float64))
    return (out.detach(), lse.detach()) + tuple(grads)


def _close(got, ref, dtype, what, lse=False):
    atol, rtol = (LSE_TOLERANCES if lse else TOLERANCES)[dtype]
    got = got.to(torch.float64)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), f"{what}: -inf rows differ"
    fin = torch.isfinite(ref)
    diff = (got[fin] - ref[fin]).abs()
    assert not torch.isnan(got).any(), f"{what}: NaN"
    assert bool((diff <= atol + rtol * ref[fin].abs()).all()), f"{what}: max error {diff.max():.3e}"


def _check(backend, dtype, shape, call):
    q, k, v, dout = _inputs(dtype, **shape)
    kw = dict(call)
    kw.setdefault("softmax_scale", q.shape[-1] ** -0.5)
    out, lse = backend.forward(q, k, v, kernel_call(**kw))
    assert out.shape == dout.shape and out.dtype == dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    ref = _reference(q, k, v, dout, **kw)
    _close(out, ref[0], dtype, "out")
    _close(lse, ref[1], dtype, "lse", lse=True)
    grads = backend.backward(dout, q, k, v, out, lse, kernel_call(**kw))
    for name, got, want, like in zip(("dq", "dk", "dv"), grads, ref[2:], (q, k, v)):
        assert got.shape == like.shape and got.dtype == dtype, name
        _close(got, want, dtype, name)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_contract_fa4_matches_reference(fa4, case, dtype):
    """contract: out, lse and dq/dk/dv through _flash_attn_fwd/_flash_attn_bwd match the float64 reference."""
    _check(fa4, DTYPES[dtype], *CASES[case])


def test_contract_fa4_open_window_sides_reach_the_kernel_as_none(fa4):
    """contract: FA4 reads -1 literally unless both sides are negative, so an open side must be None."""
    q, k, v, _ = _inputs(torch.float16, d=16)
    fa4.forward(q, k, v, KernelCall(scale=0.25, window=(3, -1)))
    fa4.forward(q, k, v, KernelCall(scale=0.25))
    calls = _iface().FWD_CALLS
    assert (calls[0]["window_size_left"], calls[0]["window_size_right"]) == (3, None)
    assert (calls[1]["window_size_left"], calls[1]["window_size_right"]) == (None, None)


def test_contract_fa4_ring_merged_out_lse_in_backward(fa4):
    """contract: backward given the merged (global) out/lse of two key blocks sums to the reference grads."""
    dtype = torch.bfloat16
    q, k, v, dout = _inputs(dtype, sk=24, h=4, hkv=2, d=40, seed=3)
    scale = 40 ** -0.5
    out, lse, dq, dk, dv, _ = merged_key_blocks(fa4, q, k, v, dout, ((0, 10), (10, 24)), softmax_scale=scale)
    ref = _reference(q, k, v, dout, softmax_scale=scale)
    _close(out, ref[0], dtype, "merged out")
    _close(lse, ref[1], dtype, "merged lse", lse=True)
    _close(dq, ref[2], dtype, "dq")
    _close(dk, ref[3], dtype, "dk")
    _close(dv, ref[4], dtype, "dv")


def test_contract_fa4_rows_without_keys(fa4):
    """contract: bottom-right causal with Sq > Sk leaves rows without keys: lse -inf, out 0, no gradient."""
    q, k, v, dout = _inputs(torch.float16, sq=8, sk=4, d=16)
    raw_out, raw_lse, *_ = _iface()._flash_attn_fwd(q, k, v, softmax_scale=0.25, causal=True, return_lse=True)
    assert torch.isneginf(raw_lse[..., :4]).all() and torch.isfinite(raw_lse[..., 4:]).all()
    out, lse = fa4.forward(q, k, v, KernelCall(scale=0.25, causal=True))   # the contract's causal is top-left
    assert torch.isfinite(lse).all()
    _check(fa4, torch.float16, dict(sq=8, sk=4, d=16), dict(causal=True))


def test_contract_fa4_packed_documents(fa4):
    """contract: the varlen path (cu_seqlens, lse [H, total_q]) forward and backward, per document."""
    dtype = torch.float16
    lens = [5, 9, 3]
    g = torch.Generator().manual_seed(2)
    total, h, hkv, d = sum(lens), 4, 2, 16
    q, dout = (torch.randn(total, h, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(total, hkv, d, generator=g).to(dtype) for _ in range(2))
    packing = Packing(lens, lens, q.device)
    out, lse = fa4.forward_packed(q, k, v, KernelCall(packing=packing, scale=0.25, causal=True))
    assert lse.shape == (h, total)
    dq, dk, dv = fa4.backward_packed(dout, q, k, v, out, lse, KernelCall(packing=packing, scale=0.25, causal=True))
    assert all(c["varlen"] for c in _iface().FWD_CALLS) and all(c["varlen"] for c in _iface().BWD_CALLS)
    a = 0
    for n in lens:
        s = slice(a, a + n)
        ref = _reference(q[None, s], k[None, s], v[None, s], dout[None, s], softmax_scale=0.25, causal=True)
        _close(out[s], ref[0][0], dtype, "out")
        _close(lse[:, s], ref[1][0], dtype, "lse", lse=True)
        for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:]):
            _close(got[s], want[0], dtype, name)
        a += n


def test_contract_fa4_deterministic_reaches_the_kernel(fa4):
    q, k, v, dout = _inputs(torch.float16, d=16)
    out, lse = fa4.forward(q, k, v, KernelCall(scale=0.25))
    fa4.backward(dout, q, k, v, out, lse, KernelCall(scale=0.25, deterministic=True))
    assert [c["deterministic"] for c in _iface().BWD_CALLS] == [True]


# --------------------------------------------------------------------------- declarations and refusals
def _req(**kw):
    base = dict(dtype=torch.bfloat16, device_type="cuda", head_dim=64, num_heads=4, num_kv_heads=2, causal=True,
                needs_lse=True, needs_grad=True, compute_capability=(9, 0))
    base.update(kw)
    return AttnRequest(**base)


@pytest.mark.parametrize("cc,extra,needle", [
    ((8, 0), {}, "9.x-12.x only"),
    ((10, 0), dict(head_dim=192), "8..128 or 256 on SM100"),
    ((12, 0), dict(deterministic=True), "deterministic backward on sm120"),
    ((12, 0), dict(softcap=2.0), "score_mod backward not supported"),
    ((12, 0), dict(head_dim=192, needs_grad=False), "SM120's shared memory"),
    ((13, 0), dict(needs_grad=False), "8.x-12.x"),
    ((9, 0), dict(mask=True), "'flex'"),
    ((9, 0), dict(alibi=True), "alibi"),
    ((9, 0), dict(dtype=torch.float32), "dtype=fp32"),
    ((10, 0), dict(head_dim=192, head_dim_v=96), "8..128 or (192, 128) on SM100"),
    ((10, 0), dict(head_dim=64, head_dim_v=192), "8..128 or (192, 128) on SM100"),
    ((9, 0), dict(head_dim=64, head_dim_v=512), "at most 256"),
    ((12, 0), dict(head_dim=64, head_dim_v=192, needs_grad=False), "SM120's shared memory"),
])
def test_contract_fa4_declares_what_the_source_gates(cc, extra, needle):
    why = FlashAttn4Backend.not_supported_reasons(_req(compute_capability=cc, **extra))
    assert any(needle in r for r in why), why


@pytest.mark.parametrize("cc,extra", [((9, 0), dict(head_dim=256)), ((10, 0), dict(head_dim=256)),
                                      ((10, 0), dict(head_dim=100)), ((12, 0), dict(head_dim=128)),
                                      ((8, 0), dict(needs_grad=False, softcap=1.0)), ((12, 0), {}),
                                      ((10, 0), dict(head_dim=192, head_dim_v=128)),
                                      ((10, 0), dict(head_dim=100, head_dim_v=60)),
                                      ((9, 0), dict(head_dim=192, head_dim_v=256))])
def test_contract_fa4_serves_what_the_source_allows(cc, extra):
    assert FlashAttn4Backend.not_supported_reasons(_req(compute_capability=cc, **extra)) == []


def test_contract_fa4_refused_call_never_reaches_the_kernel(fa4):
    q, k, v, dout = _inputs(torch.float16, d=16)
    with platform.emulate("cuda", compute_capability=(8, 0)):
        out, lse = fa4.forward(q, k, v, KernelCall(scale=0.25))
        with pytest.raises(Refusal, match="9.x-12.x only"):
            fa4.backward(dout, q, k, v, out, lse, KernelCall(scale=0.25))
    assert _iface().BWD_CALLS == []


def test_contract_fa4_availability(fa4, tmp_path, monkeypatch):
    assert FlashAttn4Backend.availability().ok
    purge_modules(fa4_standin.TOP_LEVEL)
    files = fa4_standin.files()
    del files["flash_attn/cute/interface.py"]
    install_standin(tmp_path / "broken", monkeypatch, dist=fa4_standin.DIST, version=fa4_standin.VERSION,
                    files=files)
    assert "interface.py is not found" in FlashAttn4Backend.availability().reason


def test_fa4_unavailable_without_the_package():
    av = FlashAttn4Backend.availability()
    assert not av.ok and "flash-attn-4 not installed" in av.reason
    assert "fa4" not in usp_hal.dispatch.registry.REGISTRY.alternatives(_req())   # never picked where it is absent


# --------------------------------------------------------------------------- through the USP core
def test_contract_fa4_through_long_context_attention_one_rank(fa4):
    """LongContextAttention(attn_type='fa4') on one process: out, lse and gradients vs the float64 reference."""
    dtype = torch.bfloat16
    q, k, v, dout = _inputs(dtype, b=1, sq=24, h=4, hkv=2, d=24, seed=5)
    ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = usp_hal.LongContextAttention(attn_type="fa4")(ql, kl, vl, causal=True, softcap=2.0,
                                                             return_lse=True)
    out.backward(dout)
    ref = _reference(q, k, v, dout, causal=True, softcap=2.0)
    _close(out.detach(), ref[0], dtype, "out")
    _close(lse.detach(), ref[1], dtype, "lse", lse=True)
    for name, got, want in zip(("dq", "dk", "dv"), (ql.grad, kl.grad, vl.grad), ref[2:]):
        _close(got, want, dtype, name)


@pytest.mark.multirank
def test_contract_fa4_ring2_through_long_context_attention(pools):
    """Ring-2 (zigzag, causal, GQA) on gloo ranks with the stand-in in each rank: forward, lse and gradients."""
    res = pools(2).run(fa4_standin.usp_case, timeout=120, U=1, R=2, dtype="bf16", grad=True, return_lse=True,
                       D=32, H=4, Hkv=2, S=24, B=2, causal=True, layout="zigzag")
    for errs in res:
        assert set(errs) >= {"out", "lse", "dq", "dk", "dv"}
        assert all(e <= 1.0 for e in errs.values()), errs
