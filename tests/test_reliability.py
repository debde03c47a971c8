"""Faults and odd inputs: every case ends in the single-device result or in a clear error on
every rank within a bounded time, and the process group stays usable."""
import pytest

from tests import dist_faults

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("what", ["heads", "dtype", "ndim", "length"])
def test_unshard_mismatched_parts_raise_everywhere(pools, what):
    res = pools(2).run(dist_faults.unshard_mismatch, timeout=60, what=what)
    for r in res:
        assert r["error"] and "unshard" in r["error"], res
        assert r["elapsed"] < 5.0, res
        assert r["after_ok"], res


@pytest.mark.parametrize("U,R,layout", [(1, 2, "zigzag"), (2, 1, "basic"), (1, 2, "stripe")])
def test_unshard_is_differentiable(pools, U, R, layout):
    for errs in pools(2).run(dist_faults.unshard_gradient, timeout=60, U=U, R=R, layout=layout):
        assert all(v <= 1 for v in errs.values()), errs


def test_unshard_reduce_grad_for_rank_dependent_losses(pools):
    for errs in pools(2).run(dist_faults.unshard_gradient, timeout=60, U=1, R=2, reduce_grad=True):
        assert all(v <= 1 for v in errs.values()), errs


@pytest.mark.parametrize("layout", ["basic", "zigzag", "stripe"])
def test_mesh_local_positions(pools, layout):
    assert all(pools(4).run(dist_faults.local_positions_match, timeout=60, layout=layout))
