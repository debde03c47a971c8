"""Per-call overhead of the backend layer: the sdpa backend's forward/backward on a tiny
block (where the kernel itself costs ~13 us on one CPU thread), the raw aten op, and a
one-rank LongContextAttention forward.  Compare two trees by running it with each on
PYTHONPATH:

    PYTHONPATH=path/to/tree python benchmarks/per_call_overhead.py
"""
import tempfile
import timeit

import torch
import torch.distributed as dist

import usp_hal
from usp_hal.backends.sdpa import SDPABackend


def best(fn, n=2000, repeat=7):
    return min(timeit.repeat(fn, number=n, repeat=repeat)) / n * 1e6


def main():
    torch.set_num_threads(1)
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    b = SDPABackend()
    print(f"sdpa.forward tiny block:  {best(lambda: b.forward(q, k, v, softmax_scale=0.3)):.1f} us")
    print(f"sdpa.forward tiny causal: {best(lambda: b.forward(q, k, v, softmax_scale=0.3, causal=True)):.1f} us")
    out, lse = b.forward(q, k, v, softmax_scale=0.3)
    bwd = best(lambda: b.backward(q, q, k, v, out, lse, softmax_scale=0.3), n=1000)
    print(f"sdpa.backward tiny block: {bwd:.1f} us")
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    print(f"raw aten cpu flash op:    {best(lambda: op(qt, kt, vt, 0.0, False, scale=0.3)):.1f} us")
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            mesh = usp_hal.init_sequence_parallel(1, 1, set_default=False)
            attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)
            with torch.no_grad():
                attn(q, k, v)
                print(f"LongContextAttention, 1 rank, forward: {best(lambda: attn(q, k, v), n=1000):.1f} us")
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
