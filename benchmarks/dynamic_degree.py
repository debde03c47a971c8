"""The Ulysses x Ring split per global batch against every static split, on 4 ranks.

    python -m benchmarks.dynamic_degree                      # counts, predictions and CPU time
    python -m benchmarks.dynamic_degree --dist llama3-sft    # the second length distribution
    python -m benchmarks.dynamic_degree --no-time            # counts and predictions only

For the same global batches it schedules each one (usp_hal.schedule.schedule_batch) and runs
every static split that holds every batch within the memory budget: U x R over all ranks, and
dp x sp replicas (each packing its sequences).  Per step, as counts that do not depend on load:
the slowest rank's attention work (query-key pairs x heads, forward), the bytes it sends (forward
and backward), and its collectives; then the planner's predicted step time on an NVLink and a
PCIe profile (each schedule made with that profile).  Summed over the steps; for each metric the
best static split is the lowest one.

The wall time runs the schedules for real (forward and backward of attention alone, torch SDPA,
4 gloo ranks on this CPU) at a scaled-down size (--time-scale: lengths, budget and tokens per rank
divided by it, heads 4, head dim 32), dynamic and each static split interleaved step by step,
scheduled with the CPU profile; the ratio is the dynamic's total over the fastest static's.  It
measures this CPU, not a GPU.

Distributions: ``lognormal`` (median 1,024 tokens, sigma 1.5, clipped to [16, 32,768]: the
issue's long tail), and ``llama3-sft`` (the Llama 3 long-context SFT mix as reported in its paper
and quoted by Skrull, arXiv 2505.19609: 99.89% short sequences averaging about 1K tokens, 0.11%
long ones averaging about 37K; the shapes are ours: log-normal, sigma 1.0 and 0.3, clipped to
[16, 65,536]).  Batches hold about --tokens-per-rank tokens per rank, drawn with a fixed seed.
"""
from __future__ import annotations

import argparse
import time
from typing import Dict, List, Optional

from usp_hal.schedule import (
    AttentionShape,
    Schedule,
    compare_with_static,
    draw_batches,
    fitting_static_splits,
    split_label,
    static_schedule,
)

WORLD = 4
PROFILES = ("h100-nvlink", "l40-pcie")
DISTS = {"lognormal": "lognormal:1024:32768:1.5", "llama3-sft": "llama3-sft"}


# ------------------------------------------------------------------------- the wall time (4 ranks)
def _run(sched: Schedule, meshes, rank: int, shape, seed: int, mods: dict) -> None:
    import torch

    import usp_hal
    for job in sched.jobs_of(rank):
        key = (job.size, job.cost.ulysses, job.cost.ring)
        mesh = meshes[key]
        attn = mods.get((key, job.cost.layout))
        if attn is None:
            attn = mods[(key, job.cost.layout)] = usp_hal.LongContextAttention(
                attn_type="sdpa", ring_impl_type=job.cost.layout, mesh=mesh)
        total = sum(job.lengths)
        g = torch.Generator().manual_seed(seed + job.seqs[0])
        q, k, v = (torch.randn(1, total, n, shape.head_dim, generator=g)
                   for n in (shape.heads, shape.kv_heads, shape.kv_heads))
        cu = job.cu_seqlens
        q, k, v = (usp_hal.shard(x, layout=job.cost.layout, mesh=mesh, cu_seqlens=cu).requires_grad_()
                   for x in (q, k, v))
        out = attn(q, k, v, causal=shape.causal, cu_seqlens=cu) if cu else attn(q, k, v, causal=shape.causal)
        out.sum().backward()


def timed_ranks(dist: str, steps: int, tokens_per_rank: int, budget: int, seed: int, scale: int,
                statics: list) -> dict:
    """On each of 4 ranks: every step's dynamic and static schedules run in turn (the order
    rotating each step), each timed after a barrier; returns seconds per variant per step."""
    import torch.distributed as dist_

    from usp_hal.dynamic import DynamicDegree
    shape = AttentionShape(4, 32, 2, "fp32", True, True)
    dd = DynamicDegree(shape, budget_tokens=budget, profile="cpu")
    rank = dist_.get_rank()
    bs = draw_batches(DISTS[dist], steps + 1, WORLD * tokens_per_rank, seed=seed, scale=scale)
    variants = ["dynamic"] + [split_label(WORLD, u, r) for u, r in statics]
    times: Dict[str, List[float]] = {v: [] for v in variants}
    mods: dict = {}
    for step, b in enumerate(bs):
        scheds = {"dynamic": dd.schedule(b, global_batch=True)}
        for u, r in statics:
            scheds[split_label(WORLD, u, r)] = static_schedule(b, WORLD, shape, ulysses=u, ring=r, budget_tokens=budget,
                                                      profile="cpu")
        order = variants[step % len(variants):] + variants[:step % len(variants)]
        for name in order:
            dist_.barrier()
            t0 = time.perf_counter()
            _run(scheds[name], dd.meshes, rank, shape, seed * 1000 + step, mods)
            dist_.barrier()
            if step:                       # the first step warms every path up
                times[name].append(time.perf_counter() - t0)
    return times


# ------------------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dist", default="lognormal", choices=("lognormal", "llama3-sft"))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--tokens-per-rank", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=16384,
                    help="most tokens one rank holds in one job (default: half the longest lognormal sequence)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the schedules on 4 gloo ranks here (scaled down) for the wall-time ratio")
    ap.add_argument("--time-scale", type=int, default=32)
    ap.add_argument("--time-steps", type=int, default=6)
    args = ap.parse_args(argv)
    shape = AttentionShape(args.heads, args.head_dim, args.kv_heads, "bf16", True, True)
    bs = draw_batches(DISTS[args.dist], args.steps, WORLD * args.tokens_per_rank, seed=args.seed)
    n_seq = sum(len(b) for b in bs)
    print(f"{args.dist} ({DISTS[args.dist]}): {args.steps} global batches on {WORLD} ranks, {n_seq / args.steps:.0f} "
          f"sequences and {sum(map(sum, bs)) / args.steps / WORLD:.0f} tokens per rank per step, longest "
          f"{max(map(max, bs))}; budget {args.budget} tokens per rank; H={args.heads} Hkv={args.kv_heads} "
          f"D={args.head_dim} bf16 causal, forward+backward")
    ratio: Dict[str, float] = {}
    for prof in PROFILES:
        cmp = compare_with_static(bs, WORLD, shape, budget_tokens=args.budget, profile=prof)
        rows: Dict[str, Dict[str, float]] = cmp["static"]     # type: ignore[assignment]
        print(f"\n{prof}: per step, the slowest rank's   work (G pairs)   bytes (GB)   collectives   predicted (ms)")
        for name, t in [("dynamic", cmp["dynamic"])] + sorted(rows.items()):
            print(f"  {name:22s} {t['pairs'] / args.steps / 1e9:16.2f} {t['bytes'] / args.steps / 1e9:12.3f} "
                  f"{t['collectives'] / args.steps:13.1f} {t['predicted'] / args.steps * 1e3:15.2f}")
        for k, r in cmp["ratio"].items():       # type: ignore[union-attr]
            print(f"  dynamic / best static {k}: {'n/a' if r is None else f'{r:.3f}'}")
            ratio[k] = max(ratio.get(k, 0.0), float("inf") if r is None else r)     # the worse of the two profiles
    time_ratio = float("nan")
    if args.time:
        from benchmarks._ranks import run_on_ranks
        sc = args.time_scale
        tb = draw_batches(DISTS[args.dist], args.time_steps + 1, WORLD * args.tokens_per_rank // sc, seed=args.seed,
                          scale=sc)
        tstatics = list(fitting_static_splits(tb, WORLD, AttentionShape(4, 32, 2, "fp32", True, True),
                                              budget_tokens=args.budget // sc, profile="cpu"))
        res = run_on_ranks(timed_ranks, world=WORLD, dist=args.dist, steps=args.time_steps,
                           tokens_per_rank=args.tokens_per_rank // sc, budget=args.budget // sc, seed=args.seed,
                           scale=sc, statics=tstatics)
        slow = {v: [max(r[v][i] for r in res) for i in range(len(res[0][v]))] for v in res[0]}
        tot = {v: sum(x) for v, x in slow.items()}
        print(f"\nwall time on this CPU, 4 gloo ranks, sizes / {sc} (H=4 Hkv=2 D=32 fp32), {args.time_steps} steps "
              f"interleaved, slowest rank's seconds per step:")
        for v, t in tot.items():
            print(f"  {v:22s} {t / len(slow[v]) * 1e3:9.1f} ms")
        best = min(t for v, t in tot.items() if v != "dynamic")
        time_ratio = tot["dynamic"] / best
    print(f"\ndynamic/best-static slowest-rank work={ratio['pairs']:.3f} bytes={ratio['bytes']:.3f} "
          f"predicted={ratio['predicted']:.3f} time={time_ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
