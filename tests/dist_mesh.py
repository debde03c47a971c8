"""Rank functions for meshes built from a torch DeviceMesh, whole or sliced (tests/test_mesh.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import usp_hal
from tests.dist_cases import _err, make_inputs
from usp_hal.dispatch.reference import reference_attention

# each shape: (mesh shape, dim names, the dims given to init_sequence_parallel, its degree keywords)
SHAPES = {
    "dp_ulysses_ring": ((2, 2, 1), ("dp", "ulysses", "ring"), ("ulysses", "ring"), {}),
    "dp_ring_ulysses": ((2, 1, 2), ("dp", "ring", "ulysses"), ("ring", "ulysses"), {}),
    "dp_ring_ulysses_tp": ((1, 2, 1, 2), ("dp", "ring", "ulysses", "tp"), ("ring", "ulysses"), {}),
    "dp_sp_ulysses": ((2, 2), ("dp", "sp"), ("sp",), {}),
    "dp_sp_ring": ((2, 2), ("dp", "sp"), ("sp",), {"ring_degree": 2}),
    "sp4_u2r2": ((1, 4), ("dp", "sp"), ("sp",), {"ulysses_degree": 2, "ring_degree": 2}),
}


def _sum_over(group) -> int:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=group)
    return int(t.item())


def submesh_case(shape: str, causal: bool = True, S: int = 13):
    """Build the mesh from a DeviceMesh (slice); report the rank sums over each of its groups
    and the errors of one USP call (forward and gradients) on this replica's own data."""
    from torch.distributed.device_mesh import init_device_mesh

    dims, names, pick, degrees = SHAPES[shape]
    dm = init_device_mesh("cpu", dims, mesh_dim_names=names)
    sub = dm[pick[0]] if len(pick) == 1 else dm[pick]
    mesh = usp_hal.init_sequence_parallel(device_mesh=sub, set_default=False, **degrees)
    rep = {"degrees": (mesh.ulysses_degree, mesh.ring_degree, mesh.dp_degree),
           "ranks": {"sp": mesh.sp_ranks, "ulysses": mesh.ulysses_ranks, "ring": mesh.ring_ranks},
           "sums": {k: _sum_over(g) for k, g in (("sp", mesh.sp_group), ("ulysses", mesh.ulysses_group),
                                                 ("ring", mesh.ring_group), ("dp", mesh.dp_group))}}
    # each replica attends over its own data (seed = the replica's first rank)
    q, k, v, dout, _ = make_inputs(1, S, 4, 2, 8, torch.float32, seed=min(mesh.sp_ranks))
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ro, _ = reference_attention(qr, kr, vr, causal=causal)
    rg = torch.autograd.grad(ro, (qr, kr, vr), dout.double())
    sh = [usp_hal.shard(x, layout="zigzag", mesh=mesh) for x in (q, k, v, dout)]
    ql, kl, vl = (x.requires_grad_() for x in sh[:3])
    out = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type="zigzag", mesh=mesh)(ql, kl, vl,
                                                                                          causal=causal)
    out.backward(sh[3])
    errs = {"out": _err(out, usp_hal.shard(ro.detach(), layout="zigzag", mesh=mesh), torch.float32)}
    for name, mine, ref in zip("qkv", (ql, kl, vl), rg):
        errs[f"d{name}"] = _err(mine.grad, usp_hal.shard(ref, layout="zigzag", mesh=mesh), torch.float32)
    full = usp_hal.unshard(out.detach(), layout="zigzag", mesh=mesh)
    errs["unshard"] = _err(full, ro.detach(), torch.float32)
    rep["errors"] = errs
    return rep


def bad_submesh(what: str):
    """A device_mesh that cannot be used: every rank must raise (the same) ValueError."""
    from torch.distributed.device_mesh import init_device_mesh

    if what == "three_dims":
        dm = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp", "ulysses", "ring"))
        usp_hal.init_sequence_parallel(device_mesh=dm, set_default=False)
    elif what == "degree_mismatch":
        dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
        usp_hal.init_sequence_parallel(device_mesh=dm["sp"], ulysses_degree=4, set_default=False)
    elif what == "one_rank_differs":
        dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
        kw = {"ring_degree": 2} if dist.get_rank() == 3 else {}
        usp_hal.init_sequence_parallel(device_mesh=dm["sp"], set_default=False, **kw)
    return "no error"


def groups_reused(U: int = 2, R: int = 2):
    """Build the same meshes again: with ``reuse_groups=True`` (plain, with a timeout, and a
    DynamicDegree's set) no process group is created after the first of each, and the reused
    groups work; by default each mesh has groups of its own (two threads may use two meshes)."""
    import usp_hal
    from usp_hal.planning.dynamic import DynamicDegree
    from usp_hal.planning.stepcost import AttentionShape
    pg_map = dist.distributed_c10d._world.pg_map
    shape = AttentionShape(heads=8, head_dim=16, kv_heads=2, dtype="fp32", causal=True, bwd=True)

    def build():
        a = usp_hal.init_sequence_parallel(U, R, set_default=False, reuse_groups=True)
        b = usp_hal.init_sequence_parallel(U, R, set_default=False, timeout=30, reuse_groups=True)
        dd = DynamicDegree(shape, budget_tokens=64, profile="cpu-4ranks")
        return a, b, dd
    first = build()
    n = len(pg_map)
    again = build()
    created = len(pg_map) - n
    same = [again[0].ring_group is first[0].ring_group, again[1].ulysses_group is first[1].ulysses_group,
            again[0].ulysses_group is not again[1].ulysses_group]       # another timeout: its own groups
    own = usp_hal.init_sequence_parallel(U, R, set_default=False)
    x = torch.ones(1)
    dist.all_reduce(x, group=again[0].ring_group)
    return {"created": created, "same": same, "sum": float(x), "meshes": len(again[2].meshes),
            "own": own.ring_group is not first[0].ring_group and len(pg_map) > n + created}
