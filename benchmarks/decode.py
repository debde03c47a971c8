"""Sharded-cache decode vs one process holding the whole cache, side by side.

On ``--ulysses x --ring`` spawned gloo ranks (one thread each) a one-layer
:class:`usp_hal.serving.ShardedKVCache` holds a random cache of S tokens; rank 0 also holds
the whole cache in a one-process cache (a 1 x 1 mesh).  Each round times one decode step
(one new token, B sequences) of the sharded cache on every rank (after a barrier; the
step's time is the slowest rank's), then the same step of the one-process cache on rank 0
alone while the others wait: the two are measured interleaved, round by round, under the
same machine load.  Reported per S: the median step times and their ratio (median of the
per-round ratios), the rank 0 time inside collectives (metadata agreement and data
all-gather, waiting for the slower rank included), the per-rank cache bytes against the
whole cache's (target: 1/W plus at most one block), and the bytes of the step's
collectives (metered: the data all-gather and the int64 metadata agreement).

    python benchmarks/decode.py                                   # 1 x 2, S = 8k, 32k, 128k
    python benchmarks/decode.py --ulysses 2 --ring 1 --seqlens 32768 --rounds 20
    python benchmarks/decode.py --layers 4 --verify step --seqlens 32768   # one agreement per step
    python benchmarks/decode.py --json decode.json

On a shared CPU the absolute times are noisy; the ratio is the number to read.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rank_bench(U: int, R: int, seqlens, rounds: int, B: int, H: int, Hkv: int, D: int, block: int,
               warmup: int, layers: int = 1, verify: str = "layer", seed: int = 0) -> dict:
    import torch
    import torch.distributed as dist

    import usp_hal
    from usp_hal.harness import CommMeter
    from usp_hal.parallel.mesh import SequenceParallelMesh
    from usp_hal.serving import ShardedKVCache
    mesh = usp_hal.init_sequence_parallel(U, R, set_default=False)
    rank = dist.get_rank()
    out: dict = {"rows": []}
    for S in seqlens:
        g = torch.Generator().manual_seed(seed + S)
        K = torch.randn(B, S, Hkv, D, generator=g)
        V = torch.randn(B, S, Hkv, D, generator=g)
        kw = dict(num_layers=layers, batch_size=B, num_heads=H, num_kv_heads=Hkv, head_dim=D, block_size=block,
                  attn_type="sdpa", verify=verify)
        sharded = ShardedKVCache(mesh, **kw)
        for layer in range(layers):
            sharded.load(layer, K, V, [S] * B)
        whole = None
        if rank == 0:       # a one-process mesh: no group, nothing exchanged
            one = SequenceParallelMesh(1, 1, 0, 1, True, (0,), (0,), (0,))
            whole = ShardedKVCache(one, **kw)
            for layer in range(layers):
                whole.load(layer, K, V, [S] * B)
        del K, V
        t_sh, t_one, ratios, t_comm = [], [], [], []
        meter_bytes = meta_bytes = calls = 0
        for i in range(warmup + rounds):
            q = torch.randn(B, 1, H, D, generator=g)
            k = torch.randn(B, 1, Hkv, D, generator=g)
            v = torch.randn(B, 1, Hkv, D, generator=g)
            dist.barrier()
            with CommMeter() as meter:
                t0 = time.perf_counter()
                for layer in range(layers):
                    sharded.decode(layer, q, k, v, causal=True)
                dt = (time.perf_counter() - t0) / layers
            if i == warmup:
                meter_bytes = sum(meter.bytes.values()) // layers
                meta_bytes = meter.metadata_bytes
                calls = sum(meter.calls.values())
            comm = meter.seconds / layers
            slowest = torch.tensor([dt], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dist.barrier()
            d1 = None
            if whole is not None:
                t0 = time.perf_counter()
                for layer in range(layers):
                    whole.decode(layer, q, k, v, causal=True)
                d1 = (time.perf_counter() - t0) / layers
            dist.barrier()
            if i >= warmup:
                t_sh.append(float(slowest))
                t_comm.append(comm)
                if d1 is not None:
                    t_one.append(d1)
                    ratios.append(float(slowest) / d1)
        row = {"S": S, "world": U * R, "U": U, "R": R, "B": B, "H": H, "Hkv": Hkv, "D": D, "block": block,
               "layers": layers, "verify": verify,
               "rank_cache_bytes": sharded.memory_bytes(), "rank_used_bytes": sharded.used_bytes(),
               "collective_bytes_sent": meter_bytes, "metadata_bytes_sent": meta_bytes, "collective_calls": calls}
        if whole is not None:
            row.update(whole_cache_bytes=whole.memory_bytes(), sharded_ms=1e3 * statistics.median(t_sh),
                       collectives_ms=1e3 * statistics.median(t_comm),
                       one_process_ms=1e3 * statistics.median(t_one), ratio=statistics.median(ratios))
        out["rows"].append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ulysses", type=int, default=1)
    ap.add_argument("--ring", type=int, default=2)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--layers", type=int, default=1, help="layers decoded per step (times are per layer)")
    ap.add_argument("--verify", default="layer", choices=["layer", "step"],
                    help="metadata agreement at every layer, or once per step (at layer 0)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    a = ap.parse_args(argv)
    from benchmarks._ranks import run_on_ranks
    world = a.ulysses * a.ring
    res = run_on_ranks(rank_bench, world=world, U=a.ulysses, R=a.ring, seqlens=a.seqlens, rounds=a.rounds,
                       B=a.batch, H=a.heads, Hkv=a.kv_heads, D=a.head_dim, block=a.block, warmup=a.warmup,
                       layers=a.layers, verify=a.verify)
    rows = res[0]["rows"]
    for r, others in zip(rows, zip(*[x["rows"] for x in res[1:]]) if world > 1 else [()] * len(rows)):
        r["max_rank_cache_bytes"] = max([r["rank_cache_bytes"]] + [o["rank_cache_bytes"] for o in others])
    print(f"decode step, per layer of {a.layers} (verify={a.verify}), B={a.batch} H={a.heads} Hkv={a.kv_heads} "
          f"D={a.head_dim} float32, "
          f"{a.ulysses} x {a.ring} (ulysses x ring) gloo ranks, 1 thread each, {a.rounds} interleaved rounds")
    print(f"{'S':>8} {'sharded ms':>11} {'(comm ms)':>10} {'1-proc ms':>10} {'ratio':>6} {'rank cache':>11} "
          f"{'whole':>10} {'share':>6} {'1/W+blk':>8} {'data B/layer':>12} {'meta B/step':>12}")
    for r in rows:
        W = r["world"]
        item = 4
        block_bytes = r["layers"] * r["B"] * r["block"] * (r["Hkv"] // r["U"] or 1) * 2 * r["D"] * item
        target = r["whole_cache_bytes"] / W + block_bytes
        print(f"{r['S']:>8} {r['sharded_ms']:>11.3f} {r['collectives_ms']:>10.3f} {r['one_process_ms']:>10.3f} "
              f"{r['ratio']:>6.2f} "
              f"{r['max_rank_cache_bytes'] / 2**20:>9.2f}Mi {r['whole_cache_bytes'] / 2**20:>8.2f}Mi "
              f"{r['max_rank_cache_bytes'] / r['whole_cache_bytes']:>6.3f} {target / r['whole_cache_bytes']:>8.3f} "
              f"{r['collective_bytes_sent']:>12} {r['metadata_bytes_sent']:>12}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
