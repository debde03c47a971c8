"""Rank functions for tests/test_trust.py: non-finite inputs, a second backward through one
call, grad modes interleaved on one module, two threads with their own modules and groups.
Every result is compared with the float64 single-process reference."""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

import usp_hal
from tests.dist_cases import DTYPES, _err, get_mesh
from usp_hal.dispatch.reference import reference_attention

S, H, D = 16, 2, 8


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, S, H, D, generator=g, dtype=torch.float64) for _ in range(4))
    return q, k, v, dout


def _reference(q, k, v, dout, causal):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = reference_attention(*leaves, causal=causal)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), lse.detach(), grads


def _case(U, R, layout, causal, seed):
    """``(mesh, sh, (q, k, v, dout), (out, lse, grads))``: the mesh, the shard function of the
    layout, global float64 inputs and their one-process reference."""
    mesh = get_mesh(U, R)
    q, k, v, dout = _inputs(seed)

    def sh(x):
        return usp_hal.shard(x, layout=layout, mesh=mesh)
    return mesh, sh, (q, k, v, dout), _reference(q, k, v, dout, causal)


def _visible(causal: bool) -> torch.Tensor:
    """``[S, S]``: query row m sees key n."""
    m = torch.arange(S).unsqueeze(1)
    n = torch.arange(S).unsqueeze(0)
    return n <= m if causal else torch.ones(S, S, dtype=torch.bool)


def nonfinite_case(U=1, R=2, layout="zigzag", rotation="p2p", causal=True, which="q", row=3,
                   value="nan", grad=True, dtype="fp32", with_lse=True):
    """One non-finite element of q, k or v (head 0, token ``row``), in ``dtype``.  Per row
    (per key for dk/dv), head 0: every entry that depends on the bad value is non-finite
    (never hidden); for the output of a bad q or k, exactly those rows are (and the lse
    rows of a bad q); a kernel may spread a bad v (or a bad value in a gradient) further
    within a block it computes, as it does on one device.  No other head is touched, and
    every entry finite in both equals the float64 reference's (computed from the same,
    rounded inputs).  ``with_lse=False``: the output alone is asked for (without gradients,
    the forward-only path, where one Ulysses rank folds the guard into the output).
    Returns {tensor: (ok, detail)}."""
    mesh = get_mesh(U, R)
    dt = DTYPES[dtype]
    q, k, v, dout = (x.to(dt) for x in _inputs(7))
    t = {"q": q, "k": k, "v": v}
    t[which][0, row, 0, 1] = float(value)
    ro, rl, rg = _reference(*(x.double() for x in (q, k, v, dout)), causal)
    vis = _visible(causal)
    # what depends on the bad element (head 0): query rows for out/dq, key rows for dk/dv
    rows = torch.arange(S) == row if which == "q" else vis[:, row]
    keys = vis[rows].any(0)              # keys seen by an affected row (their p, or ds, is not finite)
    need = {"out": rows, "dq": rows, "dk": keys, "dv": keys if which != "v" else torch.zeros(S, dtype=torch.bool)}

    def sh(x, seq_dim=1):
        return usp_hal.shard(x, layout=layout, mesh=mesh, seq_dim=seq_dim)

    loc = [sh(x).requires_grad_(grad) for x in (q, k, v)]
    attn = usp_hal.LongContextAttention(ring_impl_type=layout, attn_type="sdpa", mesh=mesh, rotation=rotation)
    out, lse = attn(*loc, causal=causal, return_lse=True) if with_lse else (attn(*loc, causal=causal), None)
    got = {"out": out.detach()}
    ref = {"out": ro}
    if grad:
        out.backward(sh(dout))
        got.update(dq=loc[0].grad, dk=loc[1].grad, dv=loc[2].grad)
        ref.update(dq=rg[0], dk=rg[1], dv=rg[2])
    res = {}
    for name, x in got.items():
        r = sh(ref[name])
        bad = ~torch.isfinite(x)[0, :, 0].all(-1)           # head 0, per row
        rbad = ~torch.isfinite(r)[0, :, 0].all(-1)
        must = sh(need[name].view(1, S), seq_dim=1)[0]
        other = ~torch.isfinite(x)[0, :, 1:].all(-1).all(-1)
        exact = name == "out" and which != "v"
        ok = bool(torch.equal(bad, must)) if exact else bool((bad | ~must).all())
        ok = ok and not bool(other.any())
        fin = torch.isfinite(x) & torch.isfinite(r)
        err = _err(x[fin], r[fin], dt) if fin.any() else 0.0
        res[name] = (ok and err <= 1, {"bad": bad.tolist(), "must": must.tolist(), "ref_bad": rbad.tolist(),
                                       "err": err})
    if which == "q" and lse is not None:      # lse: exactly that row (head 0) is non-finite
        lbad = ~torch.isfinite(lse[0, 0])
        must = sh(need["out"].view(1, S), seq_dim=1)[0]
        res["lse"] = (bool(torch.equal(lbad, must)), {"bad": lbad.tolist(), "must": must.tolist()})
    return res


def backward_twice(U=1, R=2, layout="zigzag", causal=True, mode="retain", low_memory=False):
    """Two backward passes through one call: ``retain`` (``backward(retain_graph=True)``
    twice: the leaves' gradients are twice the reference's) or ``grad``
    (``torch.autograd.grad`` twice, over q then over k and v: each the reference's).
    Returns {name: normalised error}."""
    mesh, sh, (q, k, v, dout), (ro, rl, rg) = _case(U, R, layout, causal, 11)

    loc = [sh(x).requires_grad_() for x in (q, k, v)]
    attn = usp_hal.LongContextAttention(ring_impl_type=layout, attn_type="sdpa", mesh=mesh, low_memory=low_memory)
    out = attn(*loc, causal=causal)
    errs = {"out": _err(out, sh(ro), torch.float64)}
    d = sh(dout)
    if mode == "retain":
        out.backward(d, retain_graph=True)
        out.backward(d)
        for name, x, r in zip(("dq", "dk", "dv"), loc, rg):
            errs[name] = _err(x.grad, 2 * sh(r), torch.float64)
    else:
        (gq,) = torch.autograd.grad(out, loc[0], d, retain_graph=True)
        gk, gv = torch.autograd.grad(out, loc[1:], d)
        for name, x, r in zip(("dq", "dk", "dv"), (gq, gk, gv), rg):
            errs[name] = _err(x, sh(r), torch.float64)
    return errs


def modified_after_forward(U=1, R=2, layout="zigzag", causal=True, which="q"):
    """``which`` (q, k, v or out) of one call modified in place between its forward and its
    backward.  Returns ``("raised", message)`` when the backward refused, else
    ``("grads", {name: error})``: the gradients against the reference of the values the
    forward used."""
    mesh, sh, (q, k, v, dout), (ro, rl, rg) = _case(U, R, layout, causal, 17)

    leaves = [sh(x).requires_grad_() for x in (q, k, v)]
    loc = [x * 1 for x in leaves]          # non-leaf inputs, as a model's projections are
    attn = usp_hal.LongContextAttention(ring_impl_type=layout, attn_type="sdpa", mesh=mesh)
    out = attn(*loc, causal=causal)
    target = out if which == "out" else loc["qkv".index(which)]
    with torch.no_grad():
        target.mul_(2)
    try:
        out.backward(sh(dout))
    except RuntimeError as e:
        return "raised", str(e)
    return "grads", {n: _err(x.grad, sh(r), torch.float64) for n, x, r in zip(("dq", "dk", "dv"), leaves, rg)}


def grad_modes(U=1, R=2, layout="zigzag", causal=True):
    """One module called under inference_mode, no_grad and with gradients, in turns; every
    result matches the reference (outputs, and gradients of the grad calls)."""
    mesh, sh, (q, k, v, dout), (ro, rl, rg) = _case(U, R, layout, causal, 13)

    attn = usp_hal.LongContextAttention(ring_impl_type=layout, attn_type="sdpa", mesh=mesh)
    errs = []
    for mode in ("grad", "inference", "inference", "no_grad", "grad", "inference", "grad", "no_grad", "inference"):
        loc = [sh(x) for x in (q, k, v)]
        if mode == "inference":
            with torch.inference_mode():
                out = attn(*loc, causal=causal)
            errs.append(_err(out, sh(ro), torch.float64))
        elif mode == "no_grad":
            with torch.no_grad():
                out = attn(*loc, causal=causal)
            errs.append(_err(out, sh(ro), torch.float64))
        else:
            loc = [x.requires_grad_() for x in loc]
            out = attn(*loc, causal=causal)
            out.backward(sh(dout))
            errs.append(max([_err(out, sh(ro), torch.float64)]
                            + [_err(x.grad, sh(r), torch.float64) for x, r in zip(loc, rg)]))
    return errs


def two_threads(calls=40):
    """Two threads on each rank, each with its own module on its own mesh (its own groups over
    the same ranks): steady calls of different shapes run concurrently; every result matches
    the reference, and a change on one rank is still refused on both ranks in that thread
    while the other thread goes on."""
    # (a timeout gives every group of a mesh its own process group; the world group is not shared)
    meshes = [usp_hal.init_sequence_parallel(1, dist.get_world_size(), set_default=False, timeout=60)
              for _ in range(2)]
    results: list = [None, None]
    barrier = threading.Barrier(2)

    def worker(i):
        try:
            mesh = meshes[i]
            g = torch.Generator().manual_seed(20 + i)
            s = S * (i + 1)
            q, k, v = (torch.randn(1, s, H, D, generator=g, dtype=torch.float64) for _ in range(3))
            ro, _ = reference_attention(q, k, v, causal=True)
            attn = usp_hal.LongContextAttention(ring_impl_type="zigzag", attn_type="sdpa", mesh=mesh)
            loc = [usp_hal.shard(x, layout="zigzag", mesh=mesh) for x in (q, k, v)]
            want = usp_hal.shard(ro, layout="zigzag", mesh=mesh)
            errs, refused = [], None
            barrier.wait()
            for j in range(calls):
                if i == 0 and j == calls // 2:
                    # one rank alone changes an option: refused on both ranks of this thread's group
                    try:
                        attn(*loc, causal=dist.get_rank() == 0)
                    except ValueError as exc:
                        refused = str(exc)
                    continue
                errs.append(_err(attn(*loc, causal=True), want, torch.float64))
            results[i] = {"errs": errs, "refused": refused}
        except Exception as exc:       # reported to the test, not swallowed
            results[i] = {"error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def nonfinite_sweep(U=1, R=2, layouts=("basic", "zigzag", "stripe"), rotations=("p2p", "allgather")):
    """:func:`nonfinite_case` over layouts, rotations, causal or not and which of q, k, v
    holds the NaN (and, forward only, an inf in q and a NaN in q without the lse); returns
    the failures and the count of non-finite rows the cases expected (so the test knows the
    check could fail)."""
    fails, expected = [], 0
    for layout in layouts:
        for rotation in (rotations if R > 1 else ("p2p",)):
            for causal in (True, False):
                for which, row, value, grad, lse in (("q", 3, "nan", True, True), ("q", 12, "nan", True, True),
                                                     ("k", 5, "nan", True, True), ("v", 9, "nan", True, True),
                                                     ("q", 10, "inf", False, True), ("q", 4, "nan", False, False)):
                    res = nonfinite_case(U=U, R=R, layout=layout, rotation=rotation, causal=causal, which=which,
                                         row=row, value=value, grad=grad, with_lse=lse)
                    expected += sum(sum(d["must"]) for _, d in res.values())
                    bad = {n: d for n, (ok, d) in res.items() if not ok}
                    if bad:
                        fails.append(((layout, rotation, causal, which, row, value), bad))
    return {"fails": fails, "expected": expected}
