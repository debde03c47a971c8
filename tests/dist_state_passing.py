"""State passing (usp_hal.mixers.state_passing) on every rank of a WorkerPool, against float64
references of the whole sequence computed in each rank from the same seeded global inputs."""
from __future__ import annotations

import torch
import torch.distributed as dist

import usp_hal
from tests.dist_cases import get_mesh
from usp_hal.mixers import state_passing as sp

TOL = {"fp64": (1e-9, 1e-9), "fp32": (2e-4, 2e-4)}


def _docs_reference(fn, cu, S, *tensors):
    """``fn`` (a whole-sequence function of ``[B, T, ...]`` tensors) per document, concatenated."""
    cuts = list(cu) if cu else [0, S]
    return torch.cat([fn(*(t[:, a:b] for t in tensors)) for a, b in zip(cuts[:-1], cuts[1:])], dim=1)


def _worst(a, b, tol):
    atol, rtol = tol
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:          # a rank that holds no token
        return 0.0
    return float(((a.double() - b.double()).abs() / (atol + rtol * b.double().abs())).max())


def _errors(out, ref, loc: dict, ref_in: dict, sh, dtype: str) -> dict:
    """{name: worst error / tolerance} of this rank's output and of the gradients of its
    sharded inputs ``loc`` against the reference's (``sh`` shards a global tensor)."""
    tol = TOL[dtype]
    res = {"out": _worst(out, sh(ref.detach()), tol)}
    for n, t in loc.items():
        res["d" + n] = _worst(t.grad, sh(ref_in[n].grad), tol)
    return res


def _mutated(mutation):
    """Break one piece of the mechanism on purpose (the tests' mutants); returns an undo."""
    saved = {}

    def patch(name, fn):
        saved[name] = getattr(sp, name)
        setattr(sp, name, fn)
    if mutation == "drop_state":
        orig = sp._carry_in
        patch("_carry_in", lambda *a, **k: [None] * len(orig(*a, **k)))
    elif mutation == "ignore_documents":
        orig_p = sp.pieces
        patch("pieces", lambda mesh, seqlen, layout, cu_seqlens=None: [
            p if p.start == 0 else sp.Piece(p.rank, p.local, p.start, p.length, False)
            for p in orig_p(mesh, seqlen, layout, cu_seqlens)])

    def undo():
        for name, fn in saved.items():
            setattr(sp, name, fn)
    return undo


def case(op="gdn", U=1, R=2, layout="basic", S=26, dtype="fp64", cu=None, kernel="reference", mutation=None,
         seed=0):
    """Returns on every rank {name: worst error / tolerance} for the output and every gradient."""
    mesh = get_mesh(U, R)
    dt = {"fp64": torch.float64, "fp32": torch.float32}[dtype]
    g = torch.Generator().manual_seed(seed)
    B = 2
    if op == "gdn":
        Hk, Hv, dk, dv = 2, 4, 4, 6
        glob = {"q": torch.randn(B, S, Hk, dk, generator=g), "k": torch.randn(B, S, Hk, dk, generator=g),
                "v": torch.randn(B, S, Hv, dv, generator=g),
                "g": -torch.rand(B, S, Hv, generator=g) * 0.5, "beta": torch.rand(B, S, Hv, generator=g)}
        glob["k"] = torch.nn.functional.normalize(glob["k"], dim=-1)
        out_shape = (B, S, Hv, dv)
        shared: dict = {}
    else:
        H, G, N, P = 4, 2, 3, 5
        glob = {"x": torch.randn(B, S, H, P, generator=g), "dt": torch.rand(B, S, H, generator=g) * 0.5,
                "B": torch.randn(B, S, G, N, generator=g), "C": torch.randn(B, S, G, N, generator=g)}
        shared = {"A": -torch.rand(H, generator=g) - 0.1}
        out_shape = (B, S, H, P)
    dout = torch.randn(*out_shape, generator=g)

    # the float64 reference over the whole sequence, document by document
    ref_in = {n: t.double().requires_grad_() for n, t in {**glob, **shared}.items()}
    if op == "gdn":
        def whole(q, k, v, gg, beta):
            return sp.delta_rule_reference(q, k, v, gg, beta)[0]
        ref = _docs_reference(whole, cu, S, *(ref_in[n] for n in ("q", "k", "v", "g", "beta")))
    else:
        def whole(x, dtt, Bm, Cm):
            return sp.ssd_reference(x, dtt, ref_in["A"], Bm, Cm)[0]
        ref = _docs_reference(whole, cu, S, *(ref_in[n] for n in ("x", "dt", "B", "C")))
    ref.backward(dout.double())

    # this rank's shards and the distributed call
    def sh(t):
        return usp_hal.shard(t, layout=layout, mesh=mesh, cu_seqlens=cu)
    loc = {n: sh(t).to(dt).requires_grad_() for n, t in glob.items()}
    par = {n: t.to(dt).requires_grad_() for n, t in shared.items()}
    undo = _mutated(mutation) if mutation else (lambda: None)
    try:
        if op == "gdn":
            kern = None
            if kernel == "transformers":
                from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
                kern = torch_chunk_gated_delta_rule
            out = sp.gated_delta_rule(loc["q"], loc["k"], loc["v"], loc["g"], loc["beta"], mesh=mesh, layout=layout,
                                      cu_seqlens=cu, kernel=kern, **({"chunk_size": 4} if kern else {}))
        else:
            kern = sp.ssd_reference if kernel == "reference" else sp.ssd_chunked
            out = sp.ssd(loc["x"], loc["dt"], par["A"], loc["B"], loc["C"], mesh=mesh, layout=layout, cu_seqlens=cu,
                         kernel=kern)
        out.backward(sh(dout).to(dt))
    finally:
        undo()
    tol = TOL[dtype]
    res = _errors(out, ref, loc, ref_in, sh, dtype)
    for n, t in par.items():
        grad = t.grad.clone()
        dist.all_reduce(grad, group=mesh.sp_group)      # each rank holds its tokens' share
        res["d" + n] = _worst(grad, ref_in[n].grad, tol)
    return res


def bytes_sent(op="gdn", U=1, R=2, layout="zigzag", S=64):
    """What one state-passing call sends per rank, counted by wrapping the collectives."""
    from usp_hal.harness import CommMeter
    mesh = get_mesh(U, R)
    g = torch.Generator().manual_seed(0)
    B, H, dk, dv = 1, 4, 8, 8
    q, k = (usp_hal.shard(torch.randn(B, S, H, dk, generator=g), layout=layout, mesh=mesh) for _ in range(2))
    v = usp_hal.shard(torch.randn(B, S, H, dv, generator=g), layout=layout, mesh=mesh)
    gg = usp_hal.shard(-torch.rand(B, S, H, generator=g), layout=layout, mesh=mesh)
    beta = usp_hal.shard(torch.rand(B, S, H, generator=g), layout=layout, mesh=mesh)
    meter = CommMeter()
    with meter:
        sp.gated_delta_rule(q, k, v, gg, beta, mesh=mesh, layout=layout)
    return sum(meter.bytes.values())


def misfit(op="gdn", sizes=(9, 7), layout="basic"):
    """Every rank calls ``op`` with its tokens of ``sizes`` (per-rank lengths that are not the
    layout's for their sum); returns this rank's error text (or "no error" and the shape)."""
    mesh = get_mesh(1, len(sizes))
    n = sizes[mesh.sp_rank]
    g = torch.Generator().manual_seed(0)
    try:
        if op == "gdn":
            q = torch.randn(1, n, 2, 4, generator=g, dtype=torch.float64)
            out = sp.gated_delta_rule(q, q, torch.randn(1, n, 2, 3, generator=g, dtype=torch.float64),
                                      -torch.rand(1, n, 2, generator=g, dtype=torch.float64),
                                      torch.rand(1, n, 2, generator=g, dtype=torch.float64), mesh=mesh, layout=layout)
        else:
            from usp_hal.mixers.head_parallel import halo_causal_conv
            out = halo_causal_conv(torch.randn(1, n, 3, generator=g), torch.randn(3, 4, generator=g),
                                   mesh=mesh, layout=layout)
    except Exception as exc:        # noqa: BLE001 - the text is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return f"no error: {tuple(out.shape)}"
