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
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import run_on_ranks  # noqa: E402

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


def _call(attn, q, k, v, dout, bwd):
    out = attn(q, k, v, causal=True)
    if bwd:
        out.backward(dout)


def measure(seqlen, dim):
    import usp_hal
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

        for _ in range(2):            # warm caches (plans, buffers) as in steady state
            _call(attn, q, k, v, dout, bwd)
        meter = CopyMeter()
        with meter:
            _call(attn, q, k, v, dout, bwd)
        rows.append((label, meter.bytes, inputs, dict(meter.by_op)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args()
    results = run_on_ranks(measure, 2, seqlen=a.seqlen, dim=a.head_dim)
    print(f"bytes copied per call outside the kernels (max over 2 ranks), S={a.seqlen}, D={a.head_dim}, fp32; "
          "the ring's K/V as on a device transport (not packed with the agreement flag, as gloo's host path does)")
    print(f"{'case':28s} {'MiB':>8s} {'x q+k+v':>8s}  largest ops")
    for i in range(len(CASES)):
        worst = max((res[i] for res in results), key=lambda row: row[1])
        label, nbytes, inputs, by_op = worst
        top = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:4])
        print(f"{label:28s} {nbytes / 2**20:8.2f} {nbytes / inputs:8.2f}  {top}")


if __name__ == "__main__":
    main()
