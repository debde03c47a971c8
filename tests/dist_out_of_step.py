"""Rank-side functions for tests/test_out_of_step.py: ranks whose calls stop matching (two
different agreements met at one point, a ``check_ranks="first_call"`` module whose later call
changes on one rank, hybrid sequence mixers called differently per rank)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import usp_hal
from tests.dist_cases import get_mesh
from usp_hal.parallel.comm import agree


def _outcome(fn) -> dict:
    t0 = time.monotonic()
    try:
        value = fn()
        err = None
    except Exception as exc:   # the test inspects type and message
        value, err = None, exc
    return {"error": None if err is None else f"{type(err).__name__}: {err}", "value": value,
            "elapsed": time.monotonic() - t0}


def _group_works(mesh) -> bool:
    x = torch.randn(1, 10, 2, 4, generator=torch.Generator().manual_seed(3))
    return bool(torch.equal(usp_hal.unshard(usp_hal.shard(x, mesh=mesh), mesh=mesh), x))


def two_agreements(same_width: bool = True) -> dict:
    """Rank 0 makes agreement "alpha", the other ranks agreement "beta", at the same point."""
    mesh = get_mesh(1, dist.get_world_size())
    if dist.get_rank() == 0:
        out = _outcome(lambda: agree(None, mesh.metadata_group, what="alpha", values=[1, 2, 3]))
    else:
        vals = [7, 8, 9] if same_width else [7, 8, 9, 10, 11]
        out = _outcome(lambda: agree(None, mesh.metadata_group, what="beta", values=vals))
    out["after_ok"] = _group_works(mesh)
    return out


def first_call_changes_on_one_rank(change: str, U: int = 1, R: int = 2) -> dict:
    """A ``check_ranks="first_call"`` module: call 1 on every rank, then rank 1 alone makes a
    changed call (``change``) and, after its error, carries on with the first call again,
    while the other ranks repeat the first call twice."""
    mesh = get_mesh(U, R)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh, check_ranks="first_call")
    g = torch.Generator().manual_seed(0)
    S, H, D = 8 * U * R, 2 * U, 8
    q, k, v = (torch.randn(1, S, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    ql, kl, vl = (usp_hal.shard(t, mesh=mesh) for t in (q, k, v))
    attn(ql, kl, vl, causal=True)
    other = dist.get_rank() == 1

    def changed():
        if change == "causal":
            return attn(ql, kl, vl, causal=False)
        if change == "length":
            return attn(ql[:, :-1], kl[:, :-1], vl[:, :-1], causal=True)
        if change == "list":
            return attn(ql.tolist(), kl, vl, causal=True)
        raise AssertionError(change)

    second = _outcome(changed if other else (lambda: attn(ql, kl, vl, causal=True)))
    third = _outcome(lambda: attn(ql, kl, vl, causal=True))
    for rep in (second, third):
        rep["value"] = None
    return {"second": second, "third": third}


def mixer_mismatch(what: str, U: int = 1, R: int = 2, layout: str = "zigzag") -> dict:
    """Hybrid sequence mixers run differently on rank 1 (``what``): another batch size, the
    other recurrence (state passing against head parallel), the other conv exchange (halo
    against head parallel), or local lengths that are not the layout's."""
    from usp_hal.mixers.head_parallel import halo_causal_conv, head_parallel
    from usp_hal.mixers.state_passing import delta_rule_reference, gated_delta_rule
    mesh = get_mesh(U, R)
    other = dist.get_rank() == 1
    g = torch.Generator().manual_seed(0)
    S, H, dk, dv, C, K = 16, 2, 4, 4, 6, 4
    B = 1 if (other and what.endswith("batch")) else 2

    def sharded(*shape):
        full = torch.randn(2, S, *shape, generator=g, dtype=torch.float64)[:B]
        return usp_hal.shard(full, layout=layout, mesh=mesh)

    q, k, v = sharded(H, dk), sharded(H, dk), sharded(H, dv)
    gate, beta = -torch.rand(*q.shape[:3], generator=g, dtype=torch.float64), sharded(H).sigmoid()
    x = sharded(C)
    weight = torch.randn(C, K, generator=g, dtype=torch.float64)
    if what == "conv_lengths" and other:
        x = x[:, :-1]

    def by_heads(q, k, v, gg, bb):
        return delta_rule_reference(q, k, v, gg, bb)[0]

    def gdn_state():
        return gated_delta_rule(q, k, v, gate, beta, mesh=mesh, layout=layout)

    def gdn_heads():
        return head_parallel(by_heads, q, k, v, gate, beta, mesh=mesh, layout=layout)

    def conv_halo():
        return halo_causal_conv(x, weight, mesh=mesh, layout=layout)

    def conv_heads():
        return head_parallel(lambda t: t * 2.0, x.unsqueeze(-1), mesh=mesh, layout=layout)

    run = {"state_batch": gdn_state, "conv_batch": conv_halo, "conv_lengths": conv_halo,
           "recurrence": gdn_heads if other else gdn_state,
           "conv_exchange": conv_heads if other else conv_halo}[what]
    out = _outcome(run)
    out["value"] = None
    out["after_ok"] = _group_works(mesh)
    return out
