"""Rank-side functions for the torch.compile tests (tests/test_compile.py)."""
from __future__ import annotations

import torch

import usp_hal
from tests.dist_cases import _err, error_of, get_mesh, make_inputs
from usp_hal.dispatch.reference import reference_attention


class Block(torch.nn.Module):
    """qkv projection -> USP attention -> output projection, as a model layer would."""

    def __init__(self, attn, E=32, H=4, Hkv=2, D=8, packed=False, head_major=False):
        super().__init__()
        self.head_major = head_major
        g = torch.Generator().manual_seed(5)
        self.H, self.Hkv, self.D, self.packed = H, Hkv, D, packed
        self.qkv = torch.nn.Linear(E, (H + 2 * Hkv) * D, bias=False)
        self.proj = torch.nn.Linear(H * D, E, bias=False)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.randn(self.qkv.weight.shape, generator=g) * 0.2)
            self.proj.weight.copy_(torch.randn(self.proj.weight.shape, generator=g) * 0.2)
        self.attn = attn

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x)
        if self.packed:
            out = self.attn(qkv.view(b, s, 3, self.H, self.D), causal=True)
        else:
            q, k, v = qkv.split([self.H * self.D, self.Hkv * self.D, self.Hkv * self.D], dim=-1)
            q, k, v = q.view(b, s, self.H, self.D), k.view(b, s, self.Hkv, self.D), v.view(b, s, self.Hkv, self.D)
            if self.head_major:     # [B, H, S, D] memory seen as [B, S, H, D], as transformers hands attention
                q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
            out = self.attn(q, k, v, causal=True)
        return self.proj(out.reshape(b, s, -1))


def compile_case(U=2, R=1, layout="zigzag", packed=False, backend="aot_eager", module="sync", S=24, head_major=False):
    """Graph breaks under torch._dynamo.explain, and compiled vs eager output and gradients."""
    torch._dynamo.reset()
    mesh = get_mesh(U, R)
    kw = dict(attn_type="sdpa", ring_impl_type=layout, mesh=mesh)
    if packed:
        attn = usp_hal.LongContextAttentionQKVPacked(**kw)
    elif module == "async":
        attn = usp_hal.AsyncLongContextAttention(head_chunks=2, **kw)
    else:
        attn = usp_hal.LongContextAttention(**kw)
    H = Hkv = 4 if packed else None
    block = Block(attn, H=H or 4, Hkv=Hkv or 2, packed=packed, head_major=head_major).double()
    g = torch.Generator().manual_seed(9)
    x = usp_hal.shard(torch.randn(1, S, 32, generator=g, dtype=torch.float64), layout=layout, mesh=mesh)
    x.requires_grad_()
    ref = block(x)
    ref_g = torch.autograd.grad(ref.sum(), [x] + list(block.parameters()))
    explain = torch._dynamo.explain(block)(x)
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    out = compiled(x)
    got = torch.autograd.grad(out.sum(), [x] + list(compiled.parameters()))
    with torch.no_grad():
        inf = compiled(x)
    errs = {"out": _err(out, ref, torch.float64), "no_grad_out": _err(inf, ref, torch.float64)}
    for i, (a, b) in enumerate(zip(got, ref_g)):
        errs[f"g{i}"] = _err(a, b, torch.float64)
    return {"breaks": explain.graph_break_count, "reasons": [str(r.reason) for r in explain.break_reasons],
            "graphs": explain.graph_count, "errs": errs}


def compile_cu_seqlens_refused(U=2, R=1):
    """Packed documents under torch.compile(fullgraph=True) fail with the library's reason,
    not a wrong graph; without fullgraph, Dynamo falls back to eager, which handles them."""
    mesh = get_mesh(U, R)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)
    x = torch.randn(1, 4, 2, 8)
    cu = [0, 3, 8]

    def f(t):
        return attn(t, t, t, cu_seqlens=cu)
    try:
        torch.compile(f, backend="eager", fullgraph=True)(x)
    except Exception as exc:          # Dynamo wraps what the traced code raised
        msg = str(exc)
    else:
        msg = ""
    torch._dynamo.reset()
    eager = f(x)
    fallback = torch.compile(f, backend="eager")(x)
    torch._dynamo.reset()
    return {"msg": msg, "fallback_err": float((fallback - eager).abs().max())}


def compile_lse_gradient_case(U=2, R=1, backend="aot_eager", layout="zigzag", S=16, H=4, D=8):
    """``return_lse=True`` under torch.compile: a loss that uses the lse gets eager's refusal on
    every rank (the backward carries the output's gradient only), raised before the backward's
    collectives, so the ranks go on; with the lse unused or detached the output, the lse and
    the gradients equal float64 attention's."""
    torch._dynamo.reset()
    mesh = get_mesh(U, R)
    dt = torch.float64
    q, k, v, dout, _ = make_inputs(1, S, H, H, D, dt, 3)
    wl = torch.randn(1, H, S, generator=torch.Generator().manual_seed(4), dtype=dt)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ro, rl = reference_attention(qr, kr, vr, causal=True)
    rg = torch.autograd.grad(ro, (qr, kr, vr), dout)     # the loss's gradient without the lse's part

    def sh(x, seq_dim=1):
        return usp_hal.shard(x, layout=layout, mesh=mesh, seq_dim=seq_dim)

    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type=layout, mesh=mesh)
    compiled = torch.compile(lambda a, b, c: attn(a, b, c, causal=True, return_lse=True), fullgraph=True,
                             backend=backend)
    res = {}
    for use in ("lse", "detached", "unused"):
        ql, kl, vl = (sh(x).requires_grad_() for x in (q, k, v))
        out, lse = compiled(ql, kl, vl)
        loss = (out * sh(dout)).sum()
        if use != "unused":
            loss = loss + ((lse if use == "lse" else lse.detach()) * sh(wl, 2)).sum()
        res[use] = error_of(loss.backward)
        if use != "lse":
            res[f"{use}_errs"] = {"out": _err(out, sh(ro), dt), "lse": _err(lse, sh(rl, 2), dt, lse=True),
                                  **{n: _err(g, sh(r), dt) for n, g, r in zip(("dq", "dk", "dv"),
                                                                            (ql.grad, kl.grad, vl.grad), rg)}}
    return res
