"""One rank's bad input is an error on every rank, never a hang or a silently wrong result:
scales, masks compared by what they select (every form), masks whose data change, a mask that
fails on one rank, and the group stays usable afterwards.  Results against float64."""
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import dist_agreed as da

pytestmark = pytest.mark.multirank

settings.register_profile("agreed-ci", max_examples=12, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_AGREED_PROFILE", "agreed-ci"))
FORMS = ["partial", "default", "object", "list", "tensor", "global", "mask", "slices", "helper"]


def _same_everywhere(res, needle):
    for r in res:
        assert r["error"] is not None and needle in r["error"], res
    assert all(r["error"] == res[0]["error"] for r in res), res
    for r in res:
        assert r["after"] is not None and r["after"] <= 1, res


# ----------------------------------------------------------------------------- 8
@pytest.mark.timeout(120)
@pytest.mark.parametrize("scale", [-0.5, 0.0, float("inf"), float("nan")])
@pytest.mark.parametrize("only_rank", [None, 1])
def test_bad_softmax_scale_is_refused_on_every_rank(pools, scale, only_rank):
    res = pools(2).run(da.scale_case, timeout=30, scale=scale, only_rank=only_rank)
    if only_rank is None:
        _same_everywhere(res, "softmax_scale")
    else:      # rank 0's own call was fine; it reports rank 1's refusal
        for r in res:
            assert r["error"] is not None and "softmax_scale" in r["error"], res
            assert r["after"] <= 1, res


def test_positive_scale_matches_float64(pools):
    for r in pools(2).run(da.scale_case, timeout=30, scale=0.3):
        assert r["error"] is None and r["worst"] <= 1, r


# ----------------------------------------------------------------------------- 10
@pytest.mark.timeout(120)
def test_mask_of_the_wrong_shape_names_the_function_and_the_shape(pools):
    res = pools(2).run(da.wrong_shape_case, timeout=30)
    _same_everywhere(res, "flat_mask_mod")
    assert "[B|1, H|1, Lq, Lk]" in res[0]["error"], res


# ----------------------------------------------------------------------------- 3
@pytest.mark.timeout(180)
@pytest.mark.parametrize("form", FORMS)
def test_masks_that_differ_on_one_rank_raise_on_every_rank(pools, form):
    res = pools(2).run_all(da.forms_case, timeout=30, forms=[form, form], params=[4, 8])
    for r in res:
        assert r[0] == "ok", res
        v = r[1]
        assert v["error"] and "different" in v["error"], res
        assert v["error2"] and "different" in v["error2"], res
        assert v["after"] <= 1, res


@pytest.mark.timeout(120)
@pytest.mark.parametrize("forms", [("partial", "object"), ("default", "global"), ("tensor", "list")])
def test_equal_masks_in_different_forms_agree_and_match_float64(pools, forms):
    for v in pools(2).run(da.forms_case, timeout=30, forms=list(forms), params=[8, 8], causal=True):
        assert v["error"] is None and v["worst"] <= 1, v
        assert v["error2"] is None and v["worst2"] <= 1, v


def _dense(form, p):
    import usp_hal.sequence.masks as M
    return M.Mask.of(da.make_mask(form, p)).keep(torch.arange(da.S), torch.arange(da.S))


@pytest.mark.timeout(600)
@settings(PROFILE)
@given(forms=st.tuples(st.sampled_from(FORMS), st.sampled_from(FORMS)),
       params=st.tuples(st.integers(2, 16), st.integers(2, 16)), causal=st.booleans())
def test_property_masks_in_every_form_agree_only_when_equal(pools, forms, params, causal):
    keep = [_dense(f, p) for f, p in zip(forms, params)]
    if causal:       # what the call keeps: the mask and'ed with causal
        keep = [m & torch.ones(da.S, da.S, dtype=torch.bool).tril() for m in keep]
    same = torch.equal(keep[0], keep[1])
    res = pools(2).run_all(da.forms_case, timeout=30, forms=list(forms), params=list(params), causal=causal)
    for r in res:
        assert r[0] == "ok", res
        v = r[1]
        if same:
            assert v["error"] is None and v["worst"] <= 1 and v["worst2"] <= 1, (forms, params, v)
        else:
            assert v["error"] and "different" in v["error"], (forms, params, v)
            assert v["error2"] and "different" in v["error2"], (forms, params, v)
        assert v["after"] <= 1, v


# ----------------------------------------------------------------------------- 4
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["tensor", "global", "from_numpy", "dot_data", "numpy_view"])
def test_mask_data_changed_between_calls_is_never_stale(pools, how):
    # before: from_numpy over a refilled array kept the first batch's mask (dot_data and
    # numpy_view, writes that bump no version, pass the data as Mask.from_mod(..., data=))
    for steps in pools(2).run(da.changing_data_case, timeout=60, how=how):
        for err, worst in steps:
            assert err is None and worst <= 1, steps


@pytest.mark.timeout(120)
def test_mask_data_changed_on_one_rank_raises_on_every_rank(pools):
    res = pools(2).run(da.changing_data_case, timeout=60, how="tensor", ranks_differ=True)
    for steps in res:
        assert steps[2][0] and "different" in steps[2][0], steps
        for err, worst in steps[:2] + steps[3:]:
            assert err is None and worst <= 1, steps


def test_mask_data_changed_one_process():
    import usp_hal
    import usp_hal.sequence.masks as M
    attn = usp_hal.LongContextAttention(attn_type="sdpa")
    q, k, v = da._inputs(1)
    docs = torch.zeros(da.S, dtype=torch.long)

    def docs_mod(b, h, q, kv):
        return docs[q] == docs[kv]
    mask = M.Mask.from_mod(docs_mod)
    for n in (32, 4, 8):
        docs.copy_(torch.arange(da.S) // n)
        out = attn(q, k, v, mask=mask)
        assert da._err(out, da._ref(q, k, v, mask=mask), torch.float64) <= 1, n


# ----------------------------------------------------------------------------- 2
@pytest.mark.timeout(120)
@pytest.mark.parametrize("steady", [False, True])
@pytest.mark.parametrize("check_ranks", ["every_call", "off"])
def test_mask_mod_raising_on_one_rank_raises_on_every_rank(pools, steady, check_ranks):
    # "off" too: a mask not digested before the agreement is flagged in its length exchange
    res = pools(2).run(da.raising_mask_case, timeout=30, steady=steady, check_ranks=check_ranks)
    for r in res:
        assert r["error"] and "IndexError" in r["error"], res
        assert r["elapsed"] < 10, res
        assert r["after"] <= 1, res


# ----------------------------------------------------------------------------- 6
@pytest.mark.timeout(120)
def test_equal_sinks_match_float64_and_are_read_once_per_version(pools):
    for r in pools(2).run(da.sinks_case, timeout=60, what="same"):
        assert r["errors"] == [None] * 4, r
        assert r["out"] <= 1 and r["dq"] <= 1 and r["dsinks"] <= 1, r
        assert r["reads"] == 1, r         # four calls with one tensor version: one digest


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["values", "grad"])
def test_sinks_that_differ_on_one_rank_raise_on_every_rank(pools, what):
    res = pools(2).run(da.sinks_case, timeout=60, what=what)
    for r in res:
        assert all(e is not None and "sinks" in e for e in r["errors"]), r
        assert r["after"] <= 1, r
    assert res[0]["errors"] == res[1]["errors"]


@pytest.mark.timeout(120)
def test_sinks_changed_in_place_on_one_rank_raise_on_every_rank(pools):
    for r in pools(2).run(da.sinks_case, timeout=60, what="inplace"):
        assert r["errors"][:2] == [None, None], r
        assert all(e is not None and "sinks" in e for e in r["errors"][2:]), r


# ----------------------------------------------------------------------------- 7 + decode host reads
@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_decode_inputs_that_differ_raise_on_every_rank_with_check_inputs(pools, which):
    res = pools(2).run(da.decode_inputs_case, timeout=60, which=which, check_inputs=True)
    for r in res:
        steps = r["steps"]
        assert all(isinstance(x, float) and x <= 1 for x in steps[:2] + steps[4:]), steps
        assert all(isinstance(x, str) and "q, k and v" in x for x in steps[2:4]), steps
        assert all(n == 1 for n in r["reads"]), r      # the debug mode: one device->host read per call
    assert res[0]["steps"][2:4] == res[1]["steps"][2:4]


@pytest.mark.timeout(120)
def test_default_decode_reads_nothing_from_the_device(pools):
    for r in pools(2).run(da.decode_inputs_case, timeout=60, which="none", check_inputs=False):
        assert all(isinstance(x, float) and x <= 1 for x in r["steps"]), r
        assert r["reads"] == [0] * 6, r


# ----------------------------------------------------------------------------- 9
def _free_ports(n):
    import socket
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


@pytest.mark.timeout(180)
def test_reinitialised_groups(pools):
    from tests.mp import WorkerPool
    pool = WorkerPool(2)          # its group is destroyed: a pool of its own
    try:
        res = pool.run(da.reinit_case, timeout=150, ports=_free_ports(8))
    finally:
        pool.close()
    for r in res:
        assert r["stale"] and "usp_hal" in r["stale"] and "destroyed" in r["stale"], r
        assert all(e <= 1 for e in r["errs"]), r
        # flat after the first cycles: nothing keeps the destroyed groups (and their sockets, threads) alive
        assert r["fds"][-1] <= r["fds"][1] + 1 and r["threads"][-1] <= r["threads"][1], r


# ----------------------------------------------------------------------------- 1
@pytest.mark.timeout(120)
@pytest.mark.parametrize("what,needle,kind", [
    ("list", "query must be a torch.Tensor, got list", "TypeError"),
    ("numpy", "query must be a torch.Tensor, got ndarray", "TypeError"),
    ("mask_type", "mask must be a usp_hal.sequence.masks.Mask", "TypeError"),
    ("odd_mask", "OddError: the caller's own failure", "USPError"),
    ("window", "window_size", "USPError"),
])
def test_an_error_on_one_rank_before_the_agreement_is_raised_on_every_rank(pools, what, needle, kind):
    res = pools(2).run(da.bad_argument_case, timeout=30, what=what)
    for r in res:
        assert r["error"] and "rank(s) [1]" in r["error"] and needle in r["error"], res
        assert kind in r["kinds"] and "USPError" in r["kinds"], res
        assert r["elapsed"] < 10, res
        assert r["after"] <= 1, res       # the group pairs the next calls correctly
    assert res[0]["error"] == res[1]["error"]


def test_steady_masked_calls_evaluate_no_mask(monkeypatch):
    """Steady state (same length, same mask state): the mask is not evaluated again; a change of
    its data is (and the result follows it)."""
    import usp_hal
    import usp_hal.sequence.masks as M
    attn = usp_hal.LongContextAttention(attn_type="sdpa")
    q, k, v = da._inputs(6)
    docs = torch.arange(da.S) // 8

    def docs_mod(b, h, q, kv):
        return docs[q] == docs[kv]
    mask = M.Mask.from_mod(docs_mod)
    for _ in range(2):
        attn(q, k, v, mask=mask)
    seen = [0]
    keep = M.Mask.keep

    def counting(self, *a, **kw):
        seen[0] += 1
        return keep(self, *a, **kw)
    monkeypatch.setattr(M.Mask, "keep", counting)
    for _ in range(3):
        out = attn(q, k, v, mask=mask)
    assert seen[0] == 0
    assert da._err(out, da._ref(q, k, v, mask=mask), torch.float64) <= 1
    docs[:] = torch.arange(da.S) // 4          # in place
    out = attn(q, k, v, mask=mask)
    assert seen[0] > 0
    assert da._err(out, da._ref(q, k, v, mask=mask), torch.float64) <= 1


@pytest.mark.timeout(120)
def test_a_bad_packed_qkv_on_one_rank_is_refused_on_every_rank(pools):
    res = pools(2).run(da.bad_packed_case, timeout=30)
    for r in res:
        assert r["error"] and "rank(s) [1]" in r["error"] and "qkv must be" in r["error"], res
        assert r["after"] <= 1, res
