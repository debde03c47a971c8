"""Bytes each rank sends for a depthwise causal convolution over sequence shards: the halo
exchange (``usp_hal.mixers.head_parallel.halo_causal_conv``: the kernel_size - 1 tokens before each of a
rank's runs) against the head-parallel region (``usp_hal.head_parallel``: every channel's
whole sequence to the rank that owns it and back), forward and backward, measured with
``usp_hal.harness.CommMeter`` on spawned gloo ranks (Ring-R, zigzag, fp32, B=1, C=64, K=4),
with the time of one forward + backward (median of 3, after one warm-up).

Run from the repository root:

    python -m benchmarks.hybrid_bytes                  # R=2 and R=4, S = 4k, 16k, 64k
    python -m benchmarks.hybrid_bytes --lengths 4096 --rings 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import usp_hal
from benchmarks._ranks import run_on_ranks


def job(R=2, lengths=(4096,), C=64, K=4):
    from usp_hal.harness import CommMeter
    from usp_hal.mixers.head_parallel import halo_causal_conv, head_parallel

    mesh = usp_hal.init_sequence_parallel(1, R, set_default=False)
    torch.manual_seed(0)
    w = torch.randn(C, K, requires_grad=True)

    def conv(x, heads):      # the same depthwise causal conv on the full sequence of some channels
        sl = slice(heads.start, heads.stop)
        y = torch.nn.functional.conv1d(x.squeeze(-1).transpose(1, 2), w[sl].unsqueeze(1), padding=K - 1,
                                       groups=heads.stop - heads.start)[..., :x.shape[1]]
        return y.transpose(1, 2).unsqueeze(-1)

    ways = {"halo": lambda x: halo_causal_conv(x, w, mesh=mesh, layout="zigzag"),
            "head_parallel": lambda x: head_parallel(conv, x.unsqueeze(-1), mesh=mesh, layout="zigzag",
                                                     with_heads=True).squeeze(-1)}
    out = []
    for S in lengths:
        x = usp_hal.shard(torch.randn(1, S, C), layout="zigzag", mesh=mesh).requires_grad_(True)
        for name, fn in ways.items():
            fn(x).sum().backward()               # warm-up (plans, buffers)
            with CommMeter() as meter:
                fn(x).sum().backward()
            times = []
            for _ in range(3):
                t = time.perf_counter()
                fn(x).sum().backward()
                times.append(time.perf_counter() - t)
            out.append({"S": S, "way": name, "bytes": sum(meter.bytes.values()),
                        "metadata": meter.metadata_bytes, "ms": 1000 * statistics.median(times)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--rings", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    print(f"{'R':>2} {'S':>6} {'way':>14} {'bytes sent (max rank)':>22} {'ms fwd+bwd (max rank)':>22}")
    for R in args.rings:
        res = run_on_ranks(job, world=R, R=R, lengths=tuple(args.lengths))
        for i, row in enumerate(res[0]):
            worst = max(r[i]["bytes"] for r in res)
            ms = max(r[i]["ms"] for r in res)
            print(f"{R:>2} {row['S']:>6} {row['way']:>14} {worst:>22,} {ms:>22.2f}")


if __name__ == "__main__":
    main()
