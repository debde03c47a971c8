"""The host-read meter (usp_hal.harness.hostreads) and the benchmark built on it
(benchmarks/host_reads.py): each kind of host read of tensor data is counted once, reads of
the side group's tensors apart, collectives per group; the steady call with checks after the
first call reads no tensor data and sends nothing on the side group."""
from __future__ import annotations

import numpy  # noqa: F401  (x.numpy() below)
import pytest
import torch

from usp_hal.harness.hostreads import HostReadMeter


def test_each_kind_of_host_read_is_counted_once():
    x = torch.arange(1.0, 5.0)
    outside = x.sum().item()           # not counted: before the meter
    with HostReadMeter() as m:
        x.sum().item()
        x.tolist()
        bool(x[0] > 0)
        float(x[1])
        int(x[2])
        x.cpu()
        x.numpy()
        torch.nonzero(x)
        [0, 1, 2, 3, 4][x[1].long()]   # __index__
    assert outside == 10.0
    assert m.reads == {"device": 9, "side": 0}, m.sites
    kinds = {k.split()[-1] for k in m.sites}
    assert kinds == {".item()", ".tolist()", "bool(tensor)", "float(tensor)", "int(tensor)", ".cpu()", ".numpy()",
                     "aten.nonzero", "index(tensor)"}
    # the wrappers are gone afterwards, and nothing more is counted
    assert "item" not in torch.Tensor.__dict__ and "tolist" not in torch.Tensor.__dict__
    x.sum().item()
    assert m.reads["device"] == 9


def test_a_planted_item_in_library_code_is_found_with_its_site():
    from usp_hal.dispatch.reference import reference_attention
    q = torch.randn(1, 8, 2, 4)
    with HostReadMeter() as m:
        reference_attention(q, q, q)
    assert m.reads["device"] == 0, m.sites       # the reference reads nothing on the host
    with HostReadMeter() as m:
        out, _ = reference_attention(q, q, q)
        float(out.abs().max())                   # a planted read here
    assert m.reads["device"] == 1
    assert any("test_hostreads.py" in k and "float(tensor)" in k for k in m.sites), m.sites


def side_group_case() -> dict:
    import torch.distributed as dist
    side = dist.new_group([0, 1], backend="gloo")
    t = torch.tensor([dist.get_rank()], dtype=torch.long)
    out = torch.empty(2, dtype=torch.long)
    with HostReadMeter(side_group=side) as m:
        dist.all_gather_into_tensor(out, t, group=side)
        rows = out.tolist()                      # a read of the side group's host tensor
        y = torch.ones(3)
        dist.all_reduce(y)                       # the default (device) group
        total = y.sum().item()                   # a device read
    return {"rows": rows, "total": total, **m.summary()}


def test_side_group_reads_and_collectives_are_counted_apart(pools):
    for r in pools(2).run(side_group_case, timeout=60):
        assert r["rows"] == [0, 1] and r["total"] == 6.0
        assert r["reads"] == {"device": 1, "side": 1}, r["sites"]
        assert r["collectives"] == {"device": 1, "side": 1}, r["coll_names"]


def ring_counts() -> list:
    from benchmarks.host_reads import rank_counts
    return rank_counts([("R2", 1, 2)], [], S=64, H=2, Hkv=1, D=8)


@pytest.mark.multirank
def test_steady_ring_call_reads_no_tensor_data(pools):
    """Ring-2, forward and forward+backward: with checks after the first call the steady call
    makes no host read and no side-group collective; with the check at every call, the one
    metadata all-gather runs on the side group and its result is the only thing read."""
    per_rank = pools(2).run(ring_counts, timeout=180)
    for rows in per_rank:
        assert len(rows) == 4
        for row in rows:
            assert row["reads"]["device"] == 0, row["sites"]
            assert row["collectives"]["device"] >= 1, row
            if row["check"] == "first call":
                assert row["reads"]["side"] == 0 and row["collectives"]["side"] == 0, row
            else:
                assert row["collectives"]["side"] == 1 and row["reads"]["side"] >= 1, row
