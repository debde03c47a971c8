"""Any shape through every layout and ring: odd head counts, odd lengths, GQA/MQA, the
positional arguments (window, alibi, softcap), and validation that ends in the same clear
error on every rank instead of a hang."""
import pytest

from tests import dist_cases

pytestmark = pytest.mark.multirank


def _check(results):
    for errs in results:
        bad = {k: v for k, v in errs.items() if not v <= 1.0}
        assert not bad, f"errors above tolerance (1.0 = limit): {bad} (all: {errs})"


def _run(pools, world, **kw):
    _check(pools(world).run(dist_cases.usp_case, timeout=120, **kw))


SPLITS = [(2, 2, 1), (4, 4, 1), (4, 2, 2), (3, 3, 1), (4, 1, 4)]
IDS = lambda s: f"w{s[0]}-u{s[1]}r{s[2]}"  # noqa: E731


@pytest.mark.parametrize("H", [1, 3, 5, 7])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("split", SPLITS[:4], ids=IDS)
def test_odd_head_counts(pools, split, causal, H):
    world, U, R = split
    _run(pools, world, U=U, R=R, H=H, causal=causal, layout="zigzag", S=16, B=2)


@pytest.mark.parametrize("H", [3, 5])
def test_odd_heads_bf16(pools, H):
    _run(pools, 4, U=4, R=1, H=H, causal=True, dtype="bf16", S=16)


@pytest.mark.parametrize("layout", ["basic", "zigzag", "stripe"])
@pytest.mark.parametrize("S", [7, 13, 31])
@pytest.mark.parametrize("split", [(2, 1, 2), (2, 2, 1), (4, 2, 2), (4, 1, 4), (3, 1, 3)], ids=IDS)
def test_odd_lengths(pools, split, S, layout):
    world, U, R = split
    _run(pools, world, U=U, R=R, S=S, causal=True, layout=layout, H=4)


@pytest.mark.parametrize("layout", ["basic", "zigzag", "stripe"])
def test_fewer_tokens_than_ranks(pools, layout):
    _run(pools, 4, U=2, R=2, S=3, causal=True, layout=layout, H=2)
    _run(pools, 4, U=1, R=4, S=2, causal=False, layout=layout, H=2)


@pytest.mark.parametrize("H,Hkv", [(8, 1), (8, 2), (6, 3), (6, 2), (4, 2)], ids=lambda x: str(x))
@pytest.mark.parametrize("split", SPLITS, ids=IDS)
def test_gqa_and_mqa(pools, split, H, Hkv):
    world, U, R = split
    _run(pools, world, U=U, R=R, H=H, Hkv=Hkv, causal=True, layout="zigzag", S=16, B=2)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["basic", "stripe"])
def test_gqa_odd_everything(pools, layout, dtype):
    _run(pools, 3, U=3, R=1, H=8, Hkv=2, S=11, causal=True, layout=layout, dtype=dtype)
    _run(pools, 4, U=2, R=2, H=3, Hkv=1, S=13, causal=True, layout=layout, dtype=dtype)


@pytest.mark.parametrize("window", [(3, 2), (4, 0), (0, 0), (6, -1)])
@pytest.mark.parametrize("layout", ["basic", "zigzag"])
@pytest.mark.parametrize("split", [(2, 1, 2), (4, 2, 2), (4, 1, 4)], ids=IDS)
def test_sliding_window_exact_across_ring(pools, split, layout, window):
    world, U, R = split
    _run(pools, world, U=U, R=R, S=21, layout=layout, causal=window[1] <= 0, window=window, H=2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("split", [(2, 1, 2), (4, 2, 2), (2, 2, 1)], ids=IDS)
def test_alibi_exact_across_ring(pools, split, causal):
    world, U, R = split
    _run(pools, world, U=U, R=R, S=17, layout="zigzag", causal=causal, alibi=True, H=4)


def test_softmax_scale_and_deterministic(pools):
    _run(pools, 4, U=2, R=2, S=16, causal=True, scale=0.3, H=4)


def _all_raise(results, *needles):
    assert all(r[0] == "err" for r in results), f"every rank must raise: {results}"
    for r in results:
        for needle in needles:
            assert needle in r[1], f"{needle!r} not in {r[1]!r}"


@pytest.mark.parametrize("what,needle", [("heads", "heads"), ("dtype", "dtype"), ("causal", "causal"),
                                         ("dropout", "dropout"), ("scale", "scale: rank 0=0.5, rank 1=0.3535"),
                                         ("deterministic", "deterministic: rank 0=1, rank 1=0")])
def test_mismatch_between_ranks_raises_everywhere(pools, what, needle):
    _all_raise(pools(2).run_all(dist_cases.expect_error, timeout=30, U=2, R=1, what=what), needle)
    # the group is still usable afterwards
    _check(pools(2).run(dist_cases.fresh_call_after_error, timeout=30))


def test_mismatch_in_a_ring_raises_everywhere(pools):
    _all_raise(pools(4).run_all(dist_cases.expect_error, timeout=30, U=2, R=2, what="heads", bad_rank=3), "heads")


def test_bad_shape_on_one_rank(pools):
    _all_raise(pools(2).run_all(dist_cases.bad_rank_shape, timeout=30), "batch, seq, heads, head_dim")


def test_lengths_not_matching_layout(pools):
    _all_raise(pools(2).run_all(dist_cases.wrong_lengths, timeout=30), "usp_hal.shard")


def test_stripe_window_with_ring_refused(pools):
    res = pools(2).run_all(dist_cases.usp_case, timeout=30, U=1, R=2, layout="stripe", window=(2, 0), causal=True)
    _all_raise(res, "stripe", "zigzag")


@pytest.mark.parametrize("what,needles", [
    ("forward_only_grad", ["no backward", "sdpa"]),
    ("no_lse_ring", ["log-sum-exp", "sdpa"]),
    ("softcap", ["softcap"]),
])
def test_refusals_come_before_any_data_collective(pools, what, needles):
    R = 2 if what == "no_lse_ring" else 1
    U = 2 // R
    for res in pools(2).run(dist_cases.refused_before_communication, U=U, R=R, what=what):
        assert res["error"], res
        for n in needles:
            assert n in res["error"], res
        assert res["counts"] == {"all_to_all_single": 0, "batch_isend_irecv": 0}, res


def test_forward_only_backend_serves_the_ring_without_grad(pools):
    _check(pools(2).run(dist_cases.forward_only_without_grad))
