"""Ranks whose calls stop matching must all raise the same clear error, quickly, never pair
one call's exchange with another's (wrong values, a hang, or an aborted process).  The cases
where a rank is left in a collective run on a pool of their own (a rank may die or hang on a
broken build) whose process groups time out after WAIT_TIMEOUT seconds; the others share one
pool whose groups time out after PG_TIMEOUT seconds."""
from __future__ import annotations

import pytest

from tests import dist_out_of_step
from tests.mp import WorkerPool

PG_TIMEOUT = 10.0
# the group timeout of the cases that wait it out (a rank left in a collective): shorter, so
# that each such case costs seconds; what raises at once is still held to half of it
WAIT_TIMEOUT = 5.0


def _run(fn, world=2, timeout=90, pg_timeout=PG_TIMEOUT, pool=None, **kw):
    """``fn`` on a pool of its own (closed after: a rank may be dead or stuck), or on ``pool``
    (the cases after which every rank must have raised and the group still work: a case that
    kills or hangs ranks fails, and RankPool.run_all restarts the pool for the next one)."""
    if pool is None:
        pool = WorkerPool(world, pg_timeout=pg_timeout)
        res = pool.run_expect(fn, list(range(world)), timeout=timeout, **kw)
    else:
        res = dict(enumerate(pool.run_all(fn, timeout=timeout, **kw)))
    for r in range(world):
        assert res[r][0] == "ok", res
    return [res[r][1] for r in range(world)]


@pytest.fixture(scope="module")
def shared():
    """One 2-rank pool with PG_TIMEOUT for the cases that leave the group usable (each pool
    start is seconds of Python starts)."""
    pool = WorkerPool(2, pg_timeout=PG_TIMEOUT)
    yield pool
    pool.close()


@pytest.mark.multirank
@pytest.mark.timeout(150)
@pytest.mark.parametrize("same_width", [True, False])
def test_two_different_agreements_at_one_point_raise_on_every_rank(shared, same_width):
    res = _run(dist_out_of_step.two_agreements, pool=shared, same_width=same_width)
    for rep in res:
        assert rep["error"] is not None, res
        assert "not at the same agreement" in rep["error"], rep
        assert "'alpha'" in rep["error"] and "'beta'" in rep["error"], rep
        assert rep["elapsed"] < PG_TIMEOUT / 2, rep
        assert rep["after_ok"], rep
    assert len({r["error"] for r in res}) == 1, res


@pytest.mark.slow          # the other rank waits out the group timeout
@pytest.mark.multirank
@pytest.mark.timeout(200)
@pytest.mark.parametrize("change,U,R", [("causal", 1, 2), ("list", 2, 1), ("length", 1, 2)])
def test_first_call_changed_on_one_rank_ends_the_groups_use_on_every_rank(change, U, R):
    """check_ranks="first_call" documents: a call that is not the first one ends the use of
    the mesh's groups on the rank that sees it; the others, gone on into the call's data
    exchange, fail at the group timeout; every later call on every rank is refused at once
    (before, the changed rank's next call paired with the others' current one: wrong
    outputs, then a hang)."""
    res = _run(dist_out_of_step.first_call_changes_on_one_rank, change=change, U=U, R=R, timeout=150,
               pg_timeout=WAIT_TIMEOUT)
    changed, others = res[1], res[:1]
    assert changed["second"]["error"].startswith("OutOfStepError"), changed
    assert "check_ranks='first_call'" in changed["second"]["error"], changed
    assert changed["second"]["elapsed"] < WAIT_TIMEOUT / 2, changed
    for rep in others:
        assert rep["second"]["error"] is not None and "CommError" in rep["second"]["error"], rep
        assert rep["second"]["elapsed"] < 2 * WAIT_TIMEOUT, rep
    for rep in res:
        third = rep["third"]
        assert third["error"] is not None and third["error"].startswith("OutOfStepError"), rep
        assert "ended on this rank" in third["error"], rep
        assert third["elapsed"] < WAIT_TIMEOUT / 2, rep


@pytest.mark.multirank
@pytest.mark.timeout(150)
@pytest.mark.parametrize("what,needle", [
    ("state_batch", "batch sizes"),
    ("conv_batch", "batch sizes"),
    ("recurrence", "sequence mixing differently"),
    ("conv_exchange", "sequence mixing differently"),
    ("conv_lengths", "per-rank lengths"),
])
def test_hybrid_mixers_run_differently_on_one_rank_raise_on_every_rank(shared, what, needle):
    """head_parallel, halo_causal_conv and state passing agree on their mode, batch, shapes
    and per-rank lengths before data moves (before: an aborted process, garbage agreement
    values or a silently short output)."""
    res = _run(dist_out_of_step.mixer_mismatch, pool=shared, what=what)
    for rep in res:
        assert rep["error"] is not None and rep["error"].split(":")[0].endswith("ValueError"), res
        assert needle in rep["error"], rep
        assert rep["elapsed"] < PG_TIMEOUT / 2, rep
        assert rep["after_ok"], rep
    assert len({r["error"] for r in res}) == 1, res
