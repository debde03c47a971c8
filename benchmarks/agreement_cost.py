"""What the per-call cross-rank check costs: one small call, timed with
``check_ranks="every_call"`` (the default: one metadata all-gather before every call),
``"off"`` (the lengths are still exchanged) and ``"first_call"`` (checked once, then no
host collective), in interleaved rounds on 2
spawned gloo ranks.  Ring-2, basic layout, fp32, B=1, H=8, D=64, forward.  Then the latency
of one bare all-gather of the check's size, alone, on the same ranks.

Run from the repository root:

    python -m benchmarks.agreement_cost            # S=512
    python -m benchmarks.agreement_cost --seqlen 1024
    python -m benchmarks.agreement_cost --ulysses      # Ulysses-2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import usp_hal
from benchmarks._ranks import run_on_ranks


def job(S=512, U=1, R=2, rounds=40, calls=5):
    """Ring-2 by default; ``U=2, R=1`` for Ulysses-2."""
    mesh = usp_hal.init_sequence_parallel(U, R, set_default=False)
    mods = {f"check_ranks={mode!r}": usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh, check_ranks=mode)
            for mode in ("every_call", "off", "first_call")}
    q, k, v = (torch.randn(1, S // (U * R), 8, 64) for _ in range(3))
    times: dict = {name: [] for name in mods}
    with torch.no_grad():
        for _ in range(5):
            for m in mods.values():
                m(q, k, v)
        for _ in range(rounds):
            for name, m in mods.items():
                t = time.perf_counter()
                for _ in range(calls):
                    m(q, k, v)
                times[name].append((time.perf_counter() - t) / calls * 1e3)
    res = {name: statistics.median(ts) for name, ts in times.items()}
    # what one bare host collective of the check's size costs here, alone (no attention around it)
    meta, out = torch.zeros(25, dtype=torch.long), torch.empty(25 * dist.get_world_size(), dtype=torch.long)
    lat = []
    for _ in range(200):
        t = time.perf_counter()
        dist.all_gather_into_tensor(out, meta)
        lat.append((time.perf_counter() - t) * 1e3)
    res["one bare 25-int all-gather"] = statistics.median(lat)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--ulysses", action="store_true", help="Ulysses-2 instead of Ring-2")
    args = ap.parse_args(argv)
    U, R = (2, 1) if args.ulysses else (1, 2)
    rows = run_on_ranks(job, world=2, S=args.seqlen, U=U, R=R)
    print(f"{'Ulysses' if args.ulysses else 'Ring'}-2, S={args.seqlen}, forward: median ms per call over "
          "interleaved rounds (the slower rank)")
    for name in rows[0]:
        print(f"  {name:30s} {max(r[name] for r in rows):7.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
