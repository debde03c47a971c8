"""Packed documents (cu_seqlens): work balance per layout, and the cost of a packed batch.

1. Balance (pure, no process): causal packed batches of 8 documents with log-uniform
   lengths; for each layout the work balance = max/min over ring ranks of the query-key
   pairs its kernels score, from the block plan (``usp_hal.sequence.blocks.ring_work``).
2. Cost (2 spawned ranks): one causal sequence of S tokens against a packed batch of
   ``--docs`` equal documents of the same total length, forward+backward, every
   configuration checked against the reference and timed in interleaved rounds (median
   over rounds of the max over ranks), as ``usp-hal run`` measures one configuration.
3. The kernel's own ratio (this process, one thread): the same backend's forward+backward
   on the ``--docs`` causal documents one call each against one causal call over S, no
   USP at all: the floor any packed run on this machine can reach.
4. ``--plan``: ``usp_hal.plan(..., cu_seqlens=...)`` with the shipped cpu profile for an
   equal-document batch and a mixed one, every ranked configuration measured like 2.

Run from the repository root:

    python -m benchmarks.varlen                        # both, S=4096, H=8, D=64, fp32
    python -m benchmarks.varlen --skip-cost --draws 1000
    python -m benchmarks.varlen --skip-cost --plan       # the planner with packed documents
"""
from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import asdict
from statistics import median

from usp_hal.harness import RankPool, RunConfig, fmt_ms
from usp_hal.harness.cases import merge_checks, rank_check, rank_clear, rank_prepare, rank_release, rank_steps
from usp_hal.sequence.blocks import ring_calls, ring_work, work_balance
from usp_hal.sequence.positions import cu_seqlens_from_lengths, equal_documents, layout_names


def log_uniform_batch(rng: random.Random, docs: int, lo: int, hi: int) -> tuple:
    return cu_seqlens_from_lengths(int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))) for _ in range(docs))


def _per_layout(ring_sizes, draws: int, docs: int, lo: int, hi: int, seed: int, measure) -> dict:
    """{(R, layout): sorted values of ``measure(layout, cu, R)``} over the same ``draws``
    random batches for every ring size (seeded, so every table sees the same batches)."""
    out: dict = {}
    for R in ring_sizes:
        rng = random.Random(seed)
        for _ in range(draws):
            cu = log_uniform_batch(rng, docs, lo, hi)
            for name in layout_names():
                out.setdefault((R, name), []).append(measure(name, cu, R))
    return {key: sorted(vals) for key, vals in out.items()}


def balance_table(ring_sizes, draws: int, docs: int, lo: int, hi: int, seed: int) -> list:
    per = _per_layout(ring_sizes, draws, docs, lo, hi, seed,
                      lambda name, cu, R: work_balance(ring_work(name, cu[-1], R, causal=True, cu_seqlens=cu)))
    return [{"ring": R, "layout": name, "median": vals[len(vals) // 2], "p95": vals[int(0.95 * (len(vals) - 1))],
             "max": vals[-1]} for (R, name), vals in per.items()]


def calls_table(ring_sizes, draws: int, docs: int, lo: int, hi: int, seed: int) -> list:
    """Per layout: forward kernel calls on the busiest ring rank, one call per document piece
    (any backend) against packed varlen calls (fa2, fa3)."""
    rows = []
    for packed in (False, True):
        per = _per_layout(ring_sizes, draws, docs, lo, hi, seed,
                          lambda name, cu, R, p=packed: max(ring_calls(name, cu[-1], R, cu_seqlens=cu, packed=p)))
        for i, ((R, name), vals) in enumerate(per.items()):
            if not packed:
                rows.append({"ring": R, "layout": name, "plain_median": vals[len(vals) // 2], "plain_max": vals[-1]})
            else:
                rows[i].update(packed_median=vals[len(vals) // 2], packed_max=vals[-1])
    return rows


def kernel_ratio(args) -> dict:
    """Median over interleaved rounds of the backend's fwd+bwd time: ``--docs`` causal calls of
    S/docs tokens against one causal call of S tokens (one process, one thread)."""
    import time

    import torch

    from usp_hal import KernelCall, get_backend
    from usp_hal.dispatch.capabilities import parse_dtype
    torch.set_num_threads(1)
    backend = get_backend("sdpa")()
    dt = parse_dtype(args.dtype)
    g = torch.Generator().manual_seed(0)
    S, n, H, D = args.seqlen, args.docs, args.heads, args.head_dim
    q, k, v, do = (torch.randn(1, S, H, D, generator=g).to(dt) for _ in range(4))
    bounds = equal_documents(S, n)
    call = KernelCall(scale=D ** -0.5, causal=True)

    def run(pieces):
        t0 = time.perf_counter()
        for a, b in pieces:
            o, lse = backend.forward(q[:, a:b], k[:, a:b], v[:, a:b], call)
            backend.backward(do[:, a:b], q[:, a:b], k[:, a:b], v[:, a:b], o, lse, call)
        return time.perf_counter() - t0

    cases = {"one": [(0, S)], "docs": list(zip(bounds[:-1], bounds[1:]))}
    times: dict = {name: [] for name in cases}
    for name in cases:
        run(cases[name])                      # warm-up
    for _ in range(args.rounds * args.iters):
        for name, pieces in cases.items():
            times[name].append(run(pieces))
    one, docs = median(times["one"]), median(times["docs"])
    # what a causal mask saves this kernel per size: causal / full time of one square call
    shares = {}
    for n in sorted({S // n_ for n_ in (16, 8, 4, 2, 1) if S // n_ >= 128}):
        x = (q[:, :n], k[:, :n], v[:, :n])
        per = {}
        for causal in (True, False):
            o, lse = backend.forward(*x, KernelCall(scale=D ** -0.5, causal=causal))

            def step(causal=causal, o=o, lse=lse, x=x, d=do[:, :n]):
                backend.forward(*x, KernelCall(scale=D ** -0.5, causal=causal))
                backend.backward(d, *x, o, lse, KernelCall(scale=D ** -0.5, causal=causal))
            step()
            ts = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                step()
                ts.append(time.perf_counter() - t0)
            per[causal] = median(ts)
        shares[n] = per[True] / per[False]
    return {"one_ms": one * 1e3, "docs_ms": docs * 1e3, "ratio": docs / one, "causal_share": shares}


def measure(configs, rounds: int):
    """Every (label, RunConfig) on 2 reused ranks: checked against the reference, then timed
    in ``rounds`` interleaved rounds (each the max over ranks per iteration).  Returns per
    label: the times, the check, the kernel calls and the work per rank."""
    pool = RankPool(2, threads=1)
    try:
        times: dict = {label: [] for label, _ in configs}
        checks, kernel_calls, work = {}, {}, {}
        for i, (label, cfg) in enumerate(configs):
            pool.run(rank_prepare, timeout=600, cfg=asdict(cfg), case=str(i))
            checks[label] = merge_checks(pool.run(rank_check, timeout=600, case=str(i)))
            if cfg.warmup:
                pool.run(rank_steps, timeout=600, case=str(i), n=cfg.warmup)
        for rnd in range(rounds):
            order = list(range(len(configs)))
            order = order[rnd % len(order):] + order[:rnd % len(order)]
            for i in order:
                label, cfg = configs[i]
                recs = pool.run(rank_steps, timeout=600, case=str(i), n=cfg.iters)
                times[label] += [max(r[j]["time"] for r in recs) for j in range(cfg.iters)]
                kernel_calls[label] = [r[-1]["kernel_calls"] for r in recs]
                work[label] = [r[-1]["work"] for r in recs]
        for i in range(len(configs)):
            pool.run(rank_release, timeout=60, case=str(i))
        pool.run(rank_clear, timeout=60)
    finally:
        pool.close()
    return times, checks, kernel_calls, work


def plan_check(args) -> list:
    """``usp_hal.plan`` with ``cu_seqlens`` against measurement: for an equal-document batch and a
    mixed one, every candidate the planner ranks on 2 ranks, predicted and measured side by side."""
    from usp_hal import plan
    rng = random.Random(args.seed)
    batches = [("4 equal documents", tuple(equal_documents(args.seqlen, 4))),
               ("8 log-uniform documents", _fit(log_uniform_batch(rng, 8, 16, args.seqlen), args.seqlen))]
    base = dict(nproc=2, seqlen=args.seqlen, heads=args.heads, kv_heads=args.heads, head_dim=args.head_dim,
                causal=True, bwd=True, attn_type="sdpa", dtype=args.dtype, iters=args.iters, warmup=args.warmup,
                check=args.check)
    out = []
    for name, cu in batches:
        res = plan(2, args.heads, args.seqlen, args.head_dim, dtype=args.dtype, causal=True, bwd=True,
                   profile="cpu", cu_seqlens=cu)
        configs = []
        for row in res["rows"]:
            c = row["candidate"]
            configs.append((row["label"], RunConfig(ulysses=c["ulysses"], ring=c["ring"], ring_impl=c["layout"],
                                                    rotate=c["rotation"], cu_seqlens=",".join(map(str, cu)),
                                                    **base)))
        times, checks, _, _ = measure(configs, args.rounds)
        pred = {row["label"]: row["time"] for row in res["rows"]}
        meas = {label: median(times[label]) for label, _ in configs}
        order_m = sorted(meas, key=meas.get)
        out.append({"batch": name, "cu_seqlens": cu, "predicted_winner": res["winner"],
                    "measured_best": order_m[0],
                    "winner_within": meas[res["winner"]] / meas[order_m[0]],
                    "rows": [{"config": lab, "predicted_ms": pred[lab] * 1e3, "measured_ms": meas[lab] * 1e3,
                              "ratio": pred[lab] / meas[lab], "check_ok": checks[lab]["ok"]} for lab in pred]})
    return out


def _fit(cu: tuple, seqlen: int) -> tuple:
    """Boundaries scaled to end at ``seqlen`` (the draw's total length differs)."""
    scaled = sorted({round(b * seqlen / cu[-1]) for b in cu})
    return tuple(scaled)


def cost(args) -> list:
    cu = ",".join(map(str, equal_documents(args.seqlen, args.docs)))
    base = dict(nproc=2, ulysses=1, ring=2, seqlen=args.seqlen, heads=args.heads, kv_heads=args.heads,
                head_dim=args.head_dim, causal=True, bwd=True, attn_type="sdpa", dtype=args.dtype,
                iters=args.iters, warmup=args.warmup, check=args.check)
    configs = [("one sequence, zigzag", RunConfig(ring_impl="zigzag", **base)),
               ("one sequence, basic", RunConfig(ring_impl="basic", **base)),
               (f"{args.docs} documents, varlen_zigzag", RunConfig(ring_impl="varlen_zigzag", cu_seqlens=cu, **base)),
               (f"{args.docs} documents, zigzag", RunConfig(ring_impl="zigzag", cu_seqlens=cu, **base)),
               (f"{args.docs} documents, basic", RunConfig(ring_impl="basic", cu_seqlens=cu, **base))]
    times, checks, kernel_calls, work = measure(configs, args.rounds)
    ref = median(times[configs[0][0]])
    ref_basic = median(times[configs[1][0]])
    rows = []
    for label, _cfg in configs:
        t = median(times[label])
        rows.append({"config": label, "ms": t * 1e3, "vs_one_sequence_zigzag": t / ref,
                     "vs_one_sequence_basic": t / ref_basic, "kernel_calls_per_rank": kernel_calls[label],
                     "work_per_rank": work[label], "check_ok": checks[label]["ok"],
                     "worst_error": max(e["worst"] for e in checks[label]["errors"].values())})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draws", type=int, default=300, help="random batches per ring size (default 300)")
    p.add_argument("--ring-sizes", default="2,4,8")
    p.add_argument("--min-len", type=int, default=16, help="shortest document of the draws (default 16)")
    p.add_argument("--max-len", type=int, default=4096, help="longest document of the draws (default 4096)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-cost", action="store_true")
    p.add_argument("--plan", action="store_true", help="also check usp_hal.plan(cu_seqlens=...) against measurement")
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--check", default="auto")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    rings = [int(x) for x in args.ring_sizes.split(",")]
    print(f"work balance (max/min over ring ranks of the query-key pairs scored), causal, 8 documents of "
          f"log-uniform length in [{args.min_len}, {args.max_len}], {args.draws} draws per ring size:")
    print(f"  {'R':>2}  {'layout':<14} {'median':>8} {'p95':>8} {'max':>8}")
    table = balance_table(rings, args.draws, 8, args.min_len, args.max_len, args.seed)
    for r in table:
        print(f"  {r['ring']:>2}  {r['layout']:<14} {r['median']:>8.3f} {r['p95']:>8.3f} {r['max']:>8.3f}")
    worst = max(r["max"] for r in table if r["layout"] == "varlen_zigzag")
    print(f"  varlen_zigzag, worst draw over all ring sizes: {worst:.3f} (target <= 1.10: "
          f"{'met' if worst <= 1.10 else 'NOT met'})")
    print("\nforward kernel calls on the busiest ring rank, same draws: one call per document piece (any "
          "backend) / packed varlen calls (fa2, fa3):")
    print(f"  {'R':>2}  {'layout':<14} {'per piece median / max':>24} {'packed median / max':>22}")
    for r in calls_table(rings, args.draws, 8, args.min_len, args.max_len, args.seed):
        print(f"  {r['ring']:>2}  {r['layout']:<14} {r['plain_median']:>15} / {r['plain_max']:<6} "
              f"{r['packed_median']:>13} / {r['packed_max']:<6}")
    ok = True
    if not args.skip_cost:
        print(f"\ncost on 2 ranks (ring 2, sdpa, {args.dtype}, B=1 H={args.heads} D={args.head_dim}, causal, "
              f"forward+backward, S={args.seqlen}; median over {args.rounds} interleaved rounds x {args.iters} "
              "iterations of the max over ranks):")
        rows = cost(args)
        print(f"  {'configuration':<28} {'ms':>8} {'x one seq (zigzag)':>19} {'x one seq (basic)':>18}  "
              f"{'kernel calls/rank':<18} check")
        for r in rows:
            print(f"  {r['config']:<28} {fmt_ms(r['ms'] / 1e3):>8} {r['vs_one_sequence_zigzag']:>19.3f} "
                  f"{r['vs_one_sequence_basic']:>18.3f}  {str(r['kernel_calls_per_rank']):<18} "
                  f"{'pass' if r['check_ok'] else 'FAIL'} ({r['worst_error']:.3g})")
        packed = next(r for r in rows if r["config"].endswith("varlen_zigzag"))
        ratio = packed["vs_one_sequence_zigzag"]
        best = min(r["vs_one_sequence_zigzag"] for r in rows if "documents" in r["config"])
        print(f"  {args.docs} documents (varlen_zigzag) / one sequence (zigzag): {ratio:.3f}; best layout {best:.3f} "
              f"(target <= 0.35: {'met' if best <= 0.35 else 'NOT met'}; "
              f"ideal {1 / args.docs:.3f}, the causal work ratio)")
        kr = kernel_ratio(args)
        print(f"  the kernel alone (sdpa, one process, one thread, fwd+bwd): {args.docs} causal calls of "
              f"{args.seqlen // args.docs} tokens {fmt_ms(kr['docs_ms'] / 1e3)} / one causal call of {args.seqlen} "
              f"{fmt_ms(kr['one_ms'] / 1e3)} = {kr['ratio']:.3f} (the floor for a packed run on this machine)")
        print("  causal / full time of one square call (fwd+bwd) per size, the share of the work a causal mask saves "
              "with this kernel (0.5 = all the masked half): "
              + ", ".join(f"{n}: {r:.2f}" for n, r in kr["causal_share"].items()))
        ok = all(r["check_ok"] for r in rows)
    if args.plan:
        print(f"\nusp_hal.plan(cu_seqlens=...) with the shipped cpu profile against measurement (2 ranks, sdpa, "
              f"{args.dtype}, H={args.heads} D={args.head_dim} S={args.seqlen}, causal, forward+backward):")
        for b in plan_check(args):
            print(f"  {b['batch']} {list(b['cu_seqlens'])}: predicted winner {b['predicted_winner']}, measured best "
                  f"{b['measured_best']} (the predicted winner measures {b['winner_within']:.3f}x the best)")
            print(f"    {'configuration':<28} {'predicted ms':>13} {'measured ms':>12} {'pred/meas':>10}  check")
            for r in b["rows"]:
                print(f"    {r['config']:<28} {r['predicted_ms']:>13.1f} {r['measured_ms']:>12.1f} "
                      f"{r['ratio']:>10.2f}  {'pass' if r['check_ok'] else 'FAIL'}")
                ok = ok and r["check_ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
