"""USP core on real gloo process groups: every ulysses x ring split of 1, 2 and 4 ranks,
each layout and rotation, causal and not, fp32/bf16/fp64, B > 1, forward and gradients,
against float64 single-process attention (tests/dist_cases.usp_case)."""
import pytest

from tests import dist_cases

pytestmark = pytest.mark.multirank

# (world, ulysses, ring, ulysses ranks contiguous)
SPLITS = [(1, 1, 1, True), (2, 2, 1, True), (2, 1, 2, True), (4, 4, 1, True), (4, 2, 2, True),
          (4, 1, 4, True), (4, 2, 2, False)]
LAYOUTS = ["basic", "zigzag", "stripe"]


def _check(errs):
    bad = {k: v for k, v in errs.items() if not v <= 1.0}
    assert not bad, f"errors above tolerance (1.0 = limit): {bad} (all: {errs})"


def _run(pools, world, **kw):
    for errs in pools(world).run(dist_cases.usp_case, timeout=120, **kw):
        _check(errs)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"w{s[0]}-u{s[1]}r{s[2]}{'' if s[3] else '-ringlow'}")
def test_usp_matrix(pools, split, layout, causal, dtype):
    world, U, R, low = split
    _run(pools, world, U=U, R=R, low=low, layout=layout, causal=causal, dtype=dtype, B=2, S=24, H=4, D=8)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("split", [s for s in SPLITS if s[2] > 1], ids=lambda s: f"w{s[0]}-u{s[1]}r{s[2]}")
def test_usp_allgather_rotation(pools, split, layout, causal):
    world, U, R, low = split
    _run(pools, world, U=U, R=R, low=low, layout=layout, causal=causal, rotation="allgather", S=24, H=4, D=8)


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"w{s[0]}-u{s[1]}r{s[2]}{'' if s[3] else '-ringlow'}")
def test_usp_fp64_exact(pools, split):
    world, U, R, low = split
    _run(pools, world, U=U, R=R, low=low, layout="zigzag", causal=True, dtype="fp64", S=32, H=4, D=16)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (6, 3)])
def test_collective_counts_ulysses(pools, H, Hkv):
    for res in pools(2).run(dist_cases.count_collectives, U=2, R=1, H=H, Hkv=Hkv):
        # q, k, v in one all-to-all and the output back; backward: dout in, dq/dk/dv back
        assert res["fwd"]["all_to_all_single"] == 2, res
        assert res["bwd"]["all_to_all_single"] == 2, res
        meta = res["fwd"]["all_gather_single"] + res["fwd"]["all_gather_into_tensor"]
        assert meta == 1, res                                        # the metadata check
        assert res["bwd"]["all_gather_single"] + res["bwd"]["all_gather_into_tensor"] == 0, res
        assert res["fwd"]["batch_isend_irecv"] == 0 and res["bwd"]["batch_isend_irecv"] == 0, res
        assert res["fwd"]["all_gather"] == 0, res


def test_static_shapes_issue_no_host_collective(pools):
    for res in pools(2).run(dist_cases.count_collectives, U=2, R=1, static=True, calls=2):
        assert res["fwd"]["all_to_all_single"] == 2, res
        host = res["fwd"]["all_gather_single"] + res["fwd"]["all_gather_into_tensor"] + res["fwd"]["all_gather"]
        assert host == 0, res


@pytest.mark.parametrize("world", [2, 4])
def test_collective_counts_ring_p2p(pools, world):
    R = world
    for res in pools(world).run(dist_cases.count_collectives, U=1, R=R, layout="zigzag"):
        assert res["fwd"]["batch_isend_irecv"] == R - 1, res       # R-1 rotations forward
        assert res["bwd"]["batch_isend_irecv"] == 2 * (R - 1), res  # K/V again; dK/dV: R-1 hops home
        assert res["fwd"]["all_to_all_single"] == 0, res


def test_lse_travels_with_the_output(pools):
    for res in pools(2).run(dist_cases.count_collectives, U=2, R=1, return_lse=True):
        assert res["fwd"]["all_to_all_single"] == 2, res


def test_metadata_uses_a_cpu_side_group_when_the_groups_have_none(pools):
    for r in pools(2).run(dist_cases.cpu_side_group_case, timeout=60):
        assert r["side"] and r["backend"] == "gloo" and r["timeout"] == 77.0, r
        assert r["metadata_on_side_group"], r


def test_profiler_trace_names_every_collective(pools):
    """Under torch.profiler each collective of the call (and each wait on one) carries a
    ``usp_hal: <what>`` label, so a trace shows which exchange took the time."""
    for names in pools(4).run(dist_cases.profiler_labels, timeout=120):
        text = "\n".join(names)
        assert "usp_hal: Ulysses all-to-all of q/k/v (forward)" in text, text
        assert any("ring" in n and "dK/dV" in n for n in names), text
        assert any(n.startswith("usp_hal: wait for ") for n in names), text
        assert any("metadata" in n for n in names), text


@pytest.mark.parametrize("world,kw", [
    (2, dict()),
    (2, dict(H=8, Hkv=2, causal=True, layout="zigzag", S=20)),
    (2, dict(S=13)),                                   # uneven lengths (basic, non-causal)
    (2, dict(dtype="bf16", causal=True, layout="stripe")),
    (4, dict(U=4, H=8, Hkv=4, causal=True, layout="zigzag")),
    (4, dict(U=4, H=6, Hkv=6, S=16)),                  # heads that do not split evenly
    (2, dict(return_lse=True)),                        # the lse travels with the output
    (2, dict(vary=True, calls=4)),                     # new inputs per call, outputs kept
    (4, dict(U=4, H=8, Hkv=4, vary=True)),
], ids=["mha", "gqa-zigzag", "uneven", "bf16-stripe", "u4-gqa", "u4-uneven-heads", "with-lse", "vary", "u4-vary"])
def test_ulysses_forward_only(pools, world, kw):
    """Forward-only Ulysses calls match the float64 reference call after call, contiguous or
    not, with q/k/v in one all-to-all and the output in one; with new inputs every call,
    every kept output still matches its own reference after the last call."""
    for r in pools(world).run(dist_cases.ulysses_forward_case, timeout=120, **kw):
        assert r["a2a"] == [2] * len(r["errs"]), r
        for e in r["errs"]:
            assert e["shape"] and e["dtype"], r
            _check({k: v for k, v in e.items() if k not in ("shape", "dtype")})
