"""bf16 error of ring attention against ring size: the ring's arithmetic in one process (each
query block meets the key blocks as a ring of R ranks meets them: kernel calls in bf16 on the
blocks, their outputs merged by usp_hal.parallel.ring.merge_block in float32), and the ring itself on gloo
ranks (tests/test_ring_numerics.py, docs/performance.md)."""
from __future__ import annotations

import torch

from usp_hal import KernelCall
from usp_hal.dispatch.reference import reference_attention


def _inputs(S: int, H: int, D: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, S, H, D, generator=g).to(torch.bfloat16) for _ in range(3)]


def _errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = out.double() - ref
    return {"max": diff.abs().max().item(), "rms": (diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()}


def merged_blocks(q, k, v, R: int, causal: bool, acc=torch.float32) -> torch.Tensor:
    """The basic layout's ring of ``R`` in one process: query block ``i`` against key blocks
    ``j <= i`` (causal: the diagonal one causal) or all of them, merged in ``acc`` (the ring's
    float32; bfloat16 is the negative control)."""
    from usp_hal.dispatch.registry import REGISTRY
    from usp_hal.parallel.ring import NEG_INF, merge_block
    backend = REGISTRY.get("sdpa")()
    B, S, H, D = q.shape
    edges = [round(i * S / R) for i in range(R + 1)]
    outs = []
    for i in range(R):
        qa, qb = edges[i], edges[i + 1]
        out_acc = torch.zeros(B, qb - qa, H, D, dtype=acc)
        acc_lse = torch.full((B, H, qb - qa), NEG_INF, dtype=acc)
        for j in range(i + 1 if causal else R):
            a, b = edges[j], edges[j + 1]
            out, lse = backend.forward(q[:, qa:qb], k[:, a:b], v[:, a:b],
                                       KernelCall(scale=None, causal=causal and i == j))
            merge_block(out_acc, acc_lse, slice(None), out, lse)
        outs.append(out_acc.to(q.dtype))
    return torch.cat(outs, 1)


def sweep(rings=range(1, 9), S: int = 1024, H: int = 4, D: int = 64, seed: int = 0, acc=torch.float32) -> dict:
    """{causal: {R: {"max", "rms"}}}: the merged blocks' error against float64 attention of the
    same bf16 inputs."""
    out = {}
    for causal in (False, True):
        q, k, v = _inputs(S, H, D, seed + int(causal))
        ref, _ = reference_attention(q.double(), k.double(), v.double(), causal=causal)
        out[causal] = {R: _errors(merged_blocks(q, k, v, R, causal, acc), ref) for R in rings}
    return out


def ring_on_ranks(S: int = 512, H: int = 4, D: int = 64, seed: int = 0) -> dict:
    """LongContextAttention on this pool's ranks as one ring (basic layout), bf16, against
    float64: {causal: {"max", "rms"}} of the whole output (every rank returns the same)."""
    import torch.distributed as dist

    import usp_hal
    mesh = usp_hal.init_sequence_parallel(1, dist.get_world_size(), set_default=False, reuse_groups=True)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type="basic", mesh=mesh)
    res = {}
    for causal in (False, True):
        q, k, v = _inputs(S, H, D, seed + int(causal))
        ref, _ = reference_attention(q.double(), k.double(), v.double(), causal=causal)
        local = attn(*(usp_hal.shard(x, layout="basic", mesh=mesh) for x in (q, k, v)), causal=causal)
        res[causal] = _errors(usp_hal.unshard(local, layout="basic", mesh=mesh), ref)
    return res
