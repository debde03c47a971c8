"""usp_hal.head_parallel on real gloo ranks: gated DeltaNet (delta rule), SSD (Mamba2's scan)
and a depthwise causal convolution, on sequence shards, against the same operator on the
whole sequence in one process in float64: outputs and gradients (inputs and per-head
parameters), any head count (fewer heads than ranks, groups cut across ranks), every layout."""
import pytest

from tests import hybrid_cases as cases

pytestmark = pytest.mark.multirank

# (op, H, G): H heads, G groups for the grouped inputs (GDN's q/k, SSD's B/C)
CASES = [("gdn", 4, 2), ("gdn", 6, 3), ("gdn", 1, 1), ("ssd", 4, 1), ("ssd", 3, 3), ("ssd", 6, 2),
         ("conv", 3, 3), ("conv", 1, 1), ("conv", 5, 5)]


def _check(res, limit=1.0):
    for case, worst in res.items():
        assert worst <= limit, (case, worst)


def test_single_process_is_the_operator(pools):
    _check(pools(1).run(cases.head_parallel_ops, timeout=120, U=1, R=1, cases=CASES)[0])


@pytest.mark.parametrize("split", [(2, 1, 2, "zigzag"), (2, 2, 1, "zigzag"), (4, 2, 2, "zigzag"),
                                   (4, 1, 4, "stripe"), (2, 1, 2, "basic")],
                         ids=lambda s: f"w{s[0]}-u{s[1]}r{s[2]}-{s[3]}")
def test_matches_one_process_in_float64(pools, split):
    world, U, R, layout = split
    for res in pools(world).run(cases.head_parallel_ops, timeout=240, U=U, R=R, layout=layout, cases=CASES):
        _check(res)


def test_float32(pools):
    for res in pools(4).run(cases.head_parallel_ops, timeout=240, U=2, R=2, cases=CASES[:1] + CASES[3:4],
                            dtype="fp32"):
        _check(res)


def test_packed_documents_restart_the_state(pools):
    """Packed documents (varlen_zigzag layout): the operator gets the global boundaries and
    restarts at each; a region that drops them is caught."""
    cu = (0, 5, 13)
    some = [("gdn", 4, 2), ("ssd", 4, 2), ("conv", 2, 2)]
    for layout in ("varlen_zigzag", "zigzag"):
        for res in pools(2).run(cases.head_parallel_ops, timeout=240, U=1, R=2, layout=layout, cases=some, cu=cu):
            _check(res)
    for res in pools(2).run(cases.head_parallel_ops, timeout=240, U=1, R=2, layout="varlen_zigzag", cases=some,
                            cu=cu, mutate="drop_documents"):
        for case, worst in res.items():
            assert worst > 10, (case, worst)


def test_shards_on_their_own_are_caught(pools):
    """The comparison can fail: each rank running the operator on its own shard (what a hybrid
    layer did without the region) is far off."""
    for res in pools(2).run(cases.head_parallel_ops, timeout=120, U=1, R=2, cases=CASES[:1] + CASES[3:4] + CASES[6:7],
                            mutate="skip_region"):
        for case, worst in res.items():
            assert worst > 10, (case, worst)


HALO = [dict(layout="zigzag"), dict(layout="basic"), dict(layout="stripe"),
        dict(layout="varlen_zigzag", cu=(0, 7, 19)), dict(layout="zigzag", cu=(0, 7, 19))]


@pytest.mark.parametrize("world,U,R", [(2, 1, 2), (4, 2, 2)], ids=["u1r2", "u2r2"])
def test_conv_halo_matches_one_process(pools, world, U, R):
    """usp_hal.mixers.head_parallel.halo_causal_conv: only the kernel_size - 1 tokens before each run travel;
    output and gradients vs float64; halo tokens per rank flat in S for basic and zigzag."""
    for kw in HALO:
        res = pools(world).run(cases.halo_conv, timeout=120, U=U, R=R, **kw)
        for r in res:
            assert r["worst"] <= 1.0, (kw, r)
        most = {n: max(r["halo_tokens"][n] for r in res) for n in res[0]["halo_tokens"]}
        if kw["layout"] != "stripe":
            assert len(set(most.values())) == 1, (kw, most)      # flat in S
            assert 0 < max(most.values()) <= 2 * 3, (kw, most)     # K - 1 = 3 tokens before each of <= 2 runs


@pytest.mark.parametrize("mutate,kw", [("short_halo", dict(layout="zigzag")),
                                       ("drop_documents", dict(layout="varlen_zigzag", cu=(0, 7, 19)))])
def test_conv_halo_mutations_are_caught(pools, mutate, kw):
    """A halo one token short, or boundaries ignored, is far from the truth."""
    for r in pools(2).run(cases.halo_conv, timeout=120, U=1, R=2, mutate=mutate, **kw):
        assert r["worst"] > 10, r
