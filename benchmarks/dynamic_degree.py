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
import math
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from usp_hal.schedule import AttentionShape, Schedule, ScheduleError, schedule_batch, static_schedule

WORLD = 4
PROFILES = ("h100-nvlink", "l40-pcie")
STATIC = [(u, sp // u, sp) for sp in (4, 2, 1) for u in range(sp, 0, -1) if sp % u == 0]   # (U, R, sp)


def _lognormal_mean(rng, mean: float, sigma: float) -> float:
    return float(rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma))


def draw(dist: str, rng) -> int:
    if dist == "lognormal":
        return int(min(max(rng.lognormal(math.log(1024), 1.5), 16), 32768))
    if dist == "llama3-sft":
        x = _lognormal_mean(rng, 37000, 0.3) if rng.random() < 0.0011 else _lognormal_mean(rng, 1000, 1.0)
        return int(min(max(x, 16), 65536))
    raise ValueError(f"unknown distribution {dist!r}: lognormal or llama3-sft")


def batches(dist: str, steps: int, tokens_per_rank: int, seed: int, scale: int = 1) -> List[List[int]]:
    """``steps`` global batches of about ``WORLD * tokens_per_rank`` tokens (lengths / ``scale``)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        b: List[int] = []
        while sum(b) < WORLD * tokens_per_rank:
            b.append(max(1, draw(dist, rng) // scale))
        out.append(b)
    return out


def fitting_statics(bs: List[List[int]], shape, budget: int) -> List[Tuple[int, int, int]]:
    """The static splits that hold every batch within the budget."""
    ok = []
    for u, r, sp in STATIC:
        try:
            for b in bs:
                static_schedule(b, WORLD, shape, ulysses=u, ring=r, budget_tokens=budget, profile="cpu")
        except ScheduleError:
            continue
        ok.append((u, r, sp))
    return ok


def totals(scheds: List[Schedule]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for s in scheds:
        for k, v in s.slowest().items():
            out[k] = out.get(k, 0.0) + v
    return out


def label(u: int, r: int, sp: int) -> str:
    dp = WORLD // sp
    name = "one rank" if sp == 1 else f"U{u}xR{r}"
    return f"dp{dp} x {name}" if dp > 1 else name


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
    bs = batches(dist, steps + 1, tokens_per_rank, seed, scale=scale)
    variants = ["dynamic"] + [label(*s) for s in statics]
    times: Dict[str, List[float]] = {v: [] for v in variants}
    mods: dict = {}
    for step, b in enumerate(bs):
        scheds = {"dynamic": dd.schedule(b, global_batch=True)}
        for u, r, sp in statics:
            scheds[label(u, r, sp)] = static_schedule(b, WORLD, shape, ulysses=u, ring=r, budget_tokens=budget,
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
    bs = batches(args.dist, args.steps, args.tokens_per_rank, args.seed)
    statics = fitting_statics(bs, shape, args.budget)
    n_seq = sum(len(b) for b in bs)
    print(f"{args.dist}: {args.steps} global batches on {WORLD} ranks, {n_seq / args.steps:.0f} sequences and "
          f"{sum(map(sum, bs)) / args.steps / WORLD:.0f} tokens per rank per step, longest {max(map(max, bs))}; "
          f"budget {args.budget} tokens per rank; H={args.heads} Hkv={args.kv_heads} D={args.head_dim} bf16 causal, "
          f"forward+backward")
    print(f"static splits within the budget: {', '.join(label(*s) for s in statics) or 'none'}")
    ratio: Dict[str, float] = {}
    for prof in PROFILES:
        dyn = totals([schedule_batch(b, WORLD, shape, budget_tokens=args.budget, profile=prof) for b in bs])
        rows = {label(*s): totals([static_schedule(b, WORLD, shape, ulysses=s[0], ring=s[1],
                                                   budget_tokens=args.budget, profile=prof) for b in bs])
                for s in statics}
        print(f"\n{prof}: per step, the slowest rank's   work (G pairs)   bytes (GB)   collectives   predicted (ms)")
        for name, t in [("dynamic", dyn)] + sorted(rows.items()):
            print(f"  {name:22s} {t['pairs'] / args.steps / 1e9:16.2f} {t['bytes'] / args.steps / 1e9:12.3f} "
                  f"{t['collectives'] / args.steps:13.1f} {t['predicted'] / args.steps * 1e3:15.2f}")
        for k in ("pairs", "bytes", "collectives", "predicted"):
            best = min(t[k] for t in rows.values()) if rows else float("nan")
            r = dyn[k] / best if best else float("inf")
            ratio[k] = max(ratio.get(k, 0.0), r)      # the worse of the two profiles
            print(f"  dynamic / best static {k}: {r:.3f}")
    time_ratio = float("nan")
    if args.time:
        from benchmarks._ranks import run_on_ranks
        sc = args.time_scale
        tb = batches(args.dist, args.time_steps + 1, args.tokens_per_rank // sc, args.seed, scale=sc)
        tshape = AttentionShape(4, 32, 2, "fp32", True, True)
        tstatics = fitting_statics(tb, tshape, args.budget // sc)
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
