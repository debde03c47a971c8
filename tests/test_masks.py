"""mask= and sinks= through Ulysses x Ring on real gloo process groups (tests/dist_masks.py):
output, lse and gradients (the sinks' too) against float64 attention with the mask applied
densely, on 1, 2 and 4 ranks; the block plan's kernel calls (empty blocks skipped, full ones
without a mask, no K/V exchanged when no rank needs another's keys); refusals on every rank."""
import pytest
import torch

from tests import dist_masks
from usp_hal.sequence import masks as M

pytestmark = pytest.mark.multirank

SPLITS = [(1, 1, 1), (2, 2, 1), (2, 1, 2), (4, 4, 1), (4, 2, 2), (4, 1, 4)]
FAMILIES = ["prefix_lm", "block_causal", "chunked_local", "block_sparse", "slices"]


def _check(res, what=""):
    for r, got in enumerate(res):
        errs = got["errs"]
        bad = {k: v for k, v in errs.items() if not v <= 1.0}
        assert not bad, f"{what} rank {r}: errors above tolerance (1.0 = limit): {bad} (all: {errs})"


def _run(pools, world, **kw):
    res = pools(world).run(dist_masks.mask_case, timeout=120, **kw)
    _check(res, str(kw))
    return res


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"w{s[0]}-u{s[1]}r{s[2]}")
def test_mask_families_with_sinks_fp64(pools, split, fam):
    world, U, R = split
    _run(pools, world, U=U, R=R, layout="zigzag" if R > 1 else "basic", fam=fam, sinks=True, B=2, S=37, H=4,
         Hkv=2)


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("split", [(1, 1, 1), (2, 1, 2), (4, 2, 2)], ids=lambda s: f"w{s[0]}-u{s[1]}r{s[2]}")
def test_documents_times_each_family(pools, split, fam):
    world, U, R = split
    _run(pools, world, U=U, R=R, layout="basic", fam=fam, docs=(13, 5, 22), causal=fam == "block_sparse",
         sinks=fam == "prefix_lm")


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"w{s[0]}-u{s[1]}r{s[2]}")
def test_all_masked_rows_are_zero_with_zero_gradient(pools, split):
    world, U, R = split
    res = _run(pools, world, U=U, R=R, fam="empty_rows", S=36, sinks=False)
    _run(pools, world, U=U, R=R, fam="empty_rows", S=36, sinks=True)
    assert all(r["errs"]["finite"] == 0.0 for r in res)


@pytest.mark.parametrize("fam", ["per_batch", "per_head"])
@pytest.mark.parametrize("split", [(2, 2, 1), (4, 2, 2)], ids=lambda s: f"w{s[0]}-u{s[1]}r{s[2]}")
def test_batch_and_head_dependent_masks(pools, split, fam):
    world, U, R = split
    _run(pools, world, U=U, R=R, layout="zigzag", fam=fam, B=3, S=30, H=4, sinks=True)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_lower_precision_causal_and_alibi(pools, dtype):
    _run(pools, 4, U=2, R=2, layout="zigzag", fam="prefix_lm", dtype=dtype, causal=True, sinks=True, S=64)
    _run(pools, 2, U=1, R=2, layout="basic", fam="block_causal", dtype=dtype, alibi=True, S=48)


def test_async_module_and_balanced_layout(pools):
    _run(pools, 4, U=2, R=2, fam="block_sparse", module="async", sinks=True, S=48)
    _run(pools, 2, U=1, R=2, fam="prefix_lm", balanced=True, S=64, sinks=True)
    _run(pools, 4, U=1, R=4, fam="block_causal", balanced=True, S=80)


def test_fp8_wire_with_mask_and_sinks(pools):
    _run(pools, 4, U=2, R=2, layout="zigzag", fam="prefix_lm", fp8=True, sinks=True, S=48, dtype="fp32")


def test_sinks_without_mask_and_forward_only(pools):
    _run(pools, 4, U=2, R=2, layout="zigzag", fam=None, causal=True, sinks=True, S=33)
    _run(pools, 4, U=2, R=2, layout="zigzag", fam=None, causal=False, sinks=True, grad=False, S=33)
    _run(pools, 4, U=2, R=2, layout="zigzag", fam="slices", causal=True, sinks=True, grad=False, S=33)


def test_empty_blocks_are_skipped_and_full_blocks_run_without_mask(pools):
    # prefix = S/2 on two basic ring ranks: rank 0's queries see only its own keys, all of them
    # (one unmasked call, rank 1's block is empty: no call); rank 1 sees rank 0's block in full
    # (one unmasked call) and its own causally (masked calls on its diagonal tiles only)
    S = 64
    res = pools(2).run(dist_masks.plan_case, timeout=60, fam="prefix_half", S=S)
    r0, r1 = res[0]["calls"], res[1]["calls"]
    assert r0 == [("fwd", 32, 32, False)], r0
    assert ("fwd", 32, 32, False) in r1 and any(c[3] for c in r1), r1
    assert sum(c[1] for c in r1 if not c[3] and c[2] == 32) == 32
    # masked calls cover only runs that hold a diagonal tile (16-token tiles here): the upper
    # right tile of rank 1's own block is empty and never computed
    assert sum(c[1] * c[2] for c in r1 if c[3]) == 16 * 16 + 16 * 32, r1


def test_ring_exchanges_no_kv_when_no_rank_needs_anothers_keys(pools):
    res = pools(2).run(dist_masks.plan_case, timeout=60, fam="chunked_half", S=64)
    for r in res:
        assert r["bytes"].get("batch_isend_irecv", 0) == 0 and r["bytes"].get("all_gather_into_tensor", 0) == 0, r
        assert len(r["calls"]) >= 1 and all(c[2] <= 32 for c in r["calls"])


@pytest.mark.parametrize("what,needle", [("stripe", "contiguous"), ("mismatch", "mask"),
                                         ("sinks_shape", "one logit per query head")])
def test_refused_on_every_rank(pools, what, needle):
    res = pools(2).run_all(dist_masks.refusal_case, timeout=60, what=what)
    for r in res:
        assert r[0] == "err" and needle in r[1], res


def test_mask_api_errors_and_fingerprints():
    with pytest.raises(ValueError, match="kind"):
        M.Mask.from_slices([((0, 4), (0, 4), "diagonal")])
    with pytest.raises(TypeError, match="mask must be"):
        M.Mask.of(3)
    assert M.prefix_lm(4).fingerprint() != M.prefix_lm(5).fingerprint()
    assert M.prefix_lm(4).fingerprint() == M.prefix_lm(4).fingerprint()
    pos = torch.arange(6)
    m = M.Mask.from_slices([((0, 3), (0, 6), "causal")]).keep(pos, pos)[0, 0]
    # bottom-right causal: the last query of the rectangle (2) sees its last key (5)
    assert m[2].tolist() == [True] * 6 and m[0].tolist() == [True] * 4 + [False] * 2 and not m[3:].any()
    inv = M.Mask.from_slices([((0, 3), (0, 6), "inv_causal")]).keep(pos, pos)[0, 0]
    assert inv[0].tolist() == [True] * 6 and inv[2].tolist() == [False] * 2 + [True] * 4


def test_balance_by_mask_area_within_ten_percent():
    for mask, causal in ((M.prefix_lm(300), False), (M.block_causal(96), False), (M.chunked_local(200), False),
                         (M.random_block_sparse(1024, 32, 0.3, seed=1), True)):
        for R in (2, 4):
            lay = M.balanced_layout(mask, 1024, R, causal=causal, register=False)
            segs = [lay.segments(1024, R, r) for r in range(R)]
            work = M.mask_work(M.Predicate(mask, causal=causal), segs)
            assert max(work) / (sum(work) / R) <= 1.10, (mask, R, work)
            assert sorted(p for s in segs for x in s for p in range(x.start, x.start + x.count)) == list(range(1024))


@pytest.mark.compile
@pytest.mark.parametrize("split", [(2, 2, 1), (2, 1, 2)], ids=["u2", "r2"])
def test_mask_and_sinks_under_torch_compile_fullgraph(pools, split):
    world, U, R = split
    for r in pools(world).run(dist_masks.compile_case, timeout=180, U=U, R=R):
        assert r["breaks"] == 0, r
        assert all(v <= 1.0 for v in r["errs"].values()), r


@pytest.mark.parametrize("split", [(2, 2, 1), (2, 1, 2)], ids=["u2", "r2"])
def test_flex_backend_serves_masked_forward_calls(pools, split):
    # torch's FlexAttention on this CPU: forward with an lse, no backward (declared)
    world, U, R = split
    _run(pools, world, U=U, R=R, layout="zigzag", fam="block_sparse", attn_type="flex", grad=False, S=40,
         sinks=True, dtype="fp32")


def test_planner_prices_skipped_and_partial_blocks():
    from usp_hal.planning import planner
    S = 2048
    res = planner.plan(4, 8, S, 64, mask=M.chunked_local(S // 4), layouts=["basic", "zigzag"])
    rows = {r["label"]: r for r in res["rows"] if r["candidate"]["ulysses"] == 1 and "p2p" in r["label"]}
    basic, zig = rows["ring4 basic p2p"], rows["ring4 zigzag p2p"]
    # basic shards hold whole chunks: no rank needs another's keys, so no K/V travels, and less
    # work is priced than for zigzag (whose halves meet across ranks)
    assert basic["comm_bytes"] == 0 and zig["comm_bytes"] > 0
    assert basic["time"] < zig["time"]
    dense = planner.plan(4, 8, S, 64, layouts=["basic"])["rows"]
    full = [r for r in dense if r["label"] == "ring4 basic p2p"][0]
    assert basic["terms"]["kernel"] < 0.5 * full["terms"]["kernel"], (basic["terms"], full["terms"])
    assert res["problem"]["mask"] == M.chunked_local(S // 4).name


def test_slices_are_classified_in_closed_form_exactly():
    # disjoint slices are counted per tile without evaluating any pair; the result must equal
    # the dense classification for random slice sets of every kind, lengths and tile sizes
    import random
    rng = random.Random(0)
    checked = 0
    for _ in range(200):
        S, T = rng.randint(5, 150), rng.choice([4, 8, 16])
        cuts = sorted(set(rng.sample(range(1, S), min(S - 1, rng.randint(1, 5)))))
        bounds = [0] + cuts + [S]
        slices = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            ka = rng.randint(0, S - 1)
            slices.append(((a, b), (ka, rng.randint(ka + 1, S)), rng.choice(M.KINDS)))
        m = M.Mask.from_slices(slices)
        fast = M._slice_tiles(m.slices, S, T)
        keep = m.keep(torch.arange(S), torch.arange(S))[0, 0]
        nt = -(-S // T)
        dense = torch.tensor([[1 if keep[i * T:(i + 1) * T, j * T:(j + 1) * T].all() else
                               2 if keep[i * T:(i + 1) * T, j * T:(j + 1) * T].any() else 0
                               for j in range(nt)] for i in range(nt)], dtype=torch.uint8)
        assert torch.equal(fast, dense), slices
        checked += 1
    assert checked == 200


def test_combined_masks_keep_exactly_the_combined_pairs():
    pos = torch.arange(40)
    a, b = M.prefix_lm(7), M.sliding(5, 2)
    c = M.Mask.from_slices([((0, 20), (0, 40), "full"), ((20, 40), (10, 30), "causal")])
    ka, kb, kc = (m.keep(pos, pos) for m in (a, b, c))
    assert torch.equal(M.and_masks(a, b, c).keep(pos, pos), ka & kb & kc)
    assert torch.equal(M.or_masks(a, b, c).keep(pos, pos), ka | kb | kc)
    assert M.and_masks(a, b).fingerprint() != M.or_masks(a, b).fingerprint()
