"""Error of the fp8 wire format against full precision, per dtype and path, on 2 gloo ranks:
RMS(err)/RMS(ref) and max|err|/max|ref| of the gathered output against float64 attention on
the same inputs (random normal, B=1, S=1024, H=8, D=64, causal, zigzag).

    python benchmarks/fp8_report.py
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import run_on_ranks  # noqa: E402

from tests.dist_fp8 import fp8_accuracy  # noqa: E402

PATHS = [("Ulysses-2, q/v/out fp8", dict(U=2, R=1)),
         ("Ulysses-2, q/k/v/out fp8", dict(U=2, R=1, key=True)),
         ("Ring-2, V blocks fp8", dict(U=1, R=2, ring=True)),
         ("Ring-2, K and V blocks fp8", dict(U=1, R=2, ring=True, key=True))]


def main():
    print("fp8 wire format vs full precision (2 ranks, S=1024, H=8, D=64, causal, zigzag)")
    print(f"{'path':28s} {'dtype':6s} {'rms err/rms ref':>16s} {'max err/max ref':>16s}")
    for label, kw in PATHS:
        for dtype in ("bf16", "fp16", "fp32"):
            r = run_on_ranks(fp8_accuracy, 2, dtype=dtype, S=1024, **kw)[0]
            print(f"{label:28s} {dtype:6s} {r['rms'] * 100:15.2f}% {r['max'] * 100:15.2f}%")


if __name__ == "__main__":
    main()
