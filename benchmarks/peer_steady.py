"""usp-hal against yunchang 0.6.4 in steady back-to-back calls, both on usp-hal's CPU kernel
(yunchang through its ``attn_processor`` hook, ``usp_hal.harness.cases.yunchang_cpu_processor``):
the default module, the same with ``static_shapes=True`` (checked once, then no per-call
check), and yunchang, in interleaved rounds on 2 spawned gloo ranks.  Each sample is
``--calls`` calls back to back after one barrier; a sample's time is the slower rank's mean
call; the ratio is the median over the rounds of each round's usp-hal / yunchang.
Forward, fp32, B=1, H=8, D=64, no grad, basic layout.

What it separates: the per-call check's cost in steady state (default against
``static_shapes``) from the rest of the call (``static_shapes`` against yunchang).

Run from the repository root (needs ``pip install yunchang==0.6.4 --no-deps``):

    python -m benchmarks.peer_steady                       # Ring-2, S=512
    python -m benchmarks.peer_steady --ulysses --seqlen 1024
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import usp_hal
from benchmarks._ranks import interleaved_rounds, paired_lines, run_on_ranks


def job(S=512, U=1, R=2, rounds=30, calls=16):
    from yunchang import LongContextAttention as PeerAttention
    from yunchang import set_seq_parallel_pg

    from usp_hal.harness.cases import yunchang_cpu_processor
    rank, world = dist.get_rank(), dist.get_world_size()
    set_seq_parallel_pg(U, R, rank, world)
    mesh = usp_hal.init_sequence_parallel(U, R, set_default=False)
    mods = {"usp-hal (default)": usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh),
            "usp-hal static_shapes=True": usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh,
                                                                       static_shapes=True),
            "yunchang 0.6.4": PeerAttention(ring_impl_type="basic", attn_type=None,
                                            attn_processor=yunchang_cpu_processor)}
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, S // (U * R), 8, 64, generator=g) for _ in range(3))
    with torch.no_grad():
        for _ in range(3):
            for m in mods.values():
                m(q, k, v)
        return interleaved_rounds({n: (lambda m=m: m(q, k, v)) for n, m in mods.items()}, rounds, calls)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--ulysses", action="store_true", help="Ulysses-2 instead of Ring-2")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=16, help="calls per sample, back to back")
    args = ap.parse_args(argv)
    U, R = (2, 1) if args.ulysses else (1, 2)
    rows = run_on_ranks(job, world=2, S=args.seqlen, U=U, R=R, rounds=args.rounds, calls=args.calls)
    print(f"{'Ulysses' if args.ulysses else 'Ring'}-2, S={args.seqlen}, forward, {args.rounds} rounds of "
          f"{args.calls} calls: median ms per call (slower rank), paired ratio to yunchang")
    print("\n".join(paired_lines(rows, "yunchang 0.6.4")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
