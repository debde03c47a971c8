"""One home for block plans (usp_hal.sequence.blocks): every ring rank x source block, the summaries
varlen, the planner and the pipeline read from it, and the planner's candidates taken from
the layout / rotation / codec tables (a layout, a rotation or a codec registered from
outside, as tests/test_seams.py registers them, becomes a plan candidate)."""
import pytest

from usp_hal.compat.extract import EXTRACT_FUNC_DICT
from usp_hal.parallel.codec import CODECS, Codec, register_codec
from usp_hal.parallel.ring import PackedCall, pack_calls
from usp_hal.parallel.rotation import ROTATIONS, P2PRotation
from usp_hal.planning import planner
from usp_hal.sequence import blocks as varlen  # the per-rank work summaries
from usp_hal.sequence.blocks import RingPlan, block_plans, pack_groups, plan_blocks, plan_ring
from usp_hal.sequence.positions import LAYOUTS, Layout, Segment, register_layout, ring_segments


@pytest.mark.parametrize("layout,cu", [("basic", None), ("zigzag", None), ("stripe", None),
                                       ("varlen_zigzag", (0, 5, 30, 31, 64)), ("zigzag", (0, 5, 30, 31, 64))])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_plan_is_plan_blocks_for_every_rank_and_source(layout, cu, causal):
    S, R = 64, 4
    rp = block_plans(layout, S, R, causal=causal, cu_seqlens=cu)
    segs = [ring_segments(layout, S, R, r, cu_seqlens=cu) for r in range(R)]
    for a in range(R):
        for src in range(R):
            want = plan_blocks(segs[a], segs[src], causal=causal, diagonal=a == src, cu_seqlens=cu)
            assert list(rp.calls_of(a, src)) == want
        assert rp.step_calls(a)[0] == rp.calls_of(a, a)      # own block first
    assert rp.lengths == tuple(sum(s.count for s in sg) for sg in segs)
    assert list(rp.work) == varlen.ring_work(layout, S, R, causal=causal, cu_seqlens=cu)
    assert list(rp.kernel_calls(True)) == varlen.ring_calls(layout, S, R, causal=causal, cu_seqlens=cu, packed=True)
    assert rp.blocks == {(c.q_stop - c.q_start, c.k_stop - c.k_start, c.causal)
                         for per in rp.calls for cs in per for c in cs}
    assert block_plans(layout, S, R, causal=causal, cu_seqlens=cu) is rp      # cached


def test_local_only_and_balance():
    cu = (0, 16, 32, 48, 64)      # four documents, each on one basic rank
    assert block_plans("basic", 64, 4, cu_seqlens=cu).local_only
    assert not block_plans("varlen_zigzag", 64, 4, cu_seqlens=cu).local_only
    assert not block_plans("basic", 64, 1, cu_seqlens=cu).local_only     # a ring of one exchanges nothing anyway
    rp = plan_ring([[Segment(0, 4)], [Segment(4, 0)]], causal=True)
    assert isinstance(rp, RingPlan) and rp.work == (10, 0) and rp.balance() is None
    assert varlen.work_balance(list(rp.work)) == float("inf")


def test_pack_calls_wraps_pack_groups():
    segs = [ring_segments("varlen_zigzag", 64, 2, r, cu_seqlens=(0, 20, 64)) for r in range(2)]
    calls = plan_blocks(segs[0], segs[0], causal=True, diagonal=True, cu_seqlens=(0, 20, 64))
    groups, packed = pack_groups(calls), pack_calls(calls)
    assert len(groups) == len(packed)
    for g, p in zip(groups, packed):
        assert (isinstance(g, tuple) and isinstance(p, PackedCall) and p.calls == g) or g is p


def _halves(seqlen, ring_size, ring_rank):
    half = seqlen // 2
    a, n = ring_rank * half // ring_size, (ring_rank + 1) * half // ring_size - ring_rank * half // ring_size
    b, m = half + ring_rank * (seqlen - half) // ring_size, \
        (ring_rank + 1) * (seqlen - half) // ring_size - ring_rank * (seqlen - half) // ring_size
    return [Segment(a, n), Segment(b, m)]


class _Hop(P2PRotation):
    name = "hop_test"


class _Half(Codec):
    name, identity, lossy = "half_test", False, True

    def wire_bytes(self, shape, dtype):
        n = 1
        for s in shape:
            n *= int(s)
        return n     # one byte per value


@pytest.fixture
def registered():
    register_layout(Layout("halves_test", _halves, contiguous=True, balances_causal=True,
                           description="two contiguous chunks per rank"))
    ROTATIONS["hop_test"] = _Hop
    register_codec(_Half)
    try:
        yield
    finally:
        LAYOUTS.pop("halves_test", None)
        EXTRACT_FUNC_DICT.pop("halves_test", None)
        ROTATIONS.pop("hop_test", None)
        CODECS.pop("half_test", None)


def test_registered_layout_rotation_and_codec_become_plan_candidates(registered):
    assert "halves_test" in planner.layout_candidates() and "halves_test" in planner.LAYOUTS
    assert "varlen_zigzag" not in planner.layout_candidates() and "varlen_zigzag" in planner.PACKED_LAYOUTS
    assert planner.rotation_model("hop_test") == "p2p" and "hop_test" in planner.ROTATIONS
    res = planner.plan(4, 16, 16384, 64, causal=True, profile="h100-nvlink", fp8=True)
    labels = {r["label"] for r in res["rows"]}
    assert "ring4 halves_test p2p" in labels and "usp2x2 halves_test hop_test" in labels, labels
    assert "ulysses4 half_test:qvo" in labels and "ulysses4 fp8:qkvo" in labels, labels
    rows = {r["label"]: r for r in res["rows"]}
    # the registered rotation derives from P2PRotation: the model times it as p2p
    assert rows["usp2x2 halves_test hop_test"]["time"] == rows["usp2x2 halves_test p2p"]["time"]
    # its bytes are the codec's: q, v, out at 1 byte per value instead of bf16's 2, k as it is
    # (per rank and peer, with as many KV heads as heads: q 2 + k 2 + v 2 + out 2 -> 1 + 2 + 1 + 1)
    plain, half = rows["ulysses4"]["comm_bytes"], rows["ulysses4 half_test:qvo"]["comm_bytes"]
    assert half == pytest.approx(plain * 5 / 8)
    # the work of the registered layout is counted from its block plan
    want = varlen.work_balance(varlen.ring_work("halves_test", 16384, 4, causal=True))
    assert rows["ring4 halves_test p2p"]["work_balance"] == pytest.approx(want)
    # on a slow link the fewest bytes win, and the module line names the codec
    slow = planner.plan(4, 16, 16384, 64, causal=True, profile="h100-nvlink", fp8=True, intra_bw=1e8)
    assert slow["winner"] == "ulysses4 half_test:qkvo"
    assert "wire_codecs={'q': 'half_test', 'k': 'half_test', 'v': 'half_test', 'out': 'half_test'}" in slow["module"]
    with pytest.raises(planner.PlanError, match="halves_test"):
        planner.plan(4, 16, 16384, 64, causal=True, profile="h100-nvlink", layouts=("nope",))


def test_a_rotation_without_a_model_is_listed_invalid(registered):
    class Odd:
        name = "odd_test"
    ROTATIONS["odd_test"] = Odd      # type: ignore[assignment]
    try:
        res = planner.plan(4, 16, 16384, 64, causal=True, profile="h100-nvlink")
    finally:
        ROTATIONS.pop("odd_test")
    bad = [i for i in res["invalid"] if "odd_test" in i["label"]]
    assert bad and all("no cost model" in i["reason"] for i in bad)
