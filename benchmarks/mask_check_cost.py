"""What the mask check costs a steady masked call (one process, no process group).

Per call, the steady state (same global length and mask state as the last masked call) adds
``Mask.state()`` (the walk over what the mask function reads, to notice changed data) and a
dictionary lookup; the mask is not evaluated and no collective is added (the digest travels
in the call's metadata agreement).  Printed: ``Mask.state()`` per mask form (min and median
of 2000), the first call (which classifies the mask and digests it) and a steady call (min
of 40), and how many times the mask function ran over the steady calls.

Run from the repository root:

    python -m benchmarks.mask_check_cost
    python -m benchmarks.mask_check_cost --seqlen 4096
"""
from __future__ import annotations

import argparse
import functools
import time

import torch

import usp_hal
from usp_hal.sequence import masks as M


class _Chunk:
    def __init__(self, n):
        self.n = n

    def __call__(self, b, h, q, kv):
        return kv // self.n == q // self.n


def _chunk(b, h, q, kv, n):
    return kv // n == q // n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=1024)
    args = ap.parse_args()
    S, H, D = args.seqlen, 4, 64
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D, generator=g) for _ in range(3))
    docs = torch.arange(S) // max(1, S // 10)

    def doc_mod(b, h, qi, kv):
        return docs[qi] == docs[kv]
    forms = {"helper chunked_local": M.chunked_local(S // 8), "closure over a tensor": M.Mask.from_mod(doc_mod),
             "functools.partial": M.Mask.from_mod(functools.partial(_chunk, n=S // 8)),
             "callable object": M.Mask.from_mod(_Chunk(S // 8))}
    for name, m in forms.items():
        ss = []
        for _ in range(2000):
            t0 = time.perf_counter()
            m.state()
            ss.append(time.perf_counter() - t0)
        attn = usp_hal.LongContextAttention(attn_type="sdpa")
        t0 = time.perf_counter()
        attn(q, k, v, mask=m)
        first = time.perf_counter() - t0
        attn(q, k, v, mask=m)
        runs = [0]
        keep = M.Mask.keep

        def counting(self, *a, _runs=runs, _keep=keep, **kw):
            _runs[0] += 1
            return _keep(self, *a, **kw)
        M.Mask.keep = counting            # type: ignore[method-assign]
        ts = []
        try:
            for _ in range(40):
                t0 = time.perf_counter()
                attn(q, k, v, mask=m)
                ts.append(time.perf_counter() - t0)
        finally:
            M.Mask.keep = keep            # type: ignore[method-assign]
        ss.sort()
        print(f"{name:24s} Mask.state() min {ss[0] * 1e6:5.1f} us, median {ss[len(ss) // 2] * 1e6:5.1f} us; "
              f"first call {first * 1e3:7.1f} ms; steady call min {min(ts) * 1e3:6.1f} ms; "
              f"mask evaluations over 40 steady calls: {runs[0]}")


if __name__ == "__main__":
    main()
