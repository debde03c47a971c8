"""Calibration for ``usp-hal plan --calibrate``: measure the kernel, the merge, copies and
the collectives on spawned CPU ranks and return a machine profile (see
:mod:`usp_hal.planning.planner` for what the numbers mean)."""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Dict, Optional

from ..planning import planner
from . import pool as _pool


def _fit(points):
    """Least squares t = a + b*x over (x, t); returns (a >= 0, b > 0)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    mt = sum(t for _, t in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (t - mt) for x, t in points) / var if var else (mt / mx if mx else 0.0)
    b = max(b, 1e-18)
    return max(0.0, mt - b * mx), b


def _times(fn, reps: int) -> list:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return ts


def _typical(fn, reps: int) -> float:
    """The median of ``reps`` runs: what a call takes in a run, as the bench reports it."""
    return statistics.median(_times(fn, reps))


def _best(fn, reps: int) -> float:
    """The fastest of ``reps`` runs: on a shared machine, noise only ever adds time."""
    return min(_times(fn, reps))


def rank_calibrate(dtype: str, head_dim: int, heads: int, sizes: list, msg_sizes: list, reps: int,
                   layer: Optional[dict] = None) -> dict:
    """Measure on this rank (kernel, merge, copies) and on the group (collectives)."""
    import torch
    import torch.distributed as dist

    from ..dispatch.capabilities import AttnRequest, KernelCall
    from ..dispatch.registry import REGISTRY
    from ..parallel.comm import _all_gather_single
    from ..parallel.ring import merge_block
    from .cases import _torch_dtype
    tdt = _torch_dtype(dtype)
    rank, world = dist.get_rank(), dist.get_world_size()
    out: Dict[str, Any] = {"rank": rank}
    req = AttnRequest(dtype=tdt, device_type="cpu", head_dim=head_dim, num_heads=heads, num_kv_heads=heads,
                      causal=True, needs_grad=True, needs_lse=True, key_offset=True)
    backend = REGISTRY.instance("auto", req)
    out["backend"] = getattr(backend, "NAME", type(backend).__name__)
    scale = head_dim ** -0.5
    fwd_pts, bwd_pts, causal = [], [], {}
    for s in sizes:
        q, k, v = (torch.randn(1, s, heads, head_dim, dtype=tdt) for _ in range(3))
        for c in (False, True):
            call = KernelCall(scale=scale, causal=c)
            o, lse = backend.forward(q, k, v, call)
            tf = _typical(lambda: backend.forward(q, k, v, call), reps)
            do = torch.randn_like(o)
            tb = _typical(lambda: backend.backward(do, q, k, v, o, lse, call), reps)
            flops = planner.FLOPS_PER_PAIR * head_dim * s * s * heads
            if c:
                causal[s] = (tf, tb)
            else:
                fwd_pts.append((flops, tf))
                bwd_pts.append((planner.BWD_FLOPS_RATIO * flops, tb))
                causal.setdefault(("full", s), (tf, tb))
    # rate: the median over sizes of flops / time (one disturbed size cannot skew it);
    # per-call overhead: what the smallest size takes beyond its flops at that rate
    rate_f = statistics.median([f / t for f, t in fwd_pts])
    rate_b = statistics.median([f / t for f, t in bwd_pts])
    # per-call overhead: what a tiny call takes beyond its flops (a 512-token call's excess over the
    # median rate is the kernel's lower efficiency at that size, not a per-call cost)
    q, k, v = (torch.randn(1, TINY, heads, head_dim, dtype=tdt) for _ in range(3))
    tiny = KernelCall(scale=scale, causal=False)
    o, lse = backend.forward(q, k, v, tiny)
    do = torch.randn_like(o)
    tiny_flops = planner.FLOPS_PER_PAIR * head_dim * TINY * TINY * heads
    a_f = max(0.0, _typical(lambda: backend.forward(q, k, v, tiny), reps) - tiny_flops / rate_f)
    a_b = max(0.0, _typical(lambda: backend.backward(do, q, k, v, o, lse, tiny), reps)
              - planner.BWD_FLOPS_RATIO * tiny_flops / rate_b)
    b_f, b_b = 1.0 / rate_f, 1.0 / rate_b
    cfs = [((causal[s][0]) / max(causal[("full", s)][0], 1e-12) + causal[s][1] / max(causal[("full", s)][1], 1e-12)) / 2
           for s in sizes[1:]]
    cf = statistics.median(cfs)
    per_size = [(s, (causal[s][0] / max(causal[("full", s)][0], 1e-12)
                     + causal[s][1] / max(causal[("full", s)][1], 1e-12)) / 2) for s in sizes]
    out["kernel"] = {"fwd_flops": 1.0 / b_f, "bwd_flops": 1.0 / b_b, "call_overhead": (a_f + a_b) / 2,
                     "causal_factor": min(1.0, max(0.5, cf)), "causal_tile": planner.fit_causal_tile(per_size),
                     "backend": out["backend"],
                     "measured": {"sizes": sizes, "heads": heads, "head_dim": head_dim,
                                  "fwd_s": [t for _, t in fwd_pts], "bwd_s": [t for _, t in bwd_pts],
                                  "causal_fwd_bwd_s": [list(causal[s]) for s in sizes]}}
    # merge and copy throughput
    n = 1 << 20
    acc = torch.randn(1, n // (heads * head_dim), heads, head_dim, dtype=torch.float32)
    lse = torch.randn(1, heads, acc.shape[1])
    o2, l2 = acc.clone(), lse.clone()
    tm = _best(lambda: merge_block(acc, lse, slice(0, acc.shape[1]), o2, l2), reps)
    out["merge_s_per_elem"] = tm / acc.numel()
    x = torch.randn(4 << 20, dtype=torch.float32)
    tc = _best(lambda: x.clone(), reps)
    out["copy_bandwidth"] = x.numel() * 4 / tc
    # collectives on the whole group: latency + bytes / bandwidth per kind
    colls = {}
    for kind in ("all_to_all", "p2p", "all_gather", "all_reduce"):
        pts = []
        for nbytes in msg_sizes:
            numel = max(world, nbytes // 4 // world * world)
            buf = torch.randn(numel)
            recv = torch.empty_like(buf)
            if kind == "all_to_all":
                def op():
                    dist.all_to_all_single(recv, buf)
                sent = numel * 4 * (world - 1) / world
            elif kind == "p2p":
                def op():
                    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, (rank + 1) % world),
                                                   dist.P2POp(dist.irecv, recv, (rank - 1) % world)])
                    for r in reqs:
                        r.wait()
                sent = numel * 4
            elif kind == "all_reduce":      # priced per byte reduced (the gradients' size)
                def op():
                    dist.all_reduce(recv)
                sent = numel * 4
            else:
                gat = torch.empty(numel * world)

                def op():
                    _all_gather_single(gat, buf)
                sent = numel * 4 * (world - 1)

            def timed():
                dist.barrier()
                return _best(op, 1)
            op()
            pts.append((sent, min(timed() for _ in range(reps))))
        lat, inv_bw = _fit(pts)
        colls[kind] = {"intra": {"bandwidth": 1.0 / inv_bw, "latency": lat,
                                 "measured": [{"bytes": b, "s": t} for b, t in pts]}}
    out["collectives"] = colls
    out["overlap"] = _overlap(backend, tdt, heads, head_dim, scale, rank, world, reps)
    out["call_fixed"] = _usp_call_fixed(out["backend"], head_dim, world, reps)
    out["call_fixed_local"] = _usp_call_fixed(out["backend"], head_dim, 1, reps)
    if world > 2:
        out["call_fixed_ring"] = _usp_call_fixed(out["backend"], head_dim, world, reps, ring=True)
    if world > 1:
        out["ring_piece"] = _ring_piece(out["backend"], heads, head_dim, world, reps)
    if layer is not None:
        out["token_layers"] = _token_layers(tdt, reps=reps, **layer)
    dist.barrier()
    return out


def _overlap(backend, tdt, heads: int, head_dim: int, scale: float, rank: int, world: int, reps: int) -> float:
    """How much a ring step's block exchange slows the kernel it overlaps: a kernel call and a
    p2p move of a K/V block (to the next rank, from the previous) alone and together, every rank
    at once; ``(together - the longer) / the shorter``, 0 (hidden) to 1 (they take turns: on a
    CPU with fewer cores than ranks the transport and the kernel share them)."""
    import torch
    import torch.distributed as dist

    from ..dispatch.capabilities import KernelCall
    n = 1024
    q, k, v = (torch.randn(1, n, heads, head_dim, dtype=tdt) for _ in range(3))
    call = KernelCall(scale=scale, causal=False)
    blk = torch.randn(2 * n * heads * head_dim, dtype=tdt)
    got = torch.empty_like(blk)

    def move():
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, blk, (rank + 1) % world),
                                       dist.P2POp(dist.irecv, got, (rank - 1) % world)])

    def timed(fn):
        ts = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def comm():
        for r in move():
            r.wait()

    def both():
        reqs = move()
        backend.forward(q, k, v, call)
        for r in reqs:
            r.wait()
    backend.forward(q, k, v, call)
    comm()
    t_c, t_p, t_b = timed(lambda: backend.forward(q, k, v, call)), timed(comm), timed(both)
    return min(1.0, max(0.0, (t_b - max(t_c, t_p)) / max(min(t_c, t_p), 1e-12)))


def _token_layers(tdt, *, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, vocab: int,
                  reps: int) -> dict:
    """The token-proportional layers' rates on this rank: GEMMs (a linear layer's forward and
    backward, flops/s), elementwise ops (bytes/s), and the fixed seconds of a Llama-shaped
    decoder layer and of the rest of a model call (embedding, norm, head, loss) at 4 tokens,
    forward and backward; AdamW's fixed seconds per step."""
    import torch
    import torch.nn.functional as F

    from .standin import StandInHead, StandInLayer, rope
    torch.manual_seed(0)
    t = 1024
    x = torch.randn(t, hidden, dtype=tdt, requires_grad=True)
    w = torch.randn(intermediate, hidden, dtype=tdt, requires_grad=True)
    dy = torch.randn(t, intermediate, dtype=tdt)

    def gemm():
        F.linear(x, w).backward(dy)
    gemm()
    linear = 6.0 * t * hidden * intermediate / _typical(gemm, reps)
    a, b = (torch.randn(t, intermediate, dtype=tdt) for _ in range(2))

    def elementwise():     # mul, add, silu, cat: 3 + 3 + 2 + 2 tensors of t x intermediate moved
        c = F.silu(a * b + a)
        torch.cat((c[:, : intermediate // 2], c[:, intermediate // 2:]), dim=-1)
    elementwise()
    elem_bw = 10.0 * a.numel() * a.element_size() / _typical(elementwise, reps)
    layer = StandInLayer(hidden, heads, kv_heads, head_dim, intermediate).to(tdt)
    head = StandInHead(hidden, vocab).to(tdt)
    few = 4
    cos, sin = rope(few, head_dim, tdt)
    h = torch.randn(1, few, hidden, dtype=tdt, requires_grad=True)
    ids = torch.randint(0, vocab, (1, few))

    def one_layer():
        layer(h, cos, sin).sum().backward()

    def rest():
        head.loss(head.embed(ids), ids).backward()
    one_layer()
    rest()
    opt = torch.optim.AdamW(list(layer.parameters()) + list(head.parameters()), lr=1e-4)
    params = sum(p.numel() for p in opt.param_groups[0]["params"])
    # what a token costs in the layer (without its attention kernel) and in the head and loss: the
    # slope between two lengths, so that the fixed costs drop out (and cache effects at length count)
    slopes = {}
    for part in ("layer", "head"):
        ts = []
        for n in TOKEN_LENGTHS:
            c, s = rope(n, head_dim, tdt)
            x = torch.randn(1, n, hidden, dtype=tdt, requires_grad=True)
            tok = torch.randint(0, vocab, (1, n))
            if part == "layer":
                def run():
                    layer(x, c, s, attention=False).sum().backward()
            else:
                def run():
                    head.loss(head.embed(tok), tok).backward()
            run()
            ts.append(_typical(run, reps))
        slopes[part] = max(0.0, (ts[1] - ts[0]) / (TOKEN_LENGTHS[1] - TOKEN_LENGTHS[0]))
    return {"linear_flops": linear, "elementwise_bandwidth": elem_bw, "layer_s": _typical(one_layer, reps),
            "rest_s": _typical(rest, reps), "adamw_s": _typical(opt.step, reps), "adamw_params": params,
            "layer_per_token_s": slopes["layer"], "head_per_token_s": slopes["head"],
            "shape": {"hidden": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                      "intermediate": intermediate, "vocab": vocab}}


#: the two lengths whose times give a token's cost in a layer and in the head
TOKEN_LENGTHS = (512, 2048)
#: the length of the attention calls that measure the kernel's per-call overhead
TINY = 16


def _ring_piece(backend: str, heads: int, head_dim: int, world: int, reps: int) -> float:
    """What one more kernel call costs a ring step: a ring call over every rank on 512 packed
    tokens as 64 documents against the same tokens as one, forward and backward, over the calls
    the 64 documents add (each document a call per step and pass, its merge and slicing with it)."""
    import torch
    import torch.distributed as dist

    import usp_hal

    from ..planning.planner import ring_work
    mesh = usp_hal.init_sequence_parallel(1, world, set_default=False)
    attn = usp_hal.LongContextAttention(attn_type=backend, ring_impl_type="varlen_zigzag", mesh=mesh)
    n, docs = 512, 64
    times, calls = [], []
    for cu in ([0, n], [i * (n // docs) for i in range(docs + 1)]):
        g = torch.Generator().manual_seed(0)
        q, k, v = (usp_hal.shard(torch.randn(1, n, heads, head_dim, generator=g), layout="varlen_zigzag", mesh=mesh,
                                 cu_seqlens=cu).requires_grad_() for _ in range(3))

        def run():
            attn(q, k, v, causal=True, cu_seqlens=cu).sum().backward()
        run()
        ts = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            run()
            dist.barrier()
            ts.append(time.perf_counter() - t0)
        times.append(statistics.median(ts))
        work, _, _ = ring_work("varlen_zigzag", n, world, True, tuple(cu) if len(cu) > 2 else None)
        calls.append(2 * max(sum(len(st) for st in rank) for rank in work))     # forward and backward
    return max(0.0, (times[1] - times[0]) / max(1, calls[1] - calls[0]))


def _usp_call_fixed(backend: str, head_dim: int, world: int, reps: int, ring: bool = False) -> dict:
    """The fixed cost of one USP call on this group (metadata exchange, the all-to-alls'
    synchronisation, Python), from a tiny Ulysses call (``ring``: a tiny ring call, its steps'
    exchanges and bookkeeping included) timed as the bench times a call: after a barrier, the
    slowest rank, the median over rounds.  Forward, and forward + backward."""
    import torch
    import torch.distributed as dist

    import usp_hal
    mesh = usp_hal.init_sequence_parallel(1, world, set_default=False) if ring else \
        usp_hal.init_sequence_parallel(world, 1, set_default=False)
    attn = usp_hal.LongContextAttention(attn_type=backend, mesh=mesh)
    q, k, v, do = (torch.randn(1, 4, world, head_dim) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    res = {}
    for mode in ("fwd", "fwdbwd"):
        times = []
        for i in range(3 + 4 * reps):
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "fwd":
                with torch.no_grad():
                    attn(q, k, v, causal=True)
            else:
                attn(q, k, v, causal=True).backward(do)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i >= 3:                     # the first calls build plans and caches
                times.append(float(dt))
        res[mode] = statistics.median(times)
    return res


#: the decoder layer the token-proportional rates are measured on, unless told another
#: (Llama-shaped, small enough to time on a CPU: hidden 256, 8 heads of 32, 2 KV heads)
LAYER = {"hidden": 256, "heads": 8, "kv_heads": 2, "head_dim": 32, "intermediate": 704, "vocab": 2048}


def calibrate(nproc: int = 2, *, dtype: str = "fp32", head_dim: int = 64, heads: int = 2, threads: int = 1,
              sizes=(512, 1024, 2048), msg_sizes=(4 << 10, 256 << 10, 2 << 20, 8 << 20), reps: int = 5,
              timeout: float = 120.0, layer: Optional[dict] = None) -> dict:
    """Spawn ``nproc`` CPU ranks (gloo), measure, and return a profile dict.  Every rank
    measures at once, so on a machine with fewer cores than ranks the rates are what each
    rank gets when all of them run.  ``layer``: the decoder layer's shape for the token-
    proportional rates (default :data:`LAYER`)."""
    t0 = time.monotonic()
    layer = dict(LAYER if layer is None else layer)
    pool = _pool.RankPool(nproc, threads=threads, device_type="cpu", start_timeout=timeout)
    try:
        res = pool.run(rank_calibrate, timeout=timeout, dtype=dtype, head_dim=head_dim, heads=heads,
                       sizes=list(sizes), msg_sizes=list(msg_sizes), reps=reps, layer=layer)
    finally:
        pool.close()
    tok = [r["token_layers"] for r in res]
    elem_bw = min(t["elementwise_bandwidth"] for t in tok)
    linear = min(t["linear_flops"] for t in tok)
    adamw = max(max(0.0, t["adamw_s"] - 28.0 * t["adamw_params"] / elem_bw) for t in tok)
    # the analytic price of a token (GEMMs at the linear rate, elementwise traffic at the elementwise
    # bandwidth) against what the Llama-shaped layer and head took: the scale every shape's price takes
    from ..planning.stepcost import AttentionShape
    shape = AttentionShape(layer["heads"], layer["head_dim"], layer["kv_heads"], dtype, True, True,
                           hidden=layer["hidden"], intermediate=layer["intermediate"], layers=1, vocab=layer["vocab"])
    per_layer, per_head = shape.token_cost(linear, elem_bw)
    scale = {"layer": max(t["layer_per_token_s"] for t in tok) / per_layer,
             "head": max(t["head_per_token_s"] for t in tok) / per_head}
    # the slowest rank's numbers (the ranks run in lock step)
    kern = min((r["kernel"] for r in res), key=lambda k: k["fwd_flops"])
    colls = {}
    for kind in res[0]["collectives"]:
        worst = dict(min((r["collectives"][kind]["intra"] for r in res), key=lambda c: c["bandwidth"]))
        colls[kind] = {"intra": worst, "inter": worst}
    fixed = max(r["call_fixed"]["fwdbwd"] for r in res)
    if nproc > 2:
        # a ring step's latency as the ring pays it (each step's exchange and bookkeeping, with the
        # ranks in lock step): a tiny ring call's time beyond a tiny Ulysses call's fixed cost (less
        # its four all-to-all latencies), over its 2 (R - 1) steps; not below the p2p fit's
        a2a_lat = colls["all_to_all"]["intra"]["latency"]
        ring = max(r["call_fixed_ring"]["fwdbwd"] for r in res)
        step = (ring - (fixed - 4 * a2a_lat)) / (2 * (nproc - 1))
        p2p = colls["p2p"]["intra"]
        p2p["latency_fit"] = p2p["latency"]
        p2p["latency"] = max(p2p["latency"], step)
    import platform as _pyplatform

    import torch
    return {
        "name": "cpu",
        "description": f"measured by `usp-hal plan --calibrate` on {_pyplatform.machine()} "
                       f"({os.cpu_count()} logical cpus), {nproc} gloo ranks x {threads} thread(s), torch "
                       f"{torch.__version__}, in {time.monotonic() - t0:.1f} s",
        "sources": ["measured on this machine (see 'measured' entries)"],
        "assumptions": ["one host: intra and inter links are the same loopback transport",
                        "kernel throughput measured at the calibration head dim; other head dims use it unscaled",
                        "backward throughput is per 2.5x the forward flops (recompute + 4 matmuls)",
                        "kernel times are medians of the runs (as the bench reports a call), not the best run",
                        "call_overhead / call_overhead_bwd: a tiny Ulysses call timed like the bench times one "
                        "(after a barrier, slowest rank, median): the fixed cost every call pays; *_local: the same "
                        "on a one-rank group",
                        "linear: a linear layer's forward and backward (3 GEMMs) at 1024 tokens of the calibration "
                        "layer; elementwise_bandwidth: mul, add, SiLU and cat on its MLP activations",
                        "layer_overhead / model_overhead: a Llama-shaped decoder layer (usp_hal.harness.standin) and "
                        "the embedding + norm + head + loss, forward and backward at 4 tokens; optimizer_overhead: "
                        "AdamW's step beyond 7 fp32 words per parameter at the elementwise bandwidth",
                        "ring_call_overhead: one more kernel call in a ring step (a ring call on 512 packed tokens as "
                        "64 documents against one, over the calls they add), when above the kernel's own",
                        "p2p latency: a ring step as the ring pays it (a tiny ring call on every rank beyond a tiny "
                        "Ulysses call's fixed cost, over its 2 (R - 1) steps), when above the fit's intercept",
                        "token_scale: what a token took in that layer (without its attention kernel) and in the head "
                        "and loss, between 512 and 2048 tokens, over the price the two rates give it; every shape's "
                        "token-proportional price is scaled by it"],
        "gpus_per_node": 1 << 20,
        "memory_bytes": None,
        "intra": {"bandwidth": colls["p2p"]["intra"]["bandwidth"], "latency": colls["p2p"]["intra"]["latency"]},
        "inter": {"bandwidth": colls["p2p"]["intra"]["bandwidth"], "latency": colls["p2p"]["intra"]["latency"]},
        "collectives": colls,
        "kernel": {dtype: {**{k: kern[k] for k in ("fwd_flops", "bwd_flops", "call_overhead", "causal_factor",
                                                   "causal_tile", "backend", "measured")},
                           **({"ring_call_overhead": max(kern["call_overhead"], max(r["ring_piece"] for r in res))}
                              if nproc > 1 else {})}},
        "merge_s_per_elem": max(r["merge_s_per_elem"] for r in res),
        "copy_bandwidth": min(r["copy_bandwidth"] for r in res),
        # the ring's exchange against the kernel it overlaps, measured (0: hidden, 1: they take turns)
        "overlap_penalty": max(r["overlap"] for r in res),
        # fixed cost per USP call (and what a backward adds), from a tiny real call
        "call_overhead": max(r["call_fixed"]["fwd"] for r in res),
        "call_overhead_bwd": max(0.0, max(r["call_fixed"]["fwdbwd"] for r in res)
                                 - max(r["call_fixed"]["fwd"] for r in res)),
        # the same on a one-rank group (no collective): what a job alone on a rank pays
        "call_overhead_local": max(r["call_fixed_local"]["fwd"] for r in res),
        "call_overhead_bwd_local": max(0.0, max(r["call_fixed_local"]["fwdbwd"] for r in res)
                                       - max(r["call_fixed_local"]["fwd"] for r in res)),
        # the token-proportional layers (usp_hal.planning.stepcost), each the slowest rank's
        "linear": {dtype: {"flops": linear}},
        "elementwise_bandwidth": elem_bw,
        "token_scale": scale,
        "layer_overhead": max(t["layer_s"] for t in tok),
        "model_overhead": max(t["rest_s"] for t in tok),
        "optimizer_overhead": adamw,
        "calibration": {"nproc": nproc, "threads_per_rank": threads, "dtype": dtype, "head_dim": head_dim,
                        "heads": heads, "layer": layer, "wall_s": round(time.monotonic() - t0, 1)},
    }
