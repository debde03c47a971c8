"""What one more small gloo message costs a ring step on this machine, whatever carries it.

A model of a Ring-2 step on raw torch ops, 2 spawned gloo ranks, one thread each: start the
K/V swap with the peer (``batch_isend_irecv``), run the CPU kernel on the local block, wait,
run it again on the received block.  Then the same with 25 integers more on the wire:
as an all-gather started before the swap (what the per-call check does), as one more
send/receive pair inside the swap's own batch, and as a pair of their own sent first.  In
interleaved rounds of ``--calls`` steps back to back; the ratio is the median over the
rounds of each variant against the swap alone.  Two more variants carry no extra data:
K and V as two messages each way (two tensors in one batch), and K and V copied into one
buffer first, then swapped as one message.

Run from the repository root:

    python -m benchmarks.message_cost
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from benchmarks._ranks import interleaved_rounds, paired_lines, run_on_ranks


def job(rounds=40, calls=16, S=256):
    peer = 1 - dist.get_rank()
    kv, got = torch.randn(2, 1, S, 8, 64), torch.empty(2, 1, S, 8, 64)
    k, v = torch.randn(1, S, 8, 64), torch.randn(1, S, 8, 64)
    meta, meta_got = torch.zeros(25, dtype=torch.long), torch.empty(25, dtype=torch.long)
    gathered = torch.empty(50, dtype=torch.long)
    q = torch.randn(1, 8, S, 64)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def kernel():
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, False, scale=0.125)

    def swap(*extra):
        ops = [dist.P2POp(dist.isend, kv, peer), dist.P2POp(dist.irecv, got, peer)]
        ops += [dist.P2POp(op, t, peer) for op, t in extra]
        return dist.batch_isend_irecv(ops)

    def step(before=None, extra=()):
        pending = before() if before else []
        works = swap(*extra)
        kernel()
        for w in list(pending) + list(works):
            w.wait()
        kernel()

    def two():
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, k, peer), dist.P2POp(dist.isend, v, peer),
                                        dist.P2POp(dist.irecv, got[0], peer), dist.P2POp(dist.irecv, got[1], peer)])
        kernel()
        for w in works:
            w.wait()
        kernel()

    def packed():
        kv[0].copy_(k)
        kv[1].copy_(v)
        step()

    variants = {
        "K/V swap alone": lambda: step(),
        "K and V as two messages": two,
        "K, V copied into one, swapped": packed,
        "+ all-gather started first": lambda: step(lambda: [gather(gathered, meta, async_op=True)]),
        "+ a pair in the swap's batch": lambda: step(extra=((dist.isend, meta), (dist.irecv, meta_got))),
        "+ a pair of its own, first": lambda: step(lambda: swap_meta()),
    }

    def swap_meta():
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, meta, peer), dist.P2POp(dist.irecv, meta_got, peer)])

    for fn in variants.values():
        fn()
    return interleaved_rounds(variants, rounds, calls)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--calls", type=int, default=16)
    args = ap.parse_args(argv)
    rows = run_on_ranks(job, world=2, rounds=args.rounds, calls=args.calls)
    print(f"a Ring-2 step on raw ops, 2 gloo ranks, {args.rounds} rounds of {args.calls} steps: median ms per "
          "step (slower rank), paired ratio to the swap alone")
    print("\n".join(paired_lines(rows, "K/V swap alone")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
