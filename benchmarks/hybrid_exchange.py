"""Head-parallel against state passing for a gated DeltaNet layer: bytes sent per rank and time
per call, side by side in interleaved rounds, on Ring-R (R=2, 4) at S = 4k, 16k and 64k.

    python -m benchmarks.hybrid_exchange
    python -m benchmarks.hybrid_exchange --rings 2 --seqlens 4096,16384 --rounds 3 --bwd

Both run transformers' ``torch_chunk_gated_delta_rule`` (the plain-torch fallback of the
qwen3_next family) on B=1, H=4 heads, dk=dv=32, fp32, zigzag shards:

- ``head_parallel`` (:func:`usp_hal.head_parallel`): q, k, v, g and beta all-to-all to head
  sharding over the whole group, the kernel on the whole sequence of the rank's heads, the
  output back: bytes grow with S;
- ``state_passing`` (:func:`usp_hal.mixers.state_passing.gated_delta_rule`): the kernel on the rank's
  own tokens (twice), one all-gather of every piece's ``[P | S]``: bytes independent of S.

Bytes: :class:`usp_hal.harness.CommMeter` around one call (forward, or forward+backward with
``--bwd``).  Time: the slower rank per round, median over rounds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._ranks import run_on_ranks

H, DK, DV = 4, 32, 32


def job(R=2, S=4096, rounds=3, bwd=False):
    import torch.distributed as dist
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as kernel

    import usp_hal
    from usp_hal.harness import CommMeter
    from usp_hal.mixers import state_passing as sp
    mesh = usp_hal.init_sequence_parallel(1, R, set_default=False)
    g = torch.Generator().manual_seed(0)

    def sh(t):
        return usp_hal.shard(t, layout="zigzag", mesh=mesh).contiguous().requires_grad_(bwd)
    q, k = (sh(torch.nn.functional.normalize(torch.randn(1, S, H, DK, generator=g), dim=-1)) for _ in range(2))
    v = sh(torch.randn(1, S, H, DV, generator=g))
    gg, beta = sh(-torch.rand(1, S, H, generator=g) * 0.1), sh(torch.rand(1, S, H, generator=g))

    def head_parallel():
        return usp_hal.head_parallel(lambda *t: kernel(*t)[0], q, k, v, gg, beta, mesh=mesh, layout="zigzag")

    def state_passing():
        return sp.gated_delta_rule(q, k, v, gg, beta, mesh=mesh, layout="zigzag", kernel=kernel, seqlen=S)

    variants = {"head_parallel": head_parallel, "state_passing": state_passing}

    def once(fn):
        dist.barrier()
        t = time.perf_counter()
        out = fn()
        if bwd:
            out.sum().backward()
        return time.perf_counter() - t

    sent = {}
    for name, fn in variants.items():
        meter = CommMeter()
        with meter:
            once(fn)
        sent[name] = sum(meter.bytes.values())
    times: dict = {n: [] for n in variants}
    names = list(variants)
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            times[n].append(once(variants[n]))
    return {"sent": sent, "times": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rings", default="2,4")
    ap.add_argument("--seqlens", default="4096,16384,65536")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bwd", action="store_true", help="forward+backward (default: forward)")
    args = ap.parse_args(argv)
    print(f"gated DeltaNet, B=1 H={H} dk={DK} dv={DV} fp32, zigzag, {'forward+backward' if args.bwd else 'forward'}; "
          "sent = bytes per rank (worst rank), time = median over rounds of the slower rank")
    print(f"  {'R':>2} {'S':>6}  {'head-parallel sent':>18} {'state passing sent':>18}  "
          f"{'head-parallel ms':>16} {'state passing ms':>16}  {'sp / hp time':>12}")
    for R in map(int, args.rings.split(",")):
        for S in map(int, args.seqlens.split(",")):
            rows = run_on_ranks(job, world=R, R=R, S=S, rounds=args.rounds, bwd=args.bwd)
            sent = {n: max(r["sent"][n] for r in rows) for n in rows[0]["sent"]}
            slow = {n: [max(r["times"][n][i] for r in rows) for i in range(args.rounds)] for n in rows[0]["times"]}
            med = {n: statistics.median(t) * 1e3 for n, t in slow.items()}
            ratio = statistics.median(a / b for a, b in zip(slow["state_passing"], slow["head_parallel"]))
            print(f"  {R:2d} {S:6d}  {sent['head_parallel']:18,d} {sent['state_passing']:18,d}  "
                  f"{med['head_parallel']:16.1f} {med['state_passing']:16.1f}  {ratio:12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
