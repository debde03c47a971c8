"""Rank functions for tests/test_users.py: what users of the integrations do next (mixed
precision, calls outside the group, gradient bookkeeping, sampling in generate()).  Each
builds its inputs from a seed on every rank and computes the single-process reference in the
same worker."""
from __future__ import annotations

import copy

import torch

import usp_hal
from tests.dist_cases import get_mesh
from tests.integration_cases import VOCAB, tiny_llama


def _max_diff(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


# ----------------------------------------------------------------------------- autocast
def autocast_core(U=1, R=2, B=1, S=24, H=4, D=16, seed=0):
    """q, k float32 and v bfloat16 (as after RoPE under autocast), attention under
    ``torch.autocast("cpu", bfloat16)``: sequence-parallel vs torch's SDPA in one process
    under the same autocast, and both vs float64."""
    mesh = get_mesh(U, R)
    g = torch.Generator().manual_seed(seed)
    q32, k32 = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, H, D, generator=g)
    v16 = torch.randn(B, S, H, D, generator=g).bfloat16()
    dout = torch.randn(B, S, H, D, generator=g)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type="zigzag", mesh=mesh)

    def sh(x):
        return usp_hal.shard(x, layout="zigzag", mesh=mesh).detach().requires_grad_()

    q, k, v = sh(q32), sh(k32), sh(v16)
    with torch.autocast("cpu", torch.bfloat16):
        out = attn(q, k, v, causal=True)
    out.float().backward(usp_hal.shard(dout, layout="zigzag", mesh=mesh))
    full = [usp_hal.unshard(t, layout="zigzag", mesh=mesh) for t in (out, q.grad, k.grad, v.grad)]
    res = {"dtypes": [str(t.dtype) for t in (out, q.grad, k.grad, v.grad)]}
    if mesh.sp_rank != 0:
        return res
    rq, rk, rv = (t.clone().requires_grad_() for t in (q32, k32, v16))
    with torch.autocast("cpu", torch.bfloat16):
        ref = torch.nn.functional.scaled_dot_product_attention(rq.transpose(1, 2), rk.transpose(1, 2),
                                                               rv.transpose(1, 2), is_causal=True).transpose(1, 2)
    ref.float().backward(dout)
    xq, xk, xv = (t.double().requires_grad_() for t in (q32.bfloat16(), k32.bfloat16(), v16))
    exact = torch.nn.functional.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2),
                                                             xv.transpose(1, 2), is_causal=True).transpose(1, 2)
    exact.backward(dout.double())
    res.update(ref_dtypes=[str(t.dtype) for t in (ref, rq.grad, rk.grad, rv.grad)],
               diffs=[_max_diff(a, b) for a, b in zip(full, (ref, rq.grad, rk.grad, rv.grad))],
               ref_vs_exact=[_max_diff(a, b) for a, b in zip((ref, rq.grad, rk.grad, rv.grad),
                                                            (exact, xq.grad, xk.grad, xv.grad))],
               sp_vs_exact=[_max_diff(a, b) for a, b in zip(full, (exact, xq.grad, xk.grad, xv.grad))])
    return res


def autocast_llama(U=1, R=2, steps=3, B=2, S=32, seed=0, lr=1e-3):
    """A custom training loop under ``torch.autocast("cpu", bfloat16)`` (tiny GQA Llama,
    AdamW): sequence-parallel vs one process under the same autocast; the one-process float32
    loop gives the size of bf16's own effect."""
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    name = usp.register(f"usp_hal_test_autocast_u{U}r{R}", mesh=mesh, attn_type="sdpa")
    base = tiny_llama(seed, num_hidden_layers=2)
    g = torch.Generator().manual_seed(seed + 7)
    data = [torch.randint(0, VOCAB, (B, S), generator=g) for _ in range(steps)]

    def run(model, sp: bool, autocast: bool):
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        losses, grads = [], None
        for ids in data:
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                if sp:
                    out = model(**usp.shard_batch({"input_ids": ids, "labels": ids}, mesh))
                else:
                    out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            loss = usp.sync_gradients(model, mesh, out.loss) if sp else out.loss.detach()
            losses.append(float(loss))
            if grads is None:
                grads = torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        return losses, grads

    model = copy.deepcopy(base)
    model.set_attn_implementation(name)
    losses, grads = run(model, True, True)
    res = {"losses": losses}
    if mesh.sp_rank != 0:
        return res
    ref_losses, ref_grads = run(copy.deepcopy(base), False, True)
    fp32_losses, fp32_grads = run(copy.deepcopy(base), False, False)
    res.update(ref_losses=ref_losses, fp32_losses=fp32_losses,
               grad_rel=float((grads - ref_grads).norm() / ref_grads.norm()),
               bf16_effect=float((fp32_grads - ref_grads).norm() / ref_grads.norm()))
    return res
