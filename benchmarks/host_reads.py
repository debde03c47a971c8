"""Host reads of tensor data and collectives per steady call, per rank, as a GPU would pay them.

On spawned gloo ranks (127.0.0.1), each mesh gets a separate gloo group over its ranks as its
metadata (side) group, as on a GPU machine whose device group has no CPU transport (the
library's data path takes no gloo-only shortcut, so gloo data groups count as a device
transport would).  After three warm-up calls, one
call runs under :class:`usp_hal.harness.hostreads.HostReadMeter`, which counts

* host reads of tensor data (``item``, ``tolist``, ``bool``/``float``/``int``/``index`` of a
  tensor, ``.cpu()``, ``.numpy()``, and the aten ops that read data on the host): each is a
  device synchronisation on a GPU, except reads of tensors that went through the side group
  (host tensors there), counted apart as ``side``;
* collectives on the device groups and on the side group.

Cases: Ulysses-2 and Ring-2 (2 ranks), Ulysses-2 x Ring-2 (4 ranks); forward and
forward+backward; the cross-rank check at every call, and only at the first call
(``check_ranks="first_call"``, formerly ``static_shapes=True``).  Then one decode step of
:class:`usp_hal.ShardedKVCache` over two layers on Ring-2 and Ulysses-2, ``verify="layer"``
and ``"step"``, reported per layer.  S=256, H=4 (Hkv=2), D=32, fp32: the counts do not depend
on the sizes.

    PYTHONPATH=. python benchmarks/host_reads.py [--sites] [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# label, ulysses, ring
CASES = [("U2", 2, 1), ("R2", 1, 2), ("U2xR2", 2, 2)]
DECODE = [("R2", 1, 2), ("U2", 2, 1)]


def mesh_with_side_group(u: int, r: int):
    import torch.distributed as dist

    import usp_hal
    mesh = usp_hal.init_sequence_parallel(u, r, set_default=False)
    side = dist.new_group(list(mesh.sp_ranks), backend="gloo")
    return dataclasses.replace(mesh, meta_group=side), side


def _attention_counts(u, r, S, H, Hkv, D, check, bwd) -> dict:
    import torch
    import torch.distributed as dist

    import usp_hal
    from usp_hal.harness.hostreads import HostReadMeter
    mesh, side = mesh_with_side_group(u, r)
    from usp_hal.harness.hostreads import first_call_kwargs
    kw = first_call_kwargs() if check == "first call" else {}
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type="zigzag", mesh=mesh, **kw)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, S, h, D, generator=g) for h in (H, Hkv, Hkv, H))
    local = [usp_hal.shard(t, layout="zigzag", mesh=mesh).contiguous().requires_grad_(bwd and i < 3)
             for i, t in enumerate((q, k, v, dout))]

    def call():
        out = attn(local[0], local[1], local[2], causal=True)
        if bwd:
            out.backward(local[3])
            for t in local[:3]:
                t.grad = None
    for _ in range(3):
        call()
    dist.barrier()
    with HostReadMeter(side_group=side) as m:
        call()
    dist.barrier()
    return m.summary()


def _decode_counts(u, r, S, H, Hkv, D, verify, layers) -> dict:
    import torch
    import torch.distributed as dist

    from usp_hal.harness.hostreads import HostReadMeter
    from usp_hal.serving import ShardedKVCache
    mesh, side = mesh_with_side_group(u, r)
    g = torch.Generator().manual_seed(1)
    cache = ShardedKVCache(mesh, num_layers=layers, batch_size=1, num_heads=H, num_kv_heads=Hkv, head_dim=D,
                           block_size=64, attn_type="sdpa", verify=verify)
    K, V = torch.randn(1, S, Hkv, D, generator=g), torch.randn(1, S, Hkv, D, generator=g)
    for layer in range(layers):
        cache.load(layer, K, V, [S])

    def step():
        q = torch.randn(1, 1, H, D, generator=g)
        k, v = torch.randn(1, 1, Hkv, D, generator=g), torch.randn(1, 1, Hkv, D, generator=g)
        for layer in range(layers):
            cache.decode(layer, q, k, v, causal=True)
    for _ in range(2):
        step()
    dist.barrier()
    with HostReadMeter(side_group=side) as m:
        step()
    dist.barrier()
    return m.summary()


def rank_counts(cases, decode, S=256, H=4, Hkv=2, D=32, layers=2) -> list:
    import torch
    torch.set_num_threads(1)
    rows = []
    for label, u, r in cases:
        for check in ("every call", "first call"):
            for bwd in (False, True):
                rows.append({"case": label, "mode": "fwd+bwd" if bwd else "fwd", "check": check,
                             **_attention_counts(u, r, S, H, Hkv, D, check, bwd)})
    for label, u, r in decode:
        for verify in ("layer", "step"):
            got = _decode_counts(u, r, S, H, Hkv, D, verify, layers)
            rows.append({"case": f"decode {label}", "mode": f"per layer ({layers} layers)",
                         "check": f"verify={verify}", "layers": layers, **got})
    return rows


def _per(row: dict, key: str, kind: str) -> str:
    n = row[key][kind]
    layers = row.get("layers")
    return f"{n / layers:g}" if layers else str(n)


def format_rows(per_rank: list) -> str:
    hdr = (f"{'case':11s} {'mode':22s} {'check':13s} {'device reads':>12s} {'side reads':>10s} "
           f"{'device coll':>11s} {'side coll':>9s}")
    lines = [hdr, "-" * len(hdr)]
    for ranks in per_rank:
        r0 = ranks[0]
        cells = []
        for key, kind in (("reads", "device"), ("reads", "side"), ("collectives", "device"), ("collectives", "side")):
            vals = sorted({_per(x, key, kind) for x in ranks})
            cells.append("/".join(vals))
        lines.append(f"{r0['case']:11s} {r0['mode']:22s} {r0['check']:13s} {cells[0]:>12s} {cells[1]:>10s} "
                     f"{cells[2]:>11s} {cells[3]:>9s}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", action="store_true", help="also print where rank 0's reads and collectives happen")
    ap.add_argument("--json", default=None, help="write every rank's rows as JSON")
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args(argv)
    import torch

    import usp_hal
    from benchmarks._ranks import run_on_ranks
    from usp_hal.harness.hostreads import first_call_kwargs
    two = run_on_ranks(rank_counts, 2, timeout=a.timeout, cases=[c for c in CASES if c[1] * c[2] == 2],
                       decode=DECODE)
    four = run_on_ranks(rank_counts, 4, timeout=a.timeout, cases=[c for c in CASES if c[1] * c[2] == 4], decode=[])
    per_rank = [list(x) for x in zip(*two)] + [list(x) for x in zip(*four)]
    tree = os.path.dirname(os.path.dirname(os.path.abspath(usp_hal.__file__)))
    print(f"host reads of tensor data and collectives in one steady call, per rank (values differing across ranks "
          f"are shown a/b): usp-hal from {tree}, torch {torch.__version__}; {first_call_kwargs()} for 'first call'")
    print("device reads = device syncs on a GPU; side = reads of the side group's host tensors (no device sync); "
          "decode rows are per layer")
    print(format_rows(per_rank))
    if a.sites:
        for ranks in per_rank:
            r0 = ranks[0]
            print(f"\n{r0['case']} {r0['mode']} {r0['check']} (rank 0):")
            for k, n in list(r0["sites"].items()) + list(r0["coll_names"].items()):
                print(f"    {n:3d}  {k}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": per_rank}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
