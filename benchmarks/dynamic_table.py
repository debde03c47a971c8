"""Where the two-dimensional choice pays: the per-batch schedule with Ulysses x Ring groups, with
rings only, with Ulysses only, against static+, from the planner alone (no runs).

    python -m benchmarks.dynamic_table            # the table of docs/dynamic-degree.md (a few minutes)
    python -m benchmarks.dynamic_table --worlds 8 16 --batches 2

For each world size, GPU profile, model and length distribution: ``--batches`` global batches of
about 32K tokens per rank, at most 16,384 tokens per rank in one job, each scheduled (whole-step
prices, usp_hal.planning.stepcost) by

- dynamic U x R: usp_hal.planning.schedule.Scheduler, any Ulysses degree dividing a group (up to the query heads);
- rings only: ``ulysses_degrees=(1,)`` (what Megatron's and verl's dynamic context parallel choose);
- Ulysses only: ``rings=False`` on groups of at most the KV heads (beyond them Ulysses replicates
  KV heads); "n/a" when a sequence needs a larger group;
- static+: every fixed split that holds every batch, placed with the same care, the best one;

each dynamic variant without the fall-back to a fixed split (``margin=0``), so the column is the
schedule itself.  Figures: predicted step time over static+'s (lower is better), summed over the
batches; static+'s split and its time per step beside.  The models: Llama-3-8B (8 KV heads, where
Ulysses alone cannot reach a group of 16) and Llama-2-7B (32 KV heads, full multi-head attention).
"""
from __future__ import annotations

import argparse
import time
from typing import Dict, List, Optional

from usp_hal.planning.schedule import (
    AttentionShape,
    ScheduleError,
    Scheduler,
    compare_with_static,
    draw_batches,
    group_sizes,
)
from usp_hal.planning.stepcost import StepModel

MODELS = {
    "Llama-3-8B (8 KV heads)": AttentionShape(32, 128, 8, "bf16", True, True, hidden=4096, intermediate=14336,
                                              layers=32, vocab=128256),
    "Llama-2-7B (32 KV heads)": AttentionShape(32, 128, 32, "bf16", True, True, hidden=4096, intermediate=11008,
                                               layers=32, vocab=32000),
}
#: the SFT mix of the other benchmarks, and a long-context mix whose long sequences need groups beyond
#: a node (median 64K tokens, up to 512K: at 16,384 tokens per rank, 4 to 32 ranks each)
DISTS = {"llama3-sft": "llama3-sft", "long": "lognormal:65536:524288:1.0"}
BUDGET = 16384
TOKENS_PER_RANK = 32768


_MODELS: Dict[tuple, StepModel] = {}


def row(world: int, profile: str, shape: AttentionShape, dist: str, batches: int, seed: int = 0) -> dict:
    model = _MODELS.get((shape, profile))
    if model is None:       # its price tables serve every world and variant
        model = _MODELS[(shape, profile)] = StepModel(shape, profile, top=BUDGET)
    bs = draw_batches(DISTS[dist], batches, world * TOKENS_PER_RANK, seed=seed)
    if max(map(max, bs)) > BUDGET * world:
        return {"static+": None, "static_ms": None, "dynamic U x R": None, "rings only": None, "Ulysses only": None,
                "why": f"a sequence of {max(map(max, bs))} tokens needs more than {world} ranks"}
    cmp = compare_with_static(bs, world, shape, budget_tokens=BUDGET, model=model)
    best = cmp["best"]
    st = cmp["static"][best]["predicted"] if best else None      # type: ignore[index]
    full = Scheduler(world, shape, budget_tokens=BUDGET, profile=profile, margin=0, model=model)
    variants = {"dynamic U x R": full,
                "rings only": Scheduler(world, shape, budget_tokens=BUDGET, profile=profile, margin=0,
                                        ulysses_degrees=(1,), model=model),
                "Ulysses only": Scheduler(world, shape, budget_tokens=BUDGET, profile=profile, margin=0, rings=False,
                                          sizes=[g for g in group_sizes(world) if g <= (shape.kv_heads or shape.heads)],
                                          model=model)}
    out = {"static+": best, "static_ms": st / batches * 1e3 if st else None}
    for name, sch in variants.items():
        try:
            total = sum(sch.dynamic(b).predicted for b in bs)
            out[name] = total / st if st else None
        except ScheduleError:
            out[name] = None
    return out


VARIANTS = ("dynamic U x R", "rings only", "Ulysses only")


def _cell(r: dict, k: str) -> str:
    """A variant's ratio, bold when it is the best dynamic variant of the row."""
    if r[k] is None:
        return "n/a"
    best = min(r[v] for v in VARIANTS if r[v] is not None)
    return f"**{r[k]:.3f}**" if r[k] == best else f"{r[k]:.3f}"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 64, 256])
    ap.add_argument("--profiles", nargs="+", default=["h100-nvlink", "l40-pcie"])
    ap.add_argument("--dists", nargs="+", default=list(DISTS), choices=list(DISTS))
    ap.add_argument("--batches", type=int, default=2)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    print("| ranks | profile | model | lengths | static+ (split, ms/step) | dynamic U x R | rings only | "
          "Ulysses only |")
    print("|---|---|---|---|---|---|---|---|")
    for dist in args.dists:
        for world in args.worlds:
            for profile in args.profiles:
                for name, shape in MODELS.items():
                    r = row(world, profile, shape, dist, args.batches)
                    st = r.get("why") or ("none fits" if r["static+"] is None else
                                          f"{r['static+']}, {r['static_ms']:.0f}")
                    cells = " | ".join(_cell(r, k) for k in VARIANTS)
                    print(f"| {world} | {profile} | {name} | {dist} | {st} | {cells} |", flush=True)
    print(f"\n({time.monotonic() - t0:.0f} s; predicted step over static+'s, summed over {args.batches} batches per "
          f"row; bold: the best dynamic variant)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
