"""Rank-side functions for the FP8 wire-format tests (tests/test_fp8.py)."""
from __future__ import annotations

import torch

import usp_hal
from tests.dist_cases import _err, get_mesh
from usp_hal.dispatch.reference import reference_attention
from usp_hal.harness import CommMeter
from usp_hal.parallel.codec import Float8Codec

FP8 = Float8Codec()


def rt(x: torch.Tensor) -> torch.Tensor:
    return FP8.roundtrip(x)


def _inputs(S, H, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, S, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv)] + \
        [torch.randn(1, S, H, D, generator=g).to(dtype)]


def fp8_emulation(U=2, R=1, layout="zigzag", causal=True, S=24, H=4, Hkv=2, D=16, key=False, ring=False,
                  grad=True):
    """The FP8 path equals attention on the round-tripped tensors, to fp32 tolerance:
    out = rt(attention(rt(q), k', rt(v))) with k' = rt(k) when key=True; with ring=True
    the ring's V blocks (and K with key=True) are round-tripped too.  With gradients: the
    straight-through gradient of that forward."""
    mesh = get_mesh(U, R)
    q, k, v, dout = _inputs(S, H, Hkv, D, torch.float32)
    uly = U > 1
    rq = rt(q) if uly else q
    rk = rt(k) if (key and (uly or (ring and R > 1))) else k
    rv = rt(v) if (uly or (ring and R > 1)) else v
    if ring and R > 1 and not uly:   # only the ring codes: K (with key) and V blocks
        rq = q
    leaves = [x.double().requires_grad_() for x in (rq, rk, rv)]
    ref, _ = reference_attention(*leaves, causal=causal)
    ref_out = rt(ref.float()) if uly else ref.float()
    if grad:
        ref.backward(dout.double())
    sh = lambda x: usp_hal.shard(x, layout=layout, mesh=mesh)  # noqa: E731
    loc = [sh(x).requires_grad_(grad) for x in (q, k, v)]
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type=layout, mesh=mesh, ulysses_float8=uly,
                                        float8_key=key, ring_float8=ring)
    out = attn(*loc, causal=causal)
    errs = {"out": _err(out, sh(ref_out), torch.float32)}
    if grad:
        out.backward(sh(dout))
        for n, t, r in zip(("dq", "dk", "dv"), loc, leaves):
            errs[n] = _err(t.grad, sh(r.grad), torch.float32)
    return errs


def fp8_accuracy(U=2, R=1, dtype="bf16", S=256, H=8, D=64, key=False, ring=False):
    """Error of the FP8 path against full precision: RMS(err)/RMS(ref) and max|err|/max|ref|."""
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    mesh = get_mesh(U, R)
    q, k, v, _ = _inputs(S, H, H, D, dt, seed=7)
    ref, _ = reference_attention(q.double(), k.double(), v.double(), causal=True)
    sh = lambda x: usp_hal.shard(x, layout="zigzag", mesh=mesh)  # noqa: E731
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type="zigzag", mesh=mesh,
                                        ulysses_float8=U > 1, float8_key=key, ring_float8=ring)
    out = usp_hal.unshard(attn(sh(q), sh(k), sh(v), causal=True), layout="zigzag", mesh=mesh).double()
    err = out - ref
    return {"rms": float(err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()),
            "max": float(err.abs().max() / ref.abs().max())}


def fp8_bytes(U=2, dtype="bf16", S=64, H=8, Hkv=8, D=64, fp8=True):
    """Bytes this rank sends in the forward's all-to-alls (and the share that is k)."""
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    mesh = get_mesh(U, 1)
    q, k, v, _ = _inputs(S, H, Hkv, D, dt)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh, ulysses_float8=fp8)
    sh = [usp_hal.shard(x, mesh=mesh) for x in (q, k, v)]
    with CommMeter(("all_to_all_single",)) as meter, torch.no_grad():
        attn(*sh)
    k_bytes = (U - 1) / U * sh[1].numel() * sh[1].element_size()
    return {"sent": meter.bytes["all_to_all_single"], "k": k_bytes, "calls": meter.calls["all_to_all_single"]}
