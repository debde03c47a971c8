"""Masks: work balance per layout, from the masked block plan (pure, no process group).

For random masks of each family (parameters drawn per mask, seeded), the work of ring rank
r = the (query, key) pairs its rows score under the mask (``usp_hal.sequence.masks.mask_work``), and
the figure per layout is worst/mean over ranks (1.00 = perfect).  ``balanced`` is
``usp_hal.sequence.masks.balanced_layout`` (chunks handed out by mask area, a greedy min-heap, equal
token counts per rank); ``basic`` and ``zigzag`` are the fixed layouts.  Also printed: the
share of the S x S tiles the plan skips, runs without a mask, and runs with one.

Run from the repository root:

    python -m benchmarks.mask_balance                      # S=4096, ring 2/4/8, 8 masks per family
    python -m benchmarks.mask_balance --seqlen 8192 --draws 20
"""
from __future__ import annotations

import argparse
import random
import sys

import torch

from usp_hal.sequence import masks as M
from usp_hal.sequence.positions import ring_segments


def draw(family: str, S: int, rng: random.Random) -> "tuple[M.Mask, bool]":
    """(mask, causal) of one random mask of a family."""
    if family == "prefix_lm":
        return M.prefix_lm(rng.randint(S // 16, S // 2)), False
    if family == "block_causal":
        return M.block_causal(rng.choice([64, 128, 256, 512])), False
    if family == "chunked_local":
        return M.chunked_local(rng.choice([256, 384, 512, 1024, 1536])), False
    if family == "block_sparse":
        return M.random_block_sparse(S, 64, rng.uniform(0.1, 0.5), seed=rng.randint(0, 10 ** 6)), True
    if family == "documents_causal":   # packed documents x causal (a mask, not cu_seqlens)
        cuts = sorted(rng.sample(range(1, S), rng.randint(2, 12)))
        bounds = torch.tensor(cuts)

        def docs_causal(b, h, q, kv):
            return (torch.bucketize(q, bounds, right=True) == torch.bucketize(kv, bounds, right=True)) & (kv <= q)
        return M.Mask(fn=docs_causal, name="documents_causal", key=tuple(cuts)), False
    raise KeyError(family)


FAMILIES = ("prefix_lm", "block_causal", "chunked_local", "block_sparse", "documents_causal")


def figures(mask, causal, S, R):
    pred = M.Predicate(mask, causal=causal)
    out = {}
    for name in ("basic", "zigzag", "balanced"):
        if name == "balanced":
            lay = M.balanced_layout(mask, S, R, causal=causal, register=False)
            segs = [lay.segments(S, R, r) for r in range(R)]
        else:
            segs = [ring_segments(name, S, R, r) for r in range(R)]
        work = M.mask_work(pred, segs)
        mean = sum(work) / R
        out[name] = max(work) / mean if mean else 1.0
    tile = M.tile_size(S)
    t = pred.tiles(S, tile)
    n = t.numel()
    out["tiles"] = tuple(float((t == k).sum()) / n for k in (M.EMPTY, M.FULL, M.PARTIAL))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--rings", default="2,4,8")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    S = args.seqlen
    rings = [int(x) for x in args.rings.split(",")]
    rng = random.Random(args.seed)
    print(f"S={S}, {args.draws} random masks per family; worst/mean work over ring ranks (max over masks)")
    print(f"{'family':<18}{'R':>3}{'basic':>9}{'zigzag':>9}{'balanced':>10}   tiles empty/full/partial")
    worst_balanced = 1.0
    for fam in FAMILIES:
        masks = [draw(fam, S, rng) for _ in range(args.draws)]
        for R in rings:
            rows = [figures(m, c, S, R) for m, c in masks]
            b = {k: max(r[k] for r in rows) for k in ("basic", "zigzag", "balanced")}
            tiles = tuple(sum(r["tiles"][i] for r in rows) / len(rows) for i in range(3))
            worst_balanced = max(worst_balanced, b["balanced"])
            print(f"{fam:<18}{R:>3}{b['basic']:>9.2f}{b['zigzag']:>9.2f}{b['balanced']:>10.2f}   "
                  f"{tiles[0]:.2f}/{tiles[1]:.2f}/{tiles[2]:.2f}")
    print(f"worst balanced_layout figure over every mask and ring size: {worst_balanced:.3f} (target <= 1.10)")
    return 0 if worst_balanced <= 1.10 else 1


if __name__ == "__main__":
    sys.exit(main())
