"""Packed documents (cu_seqlens) through Ulysses x Ring on real gloo process groups:
output, lse and gradients against float64 single-process attention of each document
alone, on every split of 1, 2 and 4 ranks, every layout, both rotations; kernel calls and
scored pairs counted; refusals on every rank before any data moves (tests/dist_varlen.py)."""
import pytest

from tests import dist_varlen

pytestmark = pytest.mark.multirank

SPLITS = [(1, 1, 1, True), (2, 2, 1, True), (2, 1, 2, True), (4, 4, 1, True), (4, 2, 2, True), (4, 1, 4, True),
          (4, 2, 2, False)]
LAYOUTS = ["basic", "zigzag", "stripe", "varlen_zigzag"]
# equal; one long + many short; lengths 1 and 2; all shorter than the world; one spanning every rank; empties
DOCS = ((6, 6, 6, 6), (17, 1, 2, 1, 3), (1, 2, 1, 1, 2, 2, 1), (3, 1, 2), (13,), (0, 5, 0, 6))


def _check(results, what=""):
    for i, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v <= 1.0}
        assert not bad, f"{what} docs #{i}: errors above tolerance (1.0 = limit): {bad} (all: {errs})"


def _run(pools, world, **kw):
    for res in pools(world).run(dist_varlen.packed_case, timeout=120, **kw):
        _check(res, str(kw))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"w{s[0]}-u{s[1]}r{s[2]}{'' if s[3] else '-ringlow'}")
def test_packed_matrix_fp64(pools, split, layout, causal):
    world, U, R, low = split
    _run(pools, world, U=U, R=R, low=low, layout=layout, causal=causal, dtype="fp64", B=2, H=4, D=8, docs=DOCS)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("split", [s for s in SPLITS if s[2] > 1 and s[3]], ids=lambda s: f"w{s[0]}-u{s[1]}r{s[2]}")
def test_packed_allgather_rotation(pools, split, layout, causal):
    world, U, R, low = split
    _run(pools, world, U=U, R=R, layout=layout, causal=causal, rotation="allgather", dtype="fp64", D=8,
         docs=DOCS[:4])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["zigzag", "varlen_zigzag"])
def test_packed_lower_precision(pools, layout, dtype):
    _run(pools, 4, U=2, R=2, layout=layout, causal=True, dtype=dtype, B=2, H=4, D=16,
         docs=((40, 7, 1, 16), (9, 9, 9, 9, 9)))


@pytest.mark.parametrize("opts", [
    dict(H=4, Hkv=2), dict(H=6, Hkv=3), dict(H=4, Hkv=1, window=(3, 0)), dict(window=(2, 1)), dict(window=(0, 3)),
    dict(alibi=True), dict(alibi=True, window=(4, 0), Hkv=2), dict(grad=False, return_lse=False),
], ids=["gqa", "gqa-cut", "mqa-window", "window", "window-right", "alibi", "alibi-window-gqa", "no-grad"])
@pytest.mark.parametrize("layout", ["basic", "varlen_zigzag"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_options(pools, opts, layout, causal):
    _run(pools, 4, U=2, R=2, layout=layout, causal=causal, dtype="fp64", docs=((11, 1, 2, 8), (4, 4, 4, 4, 4)),
         **{"H": 4, **opts})


@pytest.mark.parametrize("module", ["qkvpacked", "async"])
@pytest.mark.parametrize("split", [(2, 2, 1), (4, 2, 2)], ids=["u2", "u2r2"])
def test_packed_module_variants(pools, module, split):
    world, U, R = split
    _run(pools, world, U=U, R=R, layout="varlen_zigzag", causal=True, dtype="fp64", H=4, docs=DOCS[:3],
         module=module, cu_as="list")


def test_softcap_is_refused_with_its_reason(pools):
    res = pools(2).run_all(dist_varlen.packed_case, timeout=60, U=1, R=2, softcap=5.0, docs=((4, 4),))
    assert all(r[0] == "err" and "softcap" in r[1] for r in res), res


def test_without_cu_seqlens_the_packed_reference_does_not_match(pools):
    """Negative control: the same comparison fails when the call ignores the documents."""
    res = pools(2).run(dist_varlen.unpacked_call_vs_packed_reference, timeout=60)
    assert all(r["out"] > 1.0 and r["dq"] > 1.0 for r in res), res


def test_pairs_that_share_no_document_cost_no_kernel_time(pools):
    """2 ranks, 4 equal documents, basic layout: each rank runs one causal call per own
    document (forward and backward), scores exactly the visible pairs, and the ring sends
    nothing (no document spans both ranks)."""
    for res in pools(2).run(dist_varlen.kernel_counts, timeout=60, U=1, R=2, layout="basic", lengths=(8, 8, 8, 8)):
        assert res["fwd_calls"] == 2 and res["bwd_calls"] == 2, res
        assert res["fwd_pairs"] == res["bwd_pairs"] == 2 * 2 * (8 * 9 // 2), res      # H=2, 2 documents
        assert res["p2p"] == 0, res


@pytest.mark.parametrize("layout,lengths,split", [
    ("varlen_zigzag", (8, 8, 8, 8), (2, 1, 2)), ("zigzag", (5, 1, 11, 3, 12), (2, 1, 2)),
    ("stripe", (5, 1, 11, 3, 12), (4, 1, 4)), ("varlen_zigzag", (1, 30, 2, 7), (4, 2, 2)),
    ("basic", (3, 3, 3, 3, 3, 3, 3, 3, 3, 3), (4, 4, 1)),
])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernels_score_exactly_the_visible_pairs(pools, layout, lengths, split, causal):
    world, U, R = split
    res = pools(world).run(dist_varlen.kernel_counts, timeout=60, U=U, R=R, layout=layout, lengths=lengths,
                           causal=causal, H=2)
    visible = sum(n * (n + 1) // 2 if causal else n * n for n in lengths) * 2      # H=2 heads in all
    assert sum(r["fwd_pairs"] for r in res) == visible, res
    assert sum(r["bwd_pairs"] for r in res) == visible, res


@pytest.mark.parametrize("what,needle", [
    ("no_varlen", "packed documents (cu_seqlens) not supported"), ("mismatch", "docs: rank 0=cu_seqlens digest"),
    ("missing", "docs: rank 0=none (no cu_seqlens)"),
    ("total", "cu_seqlens ends at 13"), ("decreasing", "non-decreasing"), ("float", "integer tensor"),
])
@pytest.mark.parametrize("split", [(2, 1, 2), (4, 2, 2)], ids=["r2", "u2r2"])
def test_refused_on_every_rank_before_any_data_moves(pools, what, needle, split):
    world, U, R = split
    res = pools(world).run(dist_varlen.refusal, timeout=60, U=U, R=R, what=what)
    for r in res:
        assert r["error"] is not None and needle in r["error"], res
        assert r["counts"] == {"all_to_all_single": 0, "batch_isend_irecv": 0}, res


def test_shard_unshard_and_position_ids(pools):
    for world, U, R in ((2, 1, 2), (4, 2, 2)):
        for rep in pools(world).run(dist_varlen.shard_roundtrip, timeout=60, U=U, R=R, lengths=(3, 1, 6, 2, 9)):
            for layout, checks in rep.items():
                assert all(checks.values()), (layout, checks)


def test_unshard_refuses_different_boundaries_on_every_rank(pools):
    res = pools(2).run(dist_varlen.unshard_mismatch, timeout=60)
    assert all(r is not None and "cu_seqlens" in r for r in res), res


def test_static_shapes_with_documents(pools):
    res = pools(2).run(dist_varlen.static_shapes_docs, timeout=60)
    for r in res:
        assert r["first_call_host_collectives"] >= 1, r
        assert r["same_docs_host_collectives"] == 0, r
        assert r["other_docs"] is not None and "static_shapes" in r["other_docs"] and "docs" in r["other_docs"], r


@pytest.mark.parametrize("split", [(2, 2, 1), (4, 2, 2)], ids=["u2", "u2r2"])
def test_packed_projections_overlapped(pools, split):
    world, U, R = split
    for errs in pools(world).run(dist_varlen.overlap_case, timeout=60, U=U, R=R):
        assert max(errs.values()) <= 1.0, errs
