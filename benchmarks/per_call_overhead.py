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

3. No communication at all (``--fake``, or ``--fake-only``): Ulysses-2 and Ring-2 as rank 0 of
   torch's ``fake`` process group (one process; every collective returns at once, having
   copied its input into its output), so what is timed is host work alone, free of this
   machine's gloo slowdowns: usp-hal (the default, and ``static_shapes=True``), yunchang
   0.6.4 given the same CPU kernel (``attn_processor``, when installed), the floor (the
   kernel on the rank's block plus the bare ``torch.distributed`` calls the call must make)
   and, for Ulysses, the same tensor ops as usp-hal's forward written out by hand with
   nothing around them, all in interleaved rounds.

Run from the repository root:

    python -m benchmarks.per_call_overhead
    python -m benchmarks.per_call_overhead --fake-only     # part 3 alone
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
from usp_hal import KernelCall
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
                        "sdpa backend forward": lambda: b.forward(q, k, v, KernelCall(scale=0.3)),
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


def _fake_host(U: int, R: int, calls: int, rounds: int, S: int = 32) -> dict:
    """Part 3 (run in a fresh process: it installs the fake group and wraps one dist call)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=U * R)
    bare_a2a = dist.all_to_all_single

    def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        # the fake group copies input into output and wants one shape: give it flat views (as many bytes)
        return bare_a2a(output.view(-1), input.reshape(-1), None, None, group=group, async_op=async_op)
    dist.all_to_all_single = a2a
    mesh = usp_hal.init_sequence_parallel(U, R, set_default=False)
    H, D, n = 8, 8, S // (U * R)
    q, k, v = (torch.randn(1, n, H, D) for _ in range(3))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    variants = {"usp-hal": usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh),
                "usp-hal static_shapes": usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh,
                                                                      static_shapes=True)}
    calls_of = {name: (lambda m=m: m(q, k, v)) for name, m in variants.items()}
    try:
        from yunchang import LongContextAttention as YunchangAttention
        from yunchang import set_seq_parallel_pg

        from usp_hal.harness.cases import yunchang_cpu_processor
        set_seq_parallel_pg(U, R, 0, U * R)
        yc = YunchangAttention(ring_impl_type="basic", attn_type=None, attn_processor=yunchang_cpu_processor)
        calls_of["yunchang (same kernel)"] = lambda: yc(q, k, v)
    except ImportError:
        pass
    meta, gathered = torch.zeros(25, dtype=torch.long), torch.empty(25 * U * R, dtype=torch.long)
    if U > 1:       # the floor: two all-to-alls (q/k/v in, out back), one metadata all-gather, the kernel
        hq = H // U
        send, recv = torch.randn(U, n, 1, 3 * hq, D), torch.empty(U * n, 1, 3 * hq, D)
        kq, kk, kv = (torch.randn(1, hq, U * n, D) for _ in range(3))

        def floor():
            dist.all_gather_into_tensor(gathered, meta)
            dist.all_to_all_single(recv, send, [n] * U, [1] * U)
            op(kq, kk, kv, 0.0, False, scale=0.3)
            dist.all_to_all_single(recv, send, [n] * U, [1] * U)

        grp = mesh.ulysses_group
        w, S = H // U, U * n
        by_dest = ((U, n, 1, w, D), (w * D, H * D, n * H * D, D, 1))   # [U, s, B, w, D] view of [1, s, H, D]

        def by_hand():
            """The same tensor ops as usp-hal's Ulysses forward, written out with nothing around them."""
            dist.all_gather_into_tensor(gathered, meta)
            buf = torch.cat([x.as_strided(*by_dest) for x in (q, k, v)], 3)
            got = torch.empty((S, 1, 3 * w, D))
            dist.all_to_all_single(got, buf, [n] * U, [1] * U, group=grp)
            qh, kh, vh = got.permute(1, 0, 2, 3).split_with_sizes([w, w, w], 2)
            out = op(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), 0.0, False, scale=0.3)[0]
            back = torch.empty((U, n, 1, w, D))
            dist.all_to_all_single(back, out.transpose(1, 2).transpose(0, 1), [1] * U, [n] * U, group=grp)
            res = torch.empty((1, n, H, D))
            res.as_strided(*by_dest).copy_(back)
            return res
        calls_of["by hand: the same ops, no library"] = by_hand
    else:           # one K/V exchange per step, one kernel per step (no merge counted)
        kq, kk, kv = (torch.randn(1, H, n, D) for _ in range(3))
        kvbuf, kvrecv = torch.randn(2, 1, n, H, D), torch.empty(2, 1, n, H, D)

        def floor():
            dist.all_gather_into_tensor(gathered, meta)
            for _ in range(R - 1):
                ops = [dist.P2POp(dist.isend, kvbuf, 1), dist.P2POp(dist.irecv, kvrecv, R - 1)]
                works = dist.batch_isend_irecv(ops)
                for w in works:
                    w.wait()
            for _ in range(R):
                op(kq, kk, kv, 0.0, False, scale=0.3)
    calls_of["floor: kernel + bare collectives"] = floor
    times: dict = {name: [] for name in calls_of}
    with torch.no_grad():
        for fn in calls_of.values():
            _timed(fn, 100)
        for _ in range(rounds):
            for name, fn in calls_of.items():
                times[name].append(_timed(fn, calls))
    dist.destroy_process_group()
    return {name: (min(ts), statistics.median(ts)) for name, ts in times.items()}


def fake_host_report(calls: int = 400, rounds: int = 9) -> str:
    import json
    import subprocess
    import sys
    lines = ["no communication (torch's fake group, rank 0 of 2, one process), [1, 16, 8, 8] per rank, forward, "
             f"best and median of {rounds} interleaved rounds of {calls} calls:"]
    for U, R in ((2, 1), (1, 2)):
        code = ("import json, benchmarks.per_call_overhead as b; "
                f"print('RESULT', json.dumps(b._fake_host({U}, {R}, {calls}, {rounds})))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        res = json.loads(out.split("RESULT", 1)[1])
        lines.append(f"  {'Ulysses-2' if U > 1 else 'Ring-2'}:")
        for name, (best, med) in res.items():
            lines.append(f"    {name:34s} best {best:7.1f} us  median {med:7.1f} us")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--skip-ulysses", action="store_true")
    ap.add_argument("--fake", action="store_true", help="also time part 3 (no communication)")
    ap.add_argument("--fake-only", action="store_true", help="time part 3 alone")
    args = ap.parse_args(argv)
    if args.fake_only:
        print(fake_host_report())
        return 0
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
    if args.fake:
        print(fake_host_report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
