"""Rank-side functions for tests/test_agreement.py: a bad argument on ONE rank only, and every
rank must raise (the same error, quickly), none left waiting in a collective."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import usp_hal
from tests.dist_cases import get_mesh
from usp_hal.parallel.comm import AgreementError, agree


def _timed(fn):
    t0 = time.monotonic()
    try:
        fn()
        err = None
    except Exception as exc:   # the test inspects type and message
        err = exc
    return err, time.monotonic() - t0


def _report(err, elapsed, after_ok=True) -> dict:
    return {"error": None if err is None else f"{type(err).__name__}: {err}",
            "agreement": isinstance(err, AgreementError), "value_error": isinstance(err, ValueError),
            "type_error": isinstance(err, TypeError), "elapsed": elapsed, "after_ok": bool(after_ok)}


def _roundtrip_ok(mesh) -> bool:
    x = torch.randn(1, 10, 2, 4, generator=torch.Generator().manual_seed(3))
    return bool(torch.equal(usp_hal.unshard(usp_hal.shard(x, mesh=mesh), mesh=mesh), x))


def unshard_one_bad(what: str, U: int = 1, R: int = 2) -> dict:
    """unshard where only rank 1 passes a bad argument."""
    mesh = get_mesh(U, R)
    bad = dist.get_rank() == 1
    x = torch.randn(1, 10, 2, 4, generator=torch.Generator().manual_seed(0))
    cu = [0, 4, 10]
    local = usp_hal.shard(x, layout="varlen_zigzag", mesh=mesh, cu_seqlens=cu)
    kw: dict = {"layout": "varlen_zigzag", "mesh": mesh, "cu_seqlens": cu}
    if bad:
        if what == "seq_dim":
            kw["seq_dim"] = 7
        elif what == "ndim9":
            local = local.reshape(local.shape + (1,) * 5)             # 9-D
        elif what == "cu_malformed":
            kw["cu_seqlens"] = [1, 10]                                 # does not start at 0
        elif what == "cu_other":
            kw["cu_seqlens"] = [0, 6, 10]                              # valid, but not what the others pass
        elif what == "cu_too_long":
            kw["cu_seqlens"] = [0, 4, 12]
        elif what == "not_a_tensor":
            local = local.tolist()
        elif what == "layout":
            kw["layout"] = "no-such-layout"
        elif what == "reduce_grad":
            kw["reduce_grad"] = True
    if what == "cu_all_wrong":                                         # every rank: ends past the parts
        kw["cu_seqlens"] = [0, 4, 12]
    err, elapsed = _timed(lambda: usp_hal.unshard(local, **kw))
    return _report(err, elapsed, _roundtrip_ok(mesh))


def shard_one_bad(what: str, U: int = 1, R: int = 2) -> dict:
    """shard is local (no collective): a bad argument raises on its rank only, at once, and
    the group is not disturbed."""
    mesh = get_mesh(U, R)
    x = torch.randn(1, 10, 2, 4)
    kw: dict = {"mesh": mesh}
    if dist.get_rank() == 1:
        kw.update({"seq_dim": 9} if what == "seq_dim" else {"cu_seqlens": [0, 4, 12]})
    err, elapsed = _timed(lambda: usp_hal.shard(x, **kw))
    return _report(err, elapsed, _roundtrip_ok(mesh))


def init_one_bad() -> dict:
    """init_sequence_parallel with a different ulysses_degree on rank 1."""
    u = 1 if dist.get_rank() == 1 else 2
    err, elapsed = _timed(lambda: usp_hal.init_sequence_parallel(u, None, set_default=False))
    return _report(err, elapsed, _roundtrip_ok(get_mesh(1, dist.get_world_size())))


def shard_batch_one_bad(what: str) -> dict:
    """shard_batch with a bad (or different) batch on rank 1."""
    from usp_hal.integrations.transformers import shard_batch
    mesh = get_mesh(1, dist.get_world_size())
    ids = torch.arange(24).view(2, 12)
    batch: dict = {"input_ids": ids, "labels": ids.clone()}
    if dist.get_rank() == 1:
        if what == "no_ids":
            batch = {"labels": ids.clone()}
        elif what == "padding":
            batch["attention_mask"] = torch.ones(2, 12, dtype=torch.long).index_fill(1, torch.tensor([11]), 0)
        elif what == "other_batch":
            batch["input_ids"] = ids + 1
        elif what == "extra_key":
            batch["shift_labels"] = ids.clone()
    err, elapsed = _timed(lambda: shard_batch(batch, mesh, layout="zigzag"))
    return _report(err, elapsed, _roundtrip_ok(mesh))


def sync_gradients_one_bad() -> dict:
    from usp_hal.integrations import sync_gradients
    mesh = get_mesh(1, dist.get_world_size())
    lin = torch.nn.Linear(3, 2)
    lin(torch.ones(1, 3)).sum().backward()
    loss = 1.0 if dist.get_rank() == 1 else torch.tensor(1.0)
    err, elapsed = _timed(lambda: sync_gradients(lin, mesh, loss=loss))
    return _report(err, elapsed, _roundtrip_ok(mesh))


def agree_cases() -> dict:
    """The primitive itself: types, labels, check, and the values returned."""
    rank = dist.get_rank()
    out = {}
    out["rows"] = agree(None, None, what="t", values=[rank, 7])
    err, _ = _timed(lambda: agree(TypeError("not a tensor") if rank == 1 else None, None, what="t1"))
    out["type"] = _report(err, 0.0)
    err, _ = _timed(lambda: agree(ValueError("t2: bad") if rank == 0 else KeyError("k") if rank == 1 else None,
                                  None, what="t2"))
    out["mixed"] = _report(err, 0.0)
    err, _ = _timed(lambda: agree(None, None, what="t3", values=[1, rank], same=("a", "b")))
    out["labels"] = _report(err, 0.0)
    err, _ = _timed(lambda: agree(None, None, what="t4", values=[rank],
                                  check=lambda rows: None if sum(r[0] for r in rows) == 99 else "sum is not 99"))
    out["check"] = _report(err, 0.0)
    err, _ = _timed(lambda: agree("short" if rank == 1 else None, None, what="t5", values=[] if rank == 1 else [1, 2],
                                  width=2))
    out["width"] = _report(err, 0.0)
    out["after"] = agree(None, None, what="t6", values=[5], same=True)
    return out
