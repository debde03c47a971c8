"""What the interpreted rank processes run (see conftest.py): the real kernel package,
prepared by :func:`usp_hal.backends.interpret.prepare`, under the adapter's emulated device,
through the adapter alone or through ``usp_hal.LongContextAttention``, compared with the
float64 reference under the adapter's declared tolerances.  Every function returns plain
data: normalised errors (<= 1 passes) or the text of the error the call raised."""
from __future__ import annotations

import math

import torch

import usp_hal
from tests import dist_cases
from usp_hal import KernelCall
from usp_hal.backends import interpret
from usp_hal.dispatch import platform
from usp_hal.dispatch.reference import reference_attention, tolerance
from usp_hal.dispatch.registry import REGISTRY
from usp_hal.harness import compare
from usp_hal.harness.verify import tolerances_for

DTYPES = dist_cases.DTYPES


def _errors(backend, dt, pairs) -> dict:
    atol, rtol = tolerances_for(backend, dt)
    out = {}
    for name, got, ref in pairs:
        tol = tolerance(dt, lse=True) if name == "lse" else (atol, rtol)
        out[name] = compare(got, ref, *tol)["worst"]
    return out


def adapter_case(name: str, dtype: str, B=1, Sq=64, Sk=None, H=2, Hkv=None, D=64, causal=False, grad=False,
                 scale=None, alibi=False, deterministic=False, seed=0) -> dict:
    """The adapter's forward (and backward) on the real kernel vs float64 attention."""
    interpret.prepare(name)
    backend = REGISTRY.get(name)
    dt, Sk, Hkv = DTYPES[dtype], Sk or Sq, Hkv or H
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, H, D, generator=g).to(dt)
    k, v = (torch.randn(B, Sk, Hkv, D, generator=g).to(dt) for _ in range(2))
    dout = torch.randn(B, Sq, H, D, generator=g).to(dt)
    slopes = torch.rand(H, generator=g) * 0.5 if alibi else None
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    kw = dict(softmax_scale=scale, causal=causal, alibi_slopes=slopes)
    qr, kr, vr = (x.double().requires_grad_(grad) for x in (q, k, v))
    ro, rl = reference_attention(qr, kr, vr, **kw)
    with platform.emulate(**interpret.EMULATION[name]):
        kernel = backend()
        try:
            out, lse = kernel.forward(q, k, v, dist_cases.kernel_call(**kw))
            pairs = [("out", out, ro)] + ([("lse", lse, rl)] if backend.RETURNS_LSE and name != "sage_fp8" else [])
            if grad:
                rg = torch.autograd.grad(ro, (qr, kr, vr), dout.double())
                gq, gk, gv = kernel.backward(dout, q, k, v, out, lse,
                                             dist_cases.kernel_call(deterministic=deterministic, **kw))
                pairs += list(zip(("dq", "dk", "dv"), (gq, gk, gv), rg))
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
    return {"errors": _errors(backend, dt, pairs)}


def raw_sage_case(dtype: str = "fp16", S=100, H=2, D=64, causal=False, seed=0) -> dict:
    """The real ``sageattn`` itself (no adapter, no refusal): its error against float64, as the
    relative RMS error and in units of the adapter's declared tolerance."""
    interpret.prepare("sage_fp8")
    import sageattention
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, S, H, D, generator=g).to(dt) for _ in range(3))
    ro, _ = reference_attention(q.double(), k.double(), v.double(), softmax_scale=D ** -0.5, causal=causal)
    out = sageattention.sageattn(q, k.clone(), v, tensor_layout="NHD", is_causal=causal, sm_scale=D ** -0.5)
    res = compare(out, ro, *tolerances_for(REGISTRY.get("sage_fp8"), dt))
    return {"worst": res["worst"], "rms_rel": res["rms_rel"]}


def packed_case(dtype: str = "fp16", causal=False, H=2, Hkv=1, D=64, lens=((9, 9), (30, 17), (5, 12)), seed=0):
    """fa2's varlen entry points (the Triton AMD varlen kernels) vs float64 per-sequence attention."""
    from usp_hal.parallel.ring import Packing
    interpret.prepare("fa2")
    backend = REGISTRY.get("fa2")
    dt = DTYPES[dtype]
    lens = [(a, a if causal else b) for a, b in lens]
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(a for a, _ in lens), sum(b for _, b in lens)
    q = torch.randn(tq, H, D, generator=g).to(dt)
    k, v = (torch.randn(tk, Hkv, D, generator=g).to(dt) for _ in range(2))
    dout = torch.randn(tq, H, D, generator=g).to(dt)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    outs, lses, a, c = [], [], 0, 0
    for nq, nk in lens:
        o, lse = reference_attention(qr[None, a:a + nq], kr[None, c:c + nk], vr[None, c:c + nk],
                                     softmax_scale=D ** -0.5, causal=causal)
        outs.append(o[0])
        lses.append(lse[0])
        a, c = a + nq, c + nk
    ro, rl = torch.cat(outs), torch.cat(lses, dim=1)
    rg = torch.autograd.grad(ro, (qr, kr, vr), dout.double())
    with platform.emulate(**interpret.EMULATION["fa2"]):
        kernel = backend()
        packing = Packing([nq for nq, _ in lens], [nk for _, nk in lens], q.device)
        out, lse = kernel.forward_packed(q, k, v, KernelCall(packing=packing, scale=D ** -0.5, causal=causal))
        grads = kernel.backward_packed(dout, q, k, v, out, lse,
                                       KernelCall(packing=packing, scale=D ** -0.5, causal=causal))
    return {"errors": _errors(backend, dt, [("out", out, ro), ("lse", lse, rl)]
                              + list(zip(("dq", "dk", "dv"), grads, rg)))}


def usp_case(name: str, dtype: str, U=1, R=1, layout="basic", B=1, S=64, H=4, Hkv=None, D=64, causal=False,
             grad=False, return_lse=False, seed=0) -> dict:
    """Sharded ``LongContextAttention`` with ``attn_type=name`` on the real kernel vs the global
    float64 reference, on this rank's shard; or the error the call raised."""
    interpret.prepare(name)
    backend = REGISTRY.get(name)
    dt, Hkv = DTYPES[dtype], Hkv or H
    q, k, v, dout, _ = dist_cases.make_inputs(B, S, H, Hkv, D, dt, seed)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ro, rl = reference_attention(qr, kr, vr, causal=causal)
    rg = torch.autograd.grad(ro, (qr, kr, vr), dout.double()) if grad else None
    with platform.emulate(**interpret.EMULATION[name]):
        mesh = dist_cases.get_mesh(U, R)

        def sh(x, seq_dim=1):
            return usp_hal.shard(x, layout=layout, mesh=mesh, seq_dim=seq_dim)

        ql, kl, vl = (sh(x).requires_grad_(grad) for x in (q, k, v))
        attn = usp_hal.LongContextAttention(ring_impl_type=layout, attn_type=name, mesh=mesh)
        try:
            res = attn(ql, kl, vl, causal=causal, return_lse=return_lse)
            out, lse = res if return_lse else (res, None)
            pairs = [("out", out, sh(ro))] + ([("lse", lse, sh(rl, seq_dim=2))] if return_lse else [])
            if grad:
                out.backward(sh(dout))
                pairs += list(zip(("dq", "dk", "dv"), (ql.grad, kl.grad, vl.grad), (sh(r) for r in rg)))
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
    return {"errors": _errors(backend, dt, pairs)}
