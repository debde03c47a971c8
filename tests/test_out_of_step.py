"""Ranks whose calls stop matching must all raise the same clear error, quickly, never pair
one call's exchange with another's (wrong values, a hang, or an aborted process).  Each case
runs on its own pool (a rank may die or hang on a broken build) whose process groups time
out after PG_TIMEOUT seconds."""
from __future__ import annotations

import pytest

from tests import dist_out_of_step
from tests.mp import WorkerPool

PG_TIMEOUT = 15.0


def _run(fn, world=2, timeout=90, **kw):
    pool = WorkerPool(world, pg_timeout=PG_TIMEOUT)
    res = pool.run_expect(fn, list(range(world)), timeout=timeout, **kw)
    for r in range(world):
        assert res[r][0] == "ok", res
    return [res[r][1] for r in range(world)]


@pytest.mark.multirank
@pytest.mark.timeout(150)
@pytest.mark.parametrize("same_width", [True, False])
def test_two_different_agreements_at_one_point_raise_on_every_rank(same_width):
    res = _run(dist_out_of_step.two_agreements, same_width=same_width)
    for rep in res:
        assert rep["error"] is not None, res
        assert "not at the same agreement" in rep["error"], rep
        assert "'alpha'" in rep["error"] and "'beta'" in rep["error"], rep
        assert rep["elapsed"] < PG_TIMEOUT / 2, rep
        assert rep["after_ok"], rep
    assert len({r["error"] for r in res}) == 1, res
