"""Host time per attention call on a tiny block, where the kernel itself is ~13 us.

1. One rank (this process, one thread): the raw aten CPU op on pre-transposed tensors, the
   sdpa backend's ``forward``, and ``LongContextAttention`` forward (no grad), timed in
   interleaved rounds (each round times every variant over ``--calls`` calls; the figure is
   the best round, and the ratio is taken per round, then its median), against the target
   ``2 x raw + 20 us``.
2. Ulysses-2 (2 spawned gloo ranks, one thread each): per call, ``perf_counter`` around the
   call minus the time spent inside ``torch.distributed`` calls and their ``wait()``
   (``usp_hal.harness.CommMeter``), i.e. the host time the library adds around its two
   all-to-alls and the kernel, against the same call's raw kernel time on the local block
   of heads (measured on the rank between calls).

Run from the repository root:

    python -m benchmarks.per_call_overhead
    PYTHONPATH=path/to/other/tree python -m benchmarks.per_call_overhead   # another tree
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import usp_hal
from usp_hal.backends.sdpa import SDPABackend


def _timed(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def one_rank(calls: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    b = SDPABackend()
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            mesh = usp_hal.init_sequence_parallel(1, 1, set_default=False)
            attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)
            variants = {"raw aten op": lambda: op(qt, kt, vt, 0.0, False, scale=0.3),
                        "sdpa backend forward": lambda: b.forward(q, k, v, softmax_scale=0.3),
                        "LongContextAttention": lambda: attn(q, k, v)}
            times = {name: [] for name in variants}
            with torch.no_grad():
                for fn in variants.values():
                    _timed(fn, 200)
                for _ in range(rounds):
                    for name, fn in variants.items():
                        times[name].append(_timed(fn, calls))
        finally:
            dist.destroy_process_group()
    best = {name: min(ts) for name, ts in times.items()}
    ratio = statistics.median(a / r for a, r in zip(times["LongContextAttention"], times["raw aten op"]))
    target = 2 * best["raw aten op"] + 20
    return {"best_us": best, "median_ratio": ratio, "target_us": target, "met": best["LongContextAttention"] <= target}


def _ulysses_host(calls: int, S: int) -> dict:
    from usp_hal.harness import CommMeter
    mesh = usp_hal.init_sequence_parallel(2, 1, set_default=False)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S // 2, 4, 8, generator=g) for _ in range(3))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qh, kh, vh = (torch.randn(1, 2, S, 8, generator=g) for _ in range(3))   # the local heads, all tokens
    host, kernel = [], []
    with torch.no_grad(), CommMeter() as meter:      # installed once: only its timing runs per call
        for _ in range(20):
            attn(q, k, v)
        for _ in range(calls):
            meter.reset()
            t = time.perf_counter()
            attn(q, k, v)
            total = time.perf_counter() - t
            host.append((total - meter.seconds) * 1e6)
            t = time.perf_counter()
            op(qh, kh, vh, 0.0, False, scale=0.3)
            kernel.append((time.perf_counter() - t) * 1e6)
    return {"host_minus_comm_us": statistics.median(host), "kernel_us": statistics.median(kernel)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--skip-ulysses", action="store_true")
    args = ap.parse_args(argv)
    res = one_rank(args.calls, args.rounds)
    print("one rank, tiny block [1, 16, 2, 8] fp32, forward, best of interleaved rounds:")
    for name, us in res["best_us"].items():
        print(f"  {name:24s} {us:6.1f} us")
    print(f"  median per-round ratio LongContextAttention / raw op: {res['median_ratio']:.2f}")
    print(f"  target 2 x raw + 20 us = {res['target_us']:.1f} us: {'met' if res['met'] else 'NOT met'}")
    if not args.skip_ulysses:
        from benchmarks._ranks import run_on_ranks
        rows = run_on_ranks(_ulysses_host, world=2, calls=500, S=32)
        worst = max(rows, key=lambda r: r["host_minus_comm_us"])
        print("Ulysses-2, [1, 16, 4, 8] per rank, forward: perf_counter around the call minus time inside "
              "torch.distributed calls and waits (median over 500 calls, the slower rank):")
        print(f"  host time without collectives {worst['host_minus_comm_us']:6.1f} us, the kernel alone on the "
              f"rank's heads {worst['kernel_us']:6.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
