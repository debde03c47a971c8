"""mask= and sinks= cases that run on every rank of a WorkerPool (tests/mp.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import usp_hal
from tests.dist_cases import DTYPES, _err, get_mesh, make_inputs
from usp_hal.backends.sdpa import SDPABackend
from usp_hal.dispatch.reference import reference_attention
from usp_hal.sequence import masks as M


class MaskCountingSDPA(SDPABackend):
    """SDPA that records every kernel call: (forward or backward, Sq, Sk, with a mask)."""

    NAME = "test_mask_counting_sdpa"
    calls: list = []

    def forward(self, q, k, v, call):
        type(self).calls.append(("fwd", q.shape[1], k.shape[1], call.mask is not None))
        return super().forward(q, k, v, call)

    def backward(self, dout, q, k, v, out, lse, call):
        type(self).calls.append(("bwd", q.shape[1], k.shape[1], call.mask is not None))
        return super().backward(dout, q, k, v, out, lse, call)


def _lossy(a, b, dtype, lse=False):
    from usp_hal.dispatch.reference import tolerance
    from usp_hal.harness.verify import compare
    return compare(a, b, *tolerance(dtype, lse=lse), lossy=True)["worst"]


def _register():
    if MaskCountingSDPA.NAME not in usp_hal.list_backends():
        usp_hal.register_backend(MaskCountingSDPA.NAME, MaskCountingSDPA)


def family(name: str, S: int, B: int = 1, H: int = 4):
    """A mask of each family the issue names, for a global length S (None: no mask)."""
    if name is None:
        return None
    if name == "prefix_lm":
        return M.prefix_lm(S // 3)
    if name == "block_causal":
        return M.block_causal(max(1, S // 5))
    if name == "chunked_local":
        return M.chunked_local(max(1, S // 3))
    if name == "block_sparse":
        return M.random_block_sparse(S, 4, 0.35, seed=S)
    if name == "slices":       # Magi-style: every kind, overlapping none
        a, b = S // 4, S // 2
        return M.Mask.from_slices([((0, a), (0, a), "full"), ((a, b), (0, b), "causal"),
                                   ((b, S), (a, S), "inv_causal"), ((b, S), (0, a), "bi_causal")])
    if name == "per_batch":    # a different prefix per batch row
        prefixes = torch.tensor([S // 4, S // 2, 1][:B])

        def per_batch_prefix(b, h, q, kv):
            return (kv < prefixes[b]) | (kv <= q)
        return M.Mask.from_mod(per_batch_prefix, batch=B)
    if name == "per_head":     # every head a different window
        def per_head_window(b, h, q, kv):
            return (kv <= q) & (kv >= q - 2 - 3 * h)
        return M.Mask.from_mod(per_head_window, heads=H)
    if name == "prefix_half":
        return M.prefix_lm(S // 2)
    if name == "chunked_half":
        return M.chunked_local(S // 2)
    if name == "empty_rows":   # rows [S/3, S/2) see nothing
        a, b = S // 3, S // 2
        return M.Mask.from_slices([((0, a), (0, S), "full"), ((b, S), (0, S), "causal")])
    raise KeyError(name)


def _reference_keep(mask: M.Mask, S: int, B: int, H: int, causal: bool, cu) -> torch.Tensor:
    """The dense [B|1, H|1, S, S] mask of the whole call, written out directly (not through
    the core's predicate): the user's mask, causal, and same-document."""
    pos = torch.arange(S)
    keep = mask.keep(pos, pos, B) if mask is not None else torch.ones(1, 1, S, S, dtype=torch.bool)
    q, k = pos.view(-1, 1), pos.view(1, -1)
    if causal:
        keep = keep & (k <= q)
    if cu is not None:
        doc = torch.zeros(S, dtype=torch.long)
        for i in range(1, len(cu) - 1):
            doc[cu[i]:] += 1
        keep = keep & (doc.view(-1, 1) == doc.view(1, -1))
    return keep


def mask_case(U=1, R=1, low=True, layout="basic", fam="prefix_lm", causal=False, dtype="fp64", B=1, S=40, H=4,
              Hkv=None, D=8, sinks=False, docs=None, grad=True, seed=0, attn_type="sdpa", softcap=0.0,
              alibi=False, module="plain", balanced=False, fp8=False, Dv=None):
    """One masked USP call against float64 attention with the mask applied densely: output,
    lse and gradients on this rank's part (the sinks' gradient summed over the group).
    Returns {name: normalised error} (<= 1 passes) and the kernel-call record."""
    _register()
    mesh = get_mesh(U, R, low)
    dt = DTYPES[dtype]
    Hkv = Hkv or H
    cu = None
    if docs is not None:
        cu = [0]
        for n in docs:
            cu.append(cu[-1] + n)
        S = cu[-1]
    mask = family(fam, S, B, H)
    if balanced:
        layout = M.balanced_layout(mask, S, R, causal=causal, cu_seqlens=cu).name
    kw_mod = dict(ring_impl_type=layout, attn_type=attn_type, mesh=mesh)
    if fp8:                # the lossy wire: compared as RMS error against the budget, like every fp8 case
        kw_mod.update(ulysses_float8=True, ring_float8=True)
    if module == "async":
        attn = usp_hal.AsyncLongContextAttention(head_chunks=2, **kw_mod)
    else:
        attn = usp_hal.LongContextAttention(low_memory=module == "low_memory", **kw_mod)
    q, k, v, dout, slopes = make_inputs(B, S, H, Hkv, D, dt, seed, alibi, Dv=Dv)
    g = torch.Generator().manual_seed(seed + 99)
    sink = (torch.randn(H, generator=g) * 2).to(dt) if sinks else None
    keep = _reference_keep(mask, S, B, H, causal, cu)
    qr, kr, vr = (x.to(torch.float64, copy=True).requires_grad_() for x in (q, k, v))
    sr = sink.to(torch.float64, copy=True).requires_grad_() if sinks else None
    ro, rl = reference_attention(qr, kr, vr, mask=keep, sinks=sr, softcap=softcap, alibi_slopes=slopes)
    ref_in = (qr, kr, vr) + ((sr,) if sinks else ())
    rg = torch.autograd.grad(ro, ref_in, dout.double()) if grad else None

    def sh(x, seq_dim=1):
        return usp_hal.shard(x, layout=layout, mesh=mesh, seq_dim=seq_dim, cu_seqlens=cu)

    ql, kl, vl = (sh(x).detach().requires_grad_(grad) for x in (q, k, v))
    sl = sink.clone().requires_grad_(grad) if sinks else None
    MaskCountingSDPA.calls = []
    out, lse = attn(ql, kl, vl, causal=causal, mask=mask, sinks=sl, return_lse=True, cu_seqlens=cu,
                    softcap=softcap, alibi_slopes=slopes)
    fwd_calls = list(MaskCountingSDPA.calls)
    err = _lossy if fp8 else _err
    errs = {"out": err(out, sh(ro), dt), "lse": err(lse, sh(rl, seq_dim=2), dt, lse=True)}
    errs["finite"] = 0.0 if bool(torch.isfinite(out).all()) else float("inf")
    if grad:
        assert rg is not None
        out.backward(sh(dout))
        for name, t, r in zip(("dq", "dk", "dv"), (ql.grad, kl.grad, vl.grad), rg[:3]):
            errs[name] = err(t, sh(r), dt)
            errs[name + "_finite"] = 0.0 if bool(torch.isfinite(t).all()) else float("inf")
        if sinks:
            assert sl is not None and sl.grad is not None
            total = sl.grad.detach().to(torch.float64).clone()
            dist.all_reduce(total, group=mesh.sp_group)
            errs["dsinks"] = err(total, rg[3], dt)
    return {"errs": errs, "calls": fwd_calls, "all_calls": list(MaskCountingSDPA.calls)}


def plan_case(U=1, R=2, layout="basic", fam="prefix_lm", S=64, causal=False):
    """The kernel calls of rank's forward under a masked plan, and whether K/V travelled."""
    from usp_hal.harness import CommMeter
    _register()
    mesh = get_mesh(U, R, True)
    mask = family(fam, S)
    attn = usp_hal.LongContextAttention(ring_impl_type=layout, attn_type=MaskCountingSDPA.NAME, mesh=mesh)
    q, k, v, _, _ = make_inputs(1, S, 4, 4, 8, torch.float32, 0)
    ql, kl, vl = (usp_hal.shard(x, layout=layout, mesh=mesh) for x in (q, k, v))
    attn(ql, kl, vl, causal=causal, mask=mask)      # plan once
    MaskCountingSDPA.calls = []
    with CommMeter() as meter:
        attn(ql, kl, vl, causal=causal, mask=mask)
    return {"calls": list(MaskCountingSDPA.calls), "bytes": dict(meter.bytes)}


def refusal_case(what: str):
    """A masked call that cannot run: the error on this rank (every rank must raise)."""
    mesh = get_mesh(1, 2, True)
    S = 16
    q, k, v, _, _ = make_inputs(1, S, 4, 4, 8, torch.float32, 0)
    kw: dict = {}
    layout = "basic"
    if what == "stripe":
        layout = "stripe"
        kw["mask"] = M.prefix_lm(4)
    elif what == "mismatch":
        kw["mask"] = M.prefix_lm(4 if mesh.sp_rank == 0 else 5)
    elif what == "sinks_shape":
        kw["sinks"] = torch.zeros(3)
        kw["mask"] = None
    attn = usp_hal.LongContextAttention(ring_impl_type=layout, attn_type="sdpa", mesh=mesh)
    ql, kl, vl = (usp_hal.shard(x, layout=layout, mesh=mesh) for x in (q, k, v))
    attn(ql, kl, vl, **kw)
    return "ran"


def compile_case(U=2, R=1, layout="zigzag", S=24, backend="aot_eager"):
    """mask= and learnable sinks under torch.compile(fullgraph=True): no graph break, and
    output and gradients (the sinks' included) equal eager mode."""
    torch._dynamo.reset()
    mesh = get_mesh(U, R)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type=layout, mesh=mesh)
    mask = M.block_causal(5)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(3)
            self.proj = torch.nn.Linear(16, 3 * 4 * 8, bias=False)
            with torch.no_grad():
                self.proj.weight.copy_(torch.randn(self.proj.weight.shape, generator=g) * 0.3)
            self.sinks = torch.nn.Parameter(torch.randn(4, generator=g))

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.proj(x).view(b, s, 3, 4, 8).unbind(2)
            return attn(q, k, v, mask=mask, sinks=self.sinks).sum(-1)

    layer = Layer().double()
    g = torch.Generator().manual_seed(4)
    x = usp_hal.shard(torch.randn(1, S, 16, generator=g, dtype=torch.float64), layout=layout, mesh=mesh)
    ref = layer(x)
    ref_g = torch.autograd.grad(ref.sum(), list(layer.parameters()))
    explain = torch._dynamo.explain(layer)(x)
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    out = compiled(x)
    got = torch.autograd.grad(out.sum(), list(compiled.parameters()))
    errs = {"out": _err(out, ref, torch.float64)}
    for i, (a, b) in enumerate(zip(got, ref_g)):
        errs[f"grad{i}"] = _err(a, b, torch.float64)
    return {"errs": errs, "breaks": explain.graph_break_count}
