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


# ----------------------------------------------------------------------------- dying / skipping ranks
FAULT_TIMEOUT = 4.0     # seconds: the process groups' timeout in these cases (each case waits it out once)


def _survivors_raise(res, survivors, limit):
    for r in survivors:
        status, val = res[r][0], res[r][1]
        assert status == "ok", res
        assert val["error"], f"rank {r} did not raise: {res}"
        assert val["elapsed"] <= limit, f"rank {r} took {val['elapsed']:.1f}s (limit {limit:.1f}s): {res}"
        # the message names the call and the group
        assert " on the " in val["error"] and "group (ranks " in val["error"], val["error"]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["u2r2-exit", "u2r2-skip", "dp-replicas"])
def test_survivors_raise_within_the_timeout(case):
    from tests.mp import WorkerPool
    if case == "u2r2-exit":       # a rank dies inside a call; the world group's timeout is inherited
        pool, kw, survivors = WorkerPool(4, pg_timeout=FAULT_TIMEOUT), dict(U=2, R=2, plan={3: "exit"}), [0, 1, 2]
    elif case == "u2r2-skip":     # a rank skips a call; the timeout is given to init_sequence_parallel
        pool = WorkerPool(4)      # world group: the default (long) timeout
        kw, survivors = dict(U=2, R=2, plan={1: "skip"}, mesh_timeout=FAULT_TIMEOUT), [0, 2, 3]
    else:                         # two data-parallel replicas of a ring of 2: one rank dies, one skips
        pool = WorkerPool(4, pg_timeout=FAULT_TIMEOUT)
        kw, survivors = dict(U=1, R=2, plan={1: "exit", 3: "skip"}), [0, 2]
    res = pool.run_expect(dist_faults.fault_call, survivors, timeout=90, **kw)
    _survivors_raise(res, survivors, 1.5 * FAULT_TIMEOUT)


# ----------------------------------------------------------------------------- mismatches
def test_mesh_degree_mismatch_raises_on_every_rank(pools):
    for r in pools(2).run(dist_faults.mesh_degree_mismatch, timeout=60):
        assert r["error"] and "different arguments" in r["error"], r
        assert r["after_ok"], r


def test_alibi_slope_values_are_compared(pools):
    for msg in pools(2).run(dist_faults.alibi_values_differ, timeout=60):
        assert msg and "alibi" in msg and "disagree" in msg, msg


def test_repeated_agreement_still_sees_another_ranks_change(pools):
    """After calls of one shape (their agreement a single comparison), rank 1 alone changing an
    option is refused on both ranks, and rank 1 alone changing its length gives a new, right
    plan: the repeat lane never hides what another rank did."""
    for r in pools(2).run(dist_faults.repeat_then_change, timeout=90):
        steps = r["steps"]
        ok = [0, 1, 2, 4, 5, 6, 7]
        for i in ok:
            assert steps[i]["error"] is None, (i, steps[i])
            assert steps[i]["max_err"] < 1e-10, (i, steps[i])
        assert steps[1]["hit"] and steps[2]["hit"], steps      # the repeat lane was taken
        assert steps[3]["error"] and "disagree" in steps[3]["error"] and "causal" in steps[3]["error"], steps[3]
        layout = r["layout"]
        for i in (0, 1, 4):
            assert layout[i]["error"] is None and layout[i]["max_err"] < 1e-10, (i, layout[i])
        for i in (2, 3):
            assert layout[i]["error"] and "do not match" in layout[i]["error"], (i, layout[i])


def test_positions_reveal_a_wrong_layout(pools):
    for r in pools(2).run(dist_faults.positions_check, timeout=60, given="basic"):
        assert r["error"] and "positions" in r["error"], r
    for r in pools(2).run(dist_faults.positions_check, timeout=60, given="zigzag"):
        assert r["error"] is None and r["err"] <= 1, r


# ----------------------------------------------------------------------------- non-finite inputs
@pytest.mark.parametrize("which,row", [("q", 3), ("q", 12), ("k", 5), ("v", 9)])
@pytest.mark.parametrize("U,R", [(1, 2), (2, 1)])
def test_nan_inputs_come_out_as_on_one_device(pools, which, row, U, R):
    res = pools(2).run(dist_faults.nan_input, timeout=60, U=U, R=R, which=which, row=row)
    assert sum(r["nan_rows"] for r in res) > 0, res     # the reference has NaN rows: the check can fail
    for r in res:
        assert r["same_nan"] and r["err"] <= 1, r


# ----------------------------------------------------------------------------- the returned tensor
def _inplace_result(r: dict, works: bool) -> None:
    assert r["contiguous"], r
    if works:
        assert "raised" not in r and all(v <= 1 for k, v in r.items() if k != "contiguous"), r
    else:       # what torch's own (flash) attention does when its saved output was changed
        assert "modified by an inplace operation" in r.get("raised", ""), r


@pytest.mark.parametrize("U,R", [(1, 2), (2, 1)])
def test_output_in_place_before_backward(pools, U, R):
    """The output, changed in place before the backward: right gradients on Ulysses (whose
    backward keeps its head-layout copy), autograd's in-place error on a ring of one Ulysses rank,
    whose backward reads the returned output itself (one output-sized tensor less per call)."""
    for r in pools(2).run(dist_faults.inplace_on_output, timeout=60, U=U, R=R):
        _inplace_result(r, works=U > 1)


def test_output_in_place_before_backward_single_process():
    _inplace_result(dist_faults.inplace_on_output(U=1, R=1), works=False)


def test_a_refused_ring_block_is_refused_before_any_data_moves(pools):
    for r in pools(2).run(dist_faults.block_refused_before_data, timeout=60):
        assert r["error"] and "ring block" in r["error"], r
        assert sum(r["counts"].values()) == 0, r


def test_a_module_moved_to_another_mesh_and_mode(pools):
    for r in pools(2).run(dist_faults.new_mesh_and_modes, timeout=90):
        assert len(r["errs"]) == 8 and max(r["errs"]) < 1e-10, r
        assert r["mode"] == "every_call", r
