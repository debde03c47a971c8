"""Every communicating entry point agrees before it communicates (``usp_hal.parallel.comm.agree``): a bad
argument on ONE rank only raises on every rank, within the group timeout, and the group still
works afterwards.  The pool's process groups time out after PG_TIMEOUT seconds, so a rank left
waiting in a collective would show as an error naming the timeout (or a hung case), never as
the quick refusal these tests expect."""
from __future__ import annotations

import pytest

from tests import dist_agreement
from tests.mp import WorkerPool

PG_TIMEOUT = 20.0     # seconds: a rank waiting in a collective would fail after this
QUICK = 5.0           # every rank must have raised well before it


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2, pg_timeout=PG_TIMEOUT)
    yield p
    p.close()


def _all_refused(res, *needles):
    for rank, r in enumerate(res):
        assert r[0] == "ok", res                      # the rank function itself returned
        rep = r[1]
        assert rep["error"] is not None, (rank, res)
        assert rep["value_error"] and rep["agreement"], (rank, rep)
        assert rep["elapsed"] < QUICK, (rank, rep)    # raised at once, nobody waited for a timeout
        assert rep["after_ok"], (rank, rep)           # the group still works
        for n in needles:
            assert n in rep["error"], (rank, n, rep["error"])
    # the same message on every rank
    assert len({r[1]["error"] for r in res}) == 1, res


@pytest.mark.multirank
@pytest.mark.timeout(120)
@pytest.mark.parametrize("what,needles", [
    ("seq_dim", ["unshard", "rank 1", "seq_dim=7 is out of range"]),
    ("ndim9", ["unshard", "rank 1", "at most 8 dims", "9-D"]),
    ("cu_malformed", ["unshard", "rank 1", "cu_seqlens must start at 0"]),
    ("cu_other", ["unshard", "cu_seqlens (digest)"]),
    ("cu_too_long", ["unshard", "cu_seqlens (digest)"]),
    ("cu_all_wrong", ["unshard", "cu_seqlens ends at 12", "10 tokens"]),
    ("not_a_tensor", ["unshard", "rank 1", "expected a tensor"]),
    ("layout", ["unshard", "rank 1", "unknown layout"]),
    ("reduce_grad", ["unshard", "reduce_grad"]),
])
def test_unshard_bad_argument_on_one_rank_raises_on_every_rank(pool, what, needles):
    res = pool.run_all(dist_agreement.unshard_one_bad, what=what, timeout=60)
    _all_refused(res, *needles)
    if what == "not_a_tensor":
        assert all(r[1]["type_error"] for r in res), res     # the refusal's type is kept


@pytest.mark.multirank
@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["seq_dim", "cu"])
def test_shard_is_local_a_bad_argument_raises_only_where_it_was_passed(pool, what):
    res = pool.run_all(dist_agreement.shard_one_bad, what=what, timeout=60)
    assert res[0][0] == "ok" and res[0][1]["error"] is None, res
    bad = res[1][1]
    assert bad["error"] and bad["value_error"] and not bad["agreement"], res
    assert all(r[1]["elapsed"] < QUICK and r[1]["after_ok"] for r in res), res


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_init_sequence_parallel_different_degrees_raises_on_every_rank(pool):
    res = pool.run_all(dist_agreement.init_one_bad, timeout=60)
    _all_refused(res, "init_sequence_parallel", "ulysses_degree: rank 0=2, rank 1=1")


@pytest.mark.multirank
@pytest.mark.timeout(120)
@pytest.mark.parametrize("what,needles", [
    ("no_ids", ["shard_batch", "rank 1", "neither input_ids nor inputs_embeds"]),
    ("padding", ["shard_batch", "different batches", "the keys of the batch"]),    # a padding mask on rank 1 only
    ("other_batch", ["shard_batch", "different batches", "input_ids, labels differ"]),
    ("extra_key", ["shard_batch", "different batches", "the keys of the batch"]),
])
def test_shard_batch_bad_batch_on_one_rank_raises_on_every_rank(pool, what, needles):
    pytest.importorskip("transformers")
    res = pool.run_all(dist_agreement.shard_batch_one_bad, what=what, timeout=90)
    _all_refused(res, *needles)


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_sync_gradients_bad_loss_on_one_rank_raises_on_every_rank(pool):
    res = pool.run_all(dist_agreement.sync_gradients_one_bad, timeout=60)
    _all_refused(res, "sync_gradients", "rank 1", "loss must be a tensor")
    assert all(r[1]["type_error"] for r in res), res


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_agree_primitive(pool):
    res = pool.run_all(dist_agreement.agree_cases, timeout=60)
    assert all(r[0] == "ok" for r in res), res
    reps = [r[1] for r in res]
    for rep in reps:
        assert rep["rows"] == [[0, 7], [1, 7]]
        assert rep["type"]["type_error"] and rep["type"]["agreement"], rep["type"]
        assert rep["type"]["error"] == "AgreementTypeError: t1: rank 1: not a tensor"
        # different refusal types: a plain agreement ValueError naming both ranks
        assert rep["mixed"]["error"].startswith("AgreementValueError: t2: rank 0: bad; rank 1: 'k'"), rep["mixed"]
        assert not rep["mixed"]["type_error"]
        assert rep["labels"]["error"] == "AgreementValueError: t3: b: rank 0=0, rank 1=1", rep["labels"]
        assert rep["check"]["error"] == "AgreementValueError: t4: sum is not 99", rep["check"]
        assert rep["width"]["error"] == "AgreementValueError: t5: rank 1: short", rep["width"]
        assert rep["after"] == [[5], [5]]
    assert reps[0] == reps[1]
