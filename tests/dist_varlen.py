"""Packed-sequence (cu_seqlens) functions that run on every rank of a WorkerPool (tests/mp.py)."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

import usp_hal
from tests.dist_cases import DTYPES, _err, get_mesh, make_inputs, sharded_errors
from usp_hal.backends.sdpa import SDPABackend
from usp_hal.dispatch.reference import reference_packed_attention
from usp_hal.harness import CommMeter
from usp_hal.sequence.positions import cu_seqlens_from_lengths, layout_names


class CountingSDPA(SDPABackend):
    """SDPA that counts its calls and the query-key pairs it scores (per batch row, summed
    over heads), so tests can prove that invisible pairs cost no kernel time."""

    NAME = "test_counting_sdpa"
    counts = {"fwd_calls": 0, "bwd_calls": 0, "fwd_pairs": 0, "bwd_pairs": 0, "max_rows": 0}

    @staticmethod
    def _pairs(q, k, causal):
        sq, sk, h = q.shape[1], k.shape[1], q.shape[2]
        return h * (sq * (sq + 1) // 2 if causal else sq * sk)

    def forward(self, q, k, v, call):
        c = type(self).counts
        c["fwd_calls"] += 1
        c["fwd_pairs"] += self._pairs(q, k, call.causal)
        return super().forward(q, k, v, call)

    def backward(self, dout, q, k, v, out, lse, call):
        c = type(self).counts
        c["bwd_calls"] += 1
        c["bwd_pairs"] += self._pairs(q, k, call.causal)
        return super().backward(dout, q, k, v, out, lse, call)


class NoVarlenSDPA(SDPABackend):
    NAME = "test_no_varlen"
    SUPPORTS_VARLEN = False


def _register():
    for cls in (CountingSDPA, NoVarlenSDPA):
        if cls.NAME not in usp_hal.list_backends():
            usp_hal.register_backend(cls.NAME, cls)


def packed_case(U=1, R=1, low=True, layout="basic", rotation="p2p", causal=True, dtype="fp64", B=1, H=4, Hkv=None,
                D=8, window=(-1, -1), softcap=0.0, alibi=False, grad=True, return_lse=True, seed=0,
                attn_type="sdpa", docs=((5, 7),), module="plain", cu_as="tensor", head_chunks=2, Dv=None):
    """For every document-length list in ``docs``: a packed USP call (sharded with
    ``cu_seqlens``) against float64 single-process attention of each document alone, output,
    lse and gradients on this rank's part.  Returns one {name: normalised error} per list
    (<= 1 passes)."""
    _register()
    mesh = get_mesh(U, R, low)
    dt = DTYPES[dtype]
    Hkv = Hkv or H
    kw_mod = dict(ring_impl_type=layout, attn_type=attn_type, mesh=mesh, rotation=rotation)
    if module == "async":
        attn = usp_hal.AsyncLongContextAttention(head_chunks=head_chunks, **kw_mod)
    elif module == "qkvpacked":
        attn = usp_hal.LongContextAttentionQKVPacked(**kw_mod)
    else:
        attn = usp_hal.LongContextAttention(**kw_mod)
    results = []
    for i, lengths in enumerate(docs):
        cu = cu_seqlens_from_lengths(lengths)
        S = cu[-1]
        cu_arg = torch.tensor(cu, dtype=torch.int32) if cu_as == "tensor" else list(cu)
        q, k, v, dout, slopes = make_inputs(B, S, H, Hkv, D, dt, seed + i, alibi, Dv=Dv)
        qr, kr, vr = (x.to(torch.float64, copy=True).requires_grad_() for x in (q, k, v))
        kw = dict(causal=causal, window=tuple(window), softcap=softcap, alibi_slopes=slopes)
        ro, rl = reference_packed_attention(qr, kr, vr, cu, **kw)
        rg = torch.autograd.grad(ro, (qr, kr, vr), dout.double()) if grad else None

        def sh(x, seq_dim=1):
            return usp_hal.shard(x, layout=layout, mesh=mesh, seq_dim=seq_dim, cu_seqlens=cu_arg)  # noqa: B023

        ql, kl, vl = (sh(x).requires_grad_(grad) for x in (q, k, v))
        call = dict(causal=causal, window_size=tuple(window), softcap=softcap, alibi_slopes=slopes,
                    return_lse=return_lse, cu_seqlens=cu_arg)
        if module == "qkvpacked":
            if Hkv != H:
                raise ValueError("qkvpacked needs H == Hkv")
            qkv = torch.stack([ql, kl, vl], dim=2).detach().requires_grad_(grad)
            res = attn(qkv, **call)
        else:
            res = attn(ql, kl, vl, **call)

        def grads():
            return qkv.grad.unbind(2) if module == "qkvpacked" else (ql.grad, kl.grad, vl.grad)  # noqa: B023
        errs = sharded_errors(res, return_lse, sh, dt, ro, rl, rg, dout, grads)
        results.append(errs)
    return results


def property_case(cu_seqlens, **kw):
    """packed_case for one draw; a documented refusal is a result too."""
    lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    try:
        return ("ok", packed_case(docs=(lengths,), **kw)[0])
    except (NotImplementedError, ValueError) as exc:
        return ("refused", f"{type(exc).__name__}: {exc}")


def kernel_counts(U=1, R=2, layout="basic", causal=True, lengths=(8, 8, 8, 8), H=2, D=8, B=1, rotation="p2p"):
    """Kernel calls, query-key pairs scored and ring messages of one packed forward and
    backward on this rank."""
    _register()
    mesh = get_mesh(U, R)
    cu = cu_seqlens_from_lengths(lengths)
    S = cu[-1]
    q, k, v, dout, _ = make_inputs(B, S, H, H, D, torch.float32, 0, False)
    x = [usp_hal.shard(t, layout=layout, mesh=mesh, cu_seqlens=cu).requires_grad_() for t in (q, k, v)]
    attn = usp_hal.LongContextAttention(ring_impl_type=layout, attn_type=CountingSDPA.NAME, mesh=mesh,
                                        rotation=rotation)
    for key in CountingSDPA.counts:
        CountingSDPA.counts[key] = 0
    with CommMeter(("batch_isend_irecv",)) as meter:
        out = attn(*x, causal=causal, cu_seqlens=cu)
        out.backward(usp_hal.shard(dout, layout=layout, mesh=mesh, cu_seqlens=cu))
    res = dict(CountingSDPA.counts)
    res["p2p"] = meter.calls["batch_isend_irecv"]
    res["local_len"] = int(x[0].shape[1])
    return res


def refusal(U=1, R=2, what="no_varlen"):
    """A packed call every rank must refuse (with the same error) before any data moves."""
    _register()
    mesh = get_mesh(U, R)
    rank = dist.get_rank()
    S, H, D = 12, 2, 8
    cu = [0, 5, 12]
    attn_type = "sdpa"
    if what == "no_varlen":
        attn_type = NoVarlenSDPA.NAME
    elif what == "mismatch" and rank == 0:
        cu = [0, 6, 12]
    elif what == "missing" and rank == 0:
        cu = None
    elif what == "total":
        cu = [0, 5, 13]
    elif what == "decreasing" and rank == dist.get_world_size() - 1:
        cu = [0, 7, 5, 12]
    elif what == "float":
        cu = torch.tensor([0.0, 5.0, 12.0])
    x = torch.randn(1, S, H, D)
    shard_cu = [0, 5, 12]
    local = usp_hal.shard(x, layout="basic", mesh=mesh, cu_seqlens=shard_cu)
    names = ("all_to_all_single", "batch_isend_irecv")
    meter = CommMeter(names)
    try:
        with meter:
            attn = usp_hal.LongContextAttention(attn_type=attn_type, mesh=mesh)
            attn(local, local, local, causal=True, cu_seqlens=cu)
        return {"error": None, "counts": {n: meter.calls[n] for n in names}}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "counts": {n: meter.calls[n] for n in names}}


def shard_roundtrip(U=1, R=2, lengths=(3, 1, 6, 2)):
    """shard/unshard with cu_seqlens for every layout, and the position helpers."""
    mesh = get_mesh(U, R)
    cu = cu_seqlens_from_lengths(lengths)
    S = cu[-1]
    x = torch.arange(S, dtype=torch.float64).view(1, S, 1).expand(2, S, 3).contiguous()
    rep = {}
    for layout in layout_names():
        local = usp_hal.shard(x, layout=layout, mesh=mesh, cu_seqlens=cu)
        pos = mesh.local_positions(S, layout, cu_seqlens=cu)
        ids = mesh.local_position_ids(S, layout, cu_seqlens=cu)
        docs = mesh.local_document_ids(S, layout, cu_seqlens=cu)
        starts = torch.tensor(cu[:-1])
        back = usp_hal.unshard(local, layout=layout, mesh=mesh, cu_seqlens=cu)
        rep[layout] = {"roundtrip": bool(torch.equal(back, x)),
                       "positions": bool(torch.equal(local[0, :, 0].long(), pos)),
                       "position_ids": bool(torch.equal(ids, pos - starts[docs])) and bool((ids >= 0).all()),
                       "doc_ids_in_range": bool(((pos >= starts[docs]) & (pos < torch.tensor(cu[1:])[docs])).all())}
    return rep


def unshard_mismatch(U=1, R=2):
    """unshard with different cu_seqlens on one rank raises on every rank."""
    mesh = get_mesh(U, R)
    x = torch.randn(1, 10, 2)
    cu = [0, 4, 10]
    local = usp_hal.shard(x, layout="varlen_zigzag", mesh=mesh, cu_seqlens=cu)
    try:
        usp_hal.unshard(local, layout="varlen_zigzag", mesh=mesh, cu_seqlens=[0, 5, 10] if dist.get_rank() == 0 else cu)
        return None
    except ValueError as exc:
        return str(exc)


def unpacked_call_vs_packed_reference(U=1, R=2):
    """Negative control: packed inputs attended as ONE sequence (no cu_seqlens), compared
    with the per-document reference; returns the normalised errors (must be large)."""
    mesh = get_mesh(U, R)
    cu = (0, 6, 12)
    q, k, v, dout, _ = make_inputs(1, 12, 2, 2, 8, torch.float64, 5, False)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ro, _ = reference_packed_attention(qr, kr, vr, cu)
    rg = torch.autograd.grad(ro, (qr, kr, vr), dout)
    ql, kl, vl = (usp_hal.shard(x, mesh=mesh, cu_seqlens=cu).requires_grad_() for x in (q, k, v))
    out = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)(ql, kl, vl)
    out.backward(usp_hal.shard(dout, mesh=mesh))
    return {"out": _err(out, usp_hal.shard(ro, mesh=mesh), torch.float64),
            "dq": _err(ql.grad, usp_hal.shard(rg[0], mesh=mesh), torch.float64)}


def static_shapes_docs(U=1, R=2):
    """static_shapes=True: the first call checks (host collectives), the same boundaries
    again run without one; other boundaries are a different call and raise (which ends the
    use of the mesh's groups: a mesh of its own, on groups no other case uses)."""
    mesh = usp_hal.init_sequence_parallel(U, R, set_default=False, timeout=datetime.timedelta(seconds=60))
    x = torch.randn(1, 12, 2, 8)
    cu = [0, 5, 12]
    local = usp_hal.shard(x, layout="varlen_zigzag", mesh=mesh, cu_seqlens=cu)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type="varlen_zigzag", mesh=mesh,
                                        static_shapes=True)
    names = tuple(n for n in ("all_gather", "all_gather_into_tensor", "all_gather_single") if hasattr(dist, n))
    counts = []
    for arg in (cu, torch.tensor(cu)):
        with CommMeter(names) as meter:
            attn(local, local, local, causal=True, cu_seqlens=arg)
        counts.append(sum(meter.calls.values()))
    other = None
    try:
        attn(local, local, local, causal=True, cu_seqlens=[0, 5, 6, 12])
    except Exception as exc:
        other = f"{type(exc).__name__}: {exc}"
    return {"first_call_host_collectives": counts[0], "same_docs_host_collectives": counts[1], "other_docs": other}


def overlap_case(U=2, R=1, layout="varlen_zigzag", causal=True, lengths=(9, 1, 2, 12), H=4, Hkv=2, D=8):
    """async_qkv_attention (projections overlapped with the all-to-alls) on packed documents:
    output and the hidden states' gradient against float64 attention of each document alone
    on the projected q, k, v."""
    mesh = get_mesh(U, R)
    cu = cu_seqlens_from_lengths(lengths)
    S, E = cu[-1], 16
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, S, E, generator=g, dtype=torch.float64)
    weights = [torch.randn(h * D, E, generator=g, dtype=torch.float64) * 0.3 for h in (H, Hkv, Hkv)]
    dout = torch.randn(1, S, H, D, generator=g, dtype=torch.float64)
    hr = hidden.clone().requires_grad_()
    q, k, v = (torch.nn.functional.linear(hr, w).view(1, S, h, D) for w, h in zip(weights, (H, Hkv, Hkv)))
    ro, _ = reference_packed_attention(q, k, v, cu, causal=causal)
    (rg,) = torch.autograd.grad(ro, (hr,), dout)
    hl = usp_hal.shard(hidden, layout=layout, mesh=mesh, cu_seqlens=cu).requires_grad_()
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type=layout, mesh=mesh)
    projs = [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights]
    out = usp_hal.async_qkv_attention(attn, hl, *projs, heads=H, kv_heads=Hkv, head_dim=D, causal=causal,
                                      cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    out.backward(usp_hal.shard(dout, layout=layout, mesh=mesh, cu_seqlens=cu))

    def sh(x):
        return usp_hal.shard(x, layout=layout, mesh=mesh, cu_seqlens=cu)
    return {"out": _err(out, sh(ro), torch.float64), "dhidden": _err(hl.grad, sh(rg), torch.float64)}
