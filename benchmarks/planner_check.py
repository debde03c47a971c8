"""Re-measure with ``usp-hal bench`` and compare against ``usp-hal plan``'s predictions.

    python benchmarks/planner_check.py                       # 2 ranks, S 1024..8192, ~7 min on 2 cores
    python benchmarks/planner_check.py --quick               # S 1024,2048 only
    python benchmarks/planner_check.py --calibrate           # measure a fresh profile first
    python benchmarks/planner_check.py --from-json tests/data/planner_bench_cpu_2ranks.json

Prints, per group (S x mode x mask), every configuration's measured and predicted time,
their ratio, whether the predicted order holds up to the bench's run-to-run spread, and a
summary (groups in order, predicted winner within the spread of the measured best, rows
within +-25%).  The profile is never fitted to the bench: it comes from ``--profile`` (default
the shipped ``cpu``) or from ``--calibrate``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from usp_hal.planning import planner  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seqlens", default="1024,2048,4096,8192")
    p.add_argument("--quick", action="store_true", help="S 1024,2048 only")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--profile", default=None, help="profile name or path (default: cpu, or cpu-4ranks for 4)")
    p.add_argument("--calibrate", action="store_true", help="calibrate a fresh profile first (~30 s)")
    p.add_argument("--from-json", default=None, help="compare a recorded bench JSON instead of measuring")
    p.add_argument("--out", default=None, help="also write the bench JSON here")
    args = p.parse_args(argv)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    prof = args.profile or ("cpu" if args.nproc == 2 else "cpu-4ranks")
    with tempfile.TemporaryDirectory() as tmp:
        if args.calibrate:
            path = os.path.join(tmp, "profile.json")
            subprocess.run([sys.executable, "-m", "usp_hal", "plan", "--calibrate", "--nproc", str(args.nproc),
                            "--dtype", "fp32", "--head-dim", "64", "--world", str(args.nproc), "--heads",
                            str(args.heads), "--seqlen", "1024", "--save", path], check=True, env=env, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
            prof = planner.load_profile(path)
        if args.from_json:
            with open(args.from_json) as f:
                rep = json.load(f)
        else:
            out = args.out or os.path.join(tmp, "bench.json")
            seqlens = "1024,2048" if args.quick else args.seqlens
            splits = ["--ring-impls", "basic,zigzag,stripe", "--rotations", "p2p,allgather"]
            subprocess.run([sys.executable, "-m", "usp_hal", "bench", "--nproc", str(args.nproc), "--seqlens", seqlens,
                            "--modes", "fwd,fwdbwd", "--causal", "both", *splits, "--heads", str(args.heads),
                            "--check", "none", "--no-baseline", "--iters", str(args.iters), "--warmup", "1",
                            "--quiet", "--json", out], check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
            with open(out) as f:
                rep = json.load(f)
        res = planner.compare_bench(rep, prof)
    name = prof if isinstance(prof, str) else prof.get("name")
    print(f"profile {name}; bench: {rep['meta'].get('command')}")
    print(f"{'group':22s} {'config':24s} {'measured ms':>12s} {'predicted ms':>13s} {'ratio':>6s} {'spread':>7s}")
    ordered = near = rows = within = 0
    for g in res:
        for r in g["rows"]:
            rows += 1
            within += abs(r["ratio"] - 1) <= 0.25
            print(f"{g['group']:22s} {r['config']:24s} {r['measured'] * 1e3:12.1f} {r['predicted'] * 1e3:13.1f} "
                  f"{r['ratio']:6.2f} {r['spread']:7.2f}")
        best = min(g["rows"], key=lambda r: r["measured"])
        pick = min(g["rows"], key=lambda r: r["predicted"])
        ok_pick = pick["measured"] / best["measured"] - 1 <= max(g["spread"], pick["spread"], best["spread"])
        ordered += g["order_ok"]
        near += ok_pick
        bad = [d for d in g["discordant"] if not d["within_spread"]]
        print(f"  -> order {'holds' if g['order_ok'] else 'BREAKS'} up to the spread ({g['spread']:.2f})"
              + ("" if not bad else ": " + "; ".join(f"{a} vs {b} measured {d['measured_gap']:.0%} apart"
                                                     for d in bad for a, b in [d["pair"]])))
    print(f"\nsummary: {ordered}/{len(res)} groups in order up to the spread; predicted winner within the spread "
          f"of the measured best in {near}/{len(res)}; {within}/{rows} rows within +-25%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
