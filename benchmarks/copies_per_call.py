"""Bytes copied per attention call outside the kernels, per rank, on 2 gloo ranks.

Every aten op that writes a copy of existing data (copy_, clone, _to_copy, cat, index
ops, padding) is intercepted with a TorchDispatchMode while one call runs, and the bytes
it writes are summed.  The kernel is one op at this level, so copies inside it are not
counted; copies the library makes around it (re-layouts, packing for the all-to-all,
unpacking, dtype conversions) are.  Compare two trees by running it with each on
PYTHONPATH:

    PYTHONPATH=path/to/tree python benchmarks/copies_per_call.py

The report is bytes per rank (max over the 2 ranks) and the same as a multiple of the
rank's own q+k+v bytes.
"""
import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

COPY_OPS = {"copy_", "clone", "_to_copy", "cat", "index_select", "index", "gather", "constant_pad_nd",
            "stack", "repeat", "repeat_interleave", "expand_copy", "permute_copy", "transpose_copy"}


class CopyMeter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.by_op: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in COPY_OPS:
            outs = out if isinstance(out, (list, tuple)) else [out]
            n = sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
            self.bytes += n
            self.by_op[name] = self.by_op.get(name, 0) + n
        return out


CASES = [  # label, ulysses, ring, layout, heads, kv heads, backward
    ("Ulysses-2 fwd", 2, 1, "basic", 8, 8, False),
    ("Ulysses-2 fwd+bwd", 2, 1, "basic", 8, 8, True),
    ("Ulysses-2 GQA 8/2 fwd", 2, 1, "basic", 8, 2, False),
    ("Ulysses-2 GQA 8/2 fwd+bwd", 2, 1, "basic", 8, 2, True),
    ("Ring-2 zigzag fwd", 1, 2, "zigzag", 8, 8, False),
    ("Ring-2 zigzag fwd+bwd", 1, 2, "zigzag", 8, 8, True),
]


def _worker(rank, world, init, seqlen, dim, queue):
    import usp_hal
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        rows = []
        for label, u, r, layout, h, hkv, bwd in CASES:
            mesh = usp_hal.init_sequence_parallel(u, r, set_default=False)
            attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type=layout, mesh=mesh)
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, seqlen, n, dim, generator=g) for n in (h, hkv, hkv))
            q, k, v = (usp_hal.shard(t, layout=layout, mesh=mesh).contiguous().requires_grad_(bwd)
                       for t in (q, k, v))
            dout = torch.randn(q.shape, generator=g)
            inputs = sum(t.numel() * t.element_size() for t in (q, k, v))

            def call():
                out = attn(q, k, v, causal=True)
                if bwd:
                    out.backward(dout)
            for _ in range(2):            # warm caches (plans, buffers) as in steady state
                call()
            meter = CopyMeter()
            with meter:
                call()
            rows.append((label, meter.bytes, inputs, dict(meter.by_op)))
        queue.put((rank, rows))
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "rdzv")
        procs = [ctx.Process(target=_worker, args=(r, 2, init, a.seqlen, a.head_dim, queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(60)
    print(f"bytes copied per call outside the kernels (max over 2 ranks), S={a.seqlen}, D={a.head_dim}, fp32")
    print(f"{'case':28s} {'MiB':>8s} {'x q+k+v':>8s}  largest ops")
    for i, (label, *_rest) in enumerate(results[0]):
        worst = max((results[r][i] for r in results), key=lambda row: row[1])
        _, nbytes, inputs, by_op = worst
        top = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:4])
        print(f"{label:28s} {nbytes / 2**20:8.2f} {nbytes / inputs:8.2f}  {top}")


if __name__ == "__main__":
    main()
