"""Rank-side functions for the fault and odd-input tests (tests/test_reliability.py)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import usp_hal
from tests.dist_cases import _err, get_mesh
from usp_hal.dispatch.reference import reference_attention
from usp_hal.harness import CommMeter


def unshard_mismatch(U=2, R=1, what="heads"):
    """One rank's part has a different shape or dtype: every rank raises, the group survives."""
    mesh = get_mesh(U, R)
    x = torch.randn(1, 8, 2, 4, generator=torch.Generator().manual_seed(0))
    local = usp_hal.shard(x, mesh=mesh)
    if dist.get_rank() == 1:
        if what == "heads":
            local = torch.randn(1, local.shape[1], 3, 4)
        elif what == "dtype":
            local = local.double()
        elif what == "ndim":
            local = local[0]
        elif what == "length":
            local = local[:, :-2]   # 4 + 2 tokens: basic for S=6 is 3 + 3
    t0 = time.monotonic()
    try:
        usp_hal.unshard(local, mesh=mesh)
        err = None
    except ValueError as exc:
        err = str(exc)
    elapsed = time.monotonic() - t0
    # the group still works: a correct unshard afterwards
    back = usp_hal.unshard(usp_hal.shard(x, mesh=mesh), mesh=mesh)
    return {"error": err, "elapsed": elapsed, "after_ok": bool(torch.equal(back, x))}


def unshard_gradient(U=1, R=2, layout="zigzag", reduce_grad=False):
    """A loss on the gathered output trains the local parts: gradients equal single-process ones."""
    mesh = get_mesh(U, R)
    g = torch.Generator().manual_seed(5)
    S, H, D = 13, 3, 8
    q, k, v = (torch.randn(1, S, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    w = torch.randn(1, S, H, D, generator=g, dtype=torch.float64)
    # single process
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref, _ = reference_attention(qr, kr, vr, causal=True)
    loss_ref = (ref * w).sum() if not reduce_grad else (ref * w)[:, :7].sum() + (ref * w)[:, 7:].sum()
    loss_ref.backward()
    # distributed: shard, attention, unshard, the same loss on every rank
    ql, kl, vl = (usp_hal.shard(x, layout=layout, mesh=mesh).requires_grad_() for x in (q, k, v))
    out = usp_hal.LongContextAttention(ring_impl_type=layout, attn_type="sdpa", mesh=mesh)(ql, kl, vl, causal=True)
    full = usp_hal.unshard(out, layout=layout, mesh=mesh, reduce_grad=reduce_grad)
    if reduce_grad:   # each rank takes a different part of the loss; the sum over ranks is the loss
        r = mesh.sp_rank
        loss = (full * w)[:, :7].sum() if r == 0 else (full * w)[:, 7:].sum() if r == 1 else full.sum() * 0
    else:
        loss = (full * w).sum()
    loss.backward()
    sh = lambda t: usp_hal.shard(t, layout=layout, mesh=mesh)  # noqa: E731
    return {"out": _err(full, ref, torch.float64),
            **{n: _err(t.grad, sh(r.grad), torch.float64) for n, t, r in (("dq", ql, qr), ("dk", kl, kr),
                                                                            ("dv", vl, vr))}}


def local_positions_match(U=2, R=2, layout="zigzag", S=11):
    mesh = get_mesh(U, R)
    x = torch.arange(S).view(1, S)
    return bool(torch.equal(usp_hal.shard(x, layout=layout, mesh=mesh)[0], mesh.local_positions(S, layout)))


# ----------------------------------------------------------------------------- dying / skipping ranks
def fault_call(U=2, R=2, plan=None, mesh_timeout=None):
    """Every rank makes one good call, then ``plan`` ({rank: "exit" | "skip"}) makes ranks die
    inside the next call or skip it.  Survivors report how long they took to raise, and what."""
    import os

    plan = {int(k): v for k, v in (plan or {}).items()}
    mesh = usp_hal.init_sequence_parallel(U, R, set_default=False, timeout=mesh_timeout)
    g = torch.Generator().manual_seed(0)
    S, H, D = 32, 4, 8
    q, k, v = (usp_hal.shard(torch.randn(1, S, H, D, generator=g), layout="zigzag", mesh=mesh).requires_grad_()
               for _ in range(3))
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type="zigzag", mesh=mesh)
    attn(q, k, v, causal=True).sum().backward()              # the group works
    me = dist.get_rank()
    what = plan.get(me)
    if what == "skip":
        return {"skipped": True}
    if what == "exit":
        backend = attn.last_backend

        def die(*a, **kw):
            os._exit(3)
        backend.forward = die
    t0 = time.monotonic()
    try:
        attn(q, k, v, causal=True).sum().backward()          # forward and backward need every rank
        return {"error": None, "elapsed": time.monotonic() - t0}
    except Exception as exc:   # noqa: BLE001 - the point is what comes out
        return {"error": f"{type(exc).__name__}: {exc}", "elapsed": time.monotonic() - t0}


# ----------------------------------------------------------------------------- mismatches
def mesh_degree_mismatch():
    """Rank 0 asks for (2, 1), rank 1 for (1, 2): every rank raises, the group stays usable."""
    u, r = (2, 1) if dist.get_rank() == 0 else (1, 2)
    try:
        usp_hal.init_sequence_parallel(u, r, set_default=False)
        err = None
    except ValueError as exc:
        err = str(exc)
    x = torch.ones(2)
    dist.all_reduce(x)
    return {"error": err, "after_ok": x.tolist() == [2.0, 2.0]}


def alibi_values_differ(U=1, R=2):
    mesh = get_mesh(U, R)
    g = torch.Generator().manual_seed(0)
    S, H, D = 16, 2, 8
    q = usp_hal.shard(torch.randn(1, S, H, D, generator=g), layout="zigzag", mesh=mesh)
    slopes = torch.tensor([0.25, 0.5])
    if dist.get_rank() == 1:
        slopes = slopes * 4
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type="zigzag", mesh=mesh)
    try:
        attn(q, q, q, causal=True, alibi_slopes=slopes)
        return None
    except ValueError as exc:
        return str(exc)


def positions_check(U=1, R=2, given="basic"):
    """A zigzag module fed basic shards of the same lengths: with positions= it is refused."""
    mesh = get_mesh(U, R)
    S = 16
    x = torch.randn(1, S, 2, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    local = usp_hal.shard(x, layout=given, mesh=mesh)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type="zigzag", mesh=mesh)
    try:
        out = attn(local, local, local, causal=True, positions=mesh.local_positions(S, given))
    except ValueError as exc:
        return {"error": str(exc)}
    ref, _ = reference_attention(x, x, x, causal=True)
    return {"error": None, "err": _err(out, usp_hal.shard(ref, layout="zigzag", mesh=mesh), torch.float64)}


# ----------------------------------------------------------------------------- non-finite inputs
def nan_input(U=1, R=2, which="q", row=3, S=16, causal=True, layout="zigzag"):
    """A NaN in one element of q, k or v (head 0): the outputs that depend on it come out NaN
    (q: exactly that query row; k: exactly the rows that see that key; v: at least those,
    since kernels multiply masked zero probabilities by V as one device does), and every
    finite entry equals single-device attention of the inputs without the NaN."""
    mesh = get_mesh(U, R)
    g = torch.Generator().manual_seed(2)
    H, D = 2, 8
    t = {n: torch.randn(1, S, H, D, generator=g, dtype=torch.float64) for n in "qkv"}
    ref, rlse = reference_attention(t["q"], t["k"], t["v"], causal=causal)
    t[which][0, row, 0, 1] = float("nan")
    pos = torch.arange(S)
    if which == "q":
        rows = pos == row
    else:
        rows = (pos >= row) if causal else torch.ones(S, dtype=torch.bool)
    expect = torch.zeros(1, S, H, dtype=torch.bool)
    expect[0, :, 0] = rows
    sh = {n: usp_hal.shard(x, layout=layout, mesh=mesh) for n, x in t.items()}
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type=layout, mesh=mesh)
    out, lse = attn(sh["q"], sh["k"], sh["v"], causal=causal, return_lse=True)
    ro = usp_hal.shard(ref, layout=layout, mesh=mesh)
    ex = usp_hal.shard(expect, layout=layout, mesh=mesh)
    out_nan = out.isnan().any(-1)
    if which == "v":   # kernels multiply masked (zero) probabilities by V too, like one device does: NaN
        ok_out = bool((out_nan | ~ex).all())          # may spread further; it must never be hidden
        ex = out_nan
    else:
        ok_out = bool(torch.equal(out_nan, ex))
    ok_lse = True
    if which == "q":     # lse: NaN for that row; K/V NaN may or may not reach the lse (V does not)
        ok_lse = bool(torch.equal(lse.isnan(), ex.transpose(1, 2)))
    fin = ~ex
    err = _err(out[fin], ro[fin], torch.float64) if fin.any() else 0.0
    return {"same_nan": ok_out and ok_lse, "nan_rows": int(ex.sum()), "err": err}


# ----------------------------------------------------------------------------- the returned tensor
def inplace_on_output(U=2, R=1, layout="zigzag"):
    """``out.mul_(2)`` before backward: twice the gradients where the backward keeps its own
    head-layout output (Ulysses), else (one Ulysses rank: the backward reads the returned
    output, as torch's flash attention does) ``{"raised": message}`` from autograd's version check."""
    mesh = get_mesh(U, R)
    g = torch.Generator().manual_seed(4)
    S, H, D = 12, 2, 8
    x = [torch.randn(1, S, H, D, generator=g, dtype=torch.float64) for _ in range(3)]
    ref = [t.clone().requires_grad_() for t in x]
    ro, _ = reference_attention(*ref, causal=True)
    (2 * ro).sum().backward()
    loc = [usp_hal.shard(t, layout=layout, mesh=mesh).requires_grad_() for t in x]
    out = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type=layout, mesh=mesh)(*loc, causal=True)
    out.mul_(2)
    try:
        out.sum().backward()
    except RuntimeError as exc:
        return {"contiguous": out.is_contiguous(), "raised": str(exc)}
    return {"contiguous": out.is_contiguous(), "out": _err(out, 2 * usp_hal.shard(ro, layout=layout, mesh=mesh),
                                                           torch.float64),
            **{n: _err(t.grad, usp_hal.shard(r.grad, layout=layout, mesh=mesh), torch.float64)
               for n, t, r in zip(("dq", "dk", "dv"), loc, ref)}}


def block_refused_before_data(U=1, R=2):
    """A backend whose rules refuse some ring block shapes (here: alibi with Sq != Sk, as a
    bottom-right kernel declares) is refused on every rank before any data collective."""
    from usp_hal.backends.sdpa import SDPABackend
    from usp_hal.dispatch.capabilities import Positions

    class BottomRight(SDPABackend):
        NAME = "test_bottom_right"
        POSITIONS = Positions(alignment="bottom-right", alibi_any_lengths=False)

    if BottomRight.NAME not in usp_hal.list_backends():
        usp_hal.register_backend(BottomRight.NAME, BottomRight)
    mesh = get_mesh(U, R)
    x = usp_hal.shard(torch.randn(1, 14, 2, 8, generator=torch.Generator().manual_seed(0)), layout="zigzag",
                      mesh=mesh)
    with CommMeter(("all_to_all_single", "batch_isend_irecv")) as meter:
        try:
            attn = usp_hal.LongContextAttention(attn_type="test_bottom_right", ring_impl_type="zigzag", mesh=mesh)
            attn(x, x, x, causal=True, alibi_slopes=torch.tensor([0.5, 0.25]))
            return {"error": None, "counts": dict(meter.calls)}
        except ValueError as exc:
            return {"error": str(exc), "counts": dict(meter.calls)}


def repeat_then_change(U=1, R=2):
    """The agreement of a call seen before (one all-gather, one comparison) still sees what
    another rank changed: calls of one shape, then rank 1 alone changes an option (refused on
    both), its length (uneven lengths are allowed here: the new plan must be right), back."""
    mesh = get_mesh(U, R)
    rank = dist.get_rank()
    H, D = 4, 8
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)
    pipe = attn.pipeline

    def call(lengths, causal=(False, False)):
        g = torch.Generator().manual_seed(sum(lengths))
        S = sum(lengths)
        q, k, v = (torch.randn(1, S, H, D, generator=g, dtype=torch.float64) for _ in range(3))
        a = sum(lengths[:rank])
        mine = slice(a, a + lengths[rank])
        try:
            out = attn(q[:, mine], k[:, mine], v[:, mine], causal=causal[rank])
        except ValueError as exc:
            return {"error": str(exc)}
        ref, _ = reference_attention(q, k, v, causal=causal[rank])
        return {"error": None, "max_err": float((out - ref[:, mine]).abs().max()),
                "hit": any(r.hit for r in pipe.repeats.values())}

    steps = [call((8, 8)), call((8, 8)), call((8, 8)), call((8, 8), causal=(False, True)), call((8, 8)),
             call((8, 5)), call((8, 5)), call((8, 8))]
    # rows the metadata check accepts but the layout check refuses (uneven causal lengths),
    # twice: the second time is a repeat of rows whose checks failed, refused again on both
    both = (True, True)
    layout = [call((8, 8), both), call((8, 8), both), call((8, 5), both), call((8, 5), both), call((8, 8), both)]
    return {"steps": steps, "layout": layout}


def new_mesh_and_modes():
    """One module moved to another mesh of the same ranks (ring to Ulysses), then its
    ``check_ranks`` changed on every rank (``"off"``, ``"first_call"``, back): every call
    is the float64 reference's."""
    rank = dist.get_rank()
    ring, uly = get_mesh(1, 2), get_mesh(2, 1)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=ring)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 16, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ref, _ = reference_attention(q, k, v)
    mine = slice(8 * rank, 8 * rank + 8)
    errs = []
    for i, mesh in enumerate((ring, ring, uly, uly, uly, uly, ring, ring)):
        attn.mesh = mesh
        attn.check_ranks = {4: "off", 5: "first_call", 7: True}.get(i, attn.check_ranks)
        out = attn(q[:, mine], k[:, mine], v[:, mine])
        errs.append(float((out - ref[:, mine]).abs().max()))
    return {"errs": errs, "mode": attn.check_ranks}
