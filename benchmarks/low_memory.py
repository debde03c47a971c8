"""What ``LongContextAttention(low_memory=...)`` saves and costs: per-rank peak memory above the
inputs and time of one forward+backward, the default module and the low-memory one side by
side in interleaved rounds (the order alternates per round), plus the same call in one process
holding the whole sequence.  fp32, B=1, H=8, D=64; causal zigzag unless told otherwise.

    python -m benchmarks.low_memory --ulysses 2 --ring 1
    python -m benchmarks.low_memory --ulysses 1 --ring 2 --no-causal --layout basic --rounds 3

Memory: usp_hal.harness.meter.MemoryMeter (what ``usp-hal run`` reports), on one extra,
untimed iteration per module.  Time: the slower rank per round; the ratio is the median over
rounds of low / default.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._ranks import run_on_ranks


def _inputs(S, H, D, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, S, H, D, generator=g) for _ in range(4)]


def job(U=1, R=2, S=4096, H=8, D=64, rounds=5, low=True, causal=True, layout="zigzag"):
    import torch.distributed as dist

    import usp_hal
    from usp_hal.harness import meter
    mesh = usp_hal.init_sequence_parallel(U, R, set_default=False)
    q, k, v, dout = _inputs(S, H, D)
    ql, kl, vl = (usp_hal.shard(x, layout=layout, mesh=mesh).contiguous().requires_grad_() for x in (q, k, v))
    dl = usp_hal.shard(dout, layout=layout, mesh=mesh).contiguous()
    del q, k, v, dout
    mods = {"default": usp_hal.LongContextAttention(ring_impl_type=layout, attn_type="sdpa", mesh=mesh),
            "low_memory": usp_hal.LongContextAttention(ring_impl_type=layout, attn_type="sdpa", mesh=mesh,
                                                       low_memory=low)}

    def once(m):
        for t in (ql, kl, vl):
            t.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        m(ql, kl, vl, causal=causal).backward(dl)
        return time.perf_counter() - t0

    for m in mods.values():
        once(m)
    times: dict = {n: [] for n in mods}
    names = list(mods)
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            times[n].append(once(mods[n]))
    mem = {}
    for n, m in mods.items():
        for t in (ql, kl, vl):
            t.grad = None
        mm = meter.MemoryMeter("cpu")
        mm.start()
        m(ql, kl, vl, causal=causal).backward(dl)
        mem[n] = mm.stop()
    return {"times": times, "mem": mem, "method": mm.method}


def one_process(S=4096, H=8, D=64, causal=True):
    """The same call on the whole sequence in one process (the sdpa backend directly)."""
    from usp_hal import KernelCall
    from usp_hal.dispatch.registry import REGISTRY
    from usp_hal.harness import meter
    torch.set_num_threads(1)
    q, k, v, dout = _inputs(S, H, D)
    for t in (q, k, v):
        t.requires_grad_()
    backend = REGISTRY.get("sdpa")()

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = backend.forward(q, k, v, KernelCall(scale=D ** -0.5, causal=causal))
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, g):
            q, k, v, out, lse = ctx.saved_tensors
            return backend.backward(g.contiguous(), q, k, v, out, lse, KernelCall(scale=D ** -0.5, causal=causal))

    F.apply(q, k, v).backward(dout)
    for t in (q, k, v):
        t.grad = None
    mm = meter.MemoryMeter("cpu")
    mm.start()
    F.apply(q, k, v).backward(dout)
    return mm.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ulysses", type=int, default=1)
    ap.add_argument("--ring", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--groups", type=int, default=0, help="low_memory=N head groups (0: True, the most)")
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--layout", default="zigzag", choices=("basic", "zigzag", "stripe"))
    args = ap.parse_args(argv)
    U, R = args.ulysses, args.ring
    rows = run_on_ranks(job, world=U * R, U=U, R=R, S=args.seqlen, rounds=args.rounds,
                        low=args.groups if args.groups else True, causal=args.causal, layout=args.layout)
    one = one_process(args.seqlen, causal=args.causal)
    slow = {n: [max(r["times"][n][i] for r in rows) for i in range(args.rounds)] for n in rows[0]["times"]}
    ratio = statistics.median(lo / de for lo, de in zip(slow["low_memory"], slow["default"]))
    print(f"Ulysses {U} x Ring {R}, S={args.seqlen}, H=8, D=64, fp32, {'causal' if args.causal else 'non-causal'} "
          f"{args.layout}, forward+backward; "
          f"memory: {rows[0]['method']}")
    print(f"  one process (whole sequence): {one / 2**20:6.1f} MiB above its inputs")
    for n in ("default", "low_memory"):
        worst = max(r["mem"][n] for r in rows)
        print(f"  {n:11s} per rank (worst): {worst / 2**20:6.1f} MiB = x{worst / one:.2f} of one process; "
              f"median time {statistics.median(slow[n]) * 1e3:7.1f} ms")
    print(f"  low_memory / default time: {ratio:.2f} (median over {args.rounds} interleaved rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
