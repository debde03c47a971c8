"""Packed documents (cu_seqlens), pure pieces, no process group: the document-aware block
plan against brute-force masks, the layouts with document boundaries, work balance,
the boundary checks, the position helpers, the accumulator and the capability flag."""
import itertools
import math
import random

import pytest
import torch

from tests.test_plan import _coverage
from usp_hal.compat.extract import EXTRACT_FUNC_DICT
from usp_hal.dispatch.capabilities import AttnRequest, not_supported_reasons
from usp_hal.parallel.ring import BlockCall, _Accumulator, merge_block, plan_blocks
from usp_hal.sequence.blocks import call_work, ring_work, work_balance
from usp_hal.sequence.positions import (
    LAYOUTS,
    as_cu_seqlens,
    cu_seqlens_from_lengths,
    document_ids,
    document_positions,
    equal_documents,
    get_layout,
    local_lengths,
    local_positions,
    permutation,
    ring_is_local,
    ring_segments,
    segment_positions,
    split_documents,
)

# equal; one long + many short; lengths 1 and 2; shorter than the ring; empty documents; one document
DOC_PATTERNS = [(6, 6, 6, 6), (17, 1, 2, 1, 3), (1, 2, 1, 1, 2, 2, 1), (3, 1, 2), (0, 5, 0, 4, 0), (13,)]


def _doc_of(cu, S):
    return torch.bucketize(torch.arange(S), torch.tensor(cu[1:]), right=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("R", [1, 2, 3, 4])
def test_document_plan_covers_exactly_the_document_mask(layout, R, causal):
    """Every (query, key) pair of the same document (and causal) is computed exactly once,
    no pair of different documents ever is, and no call spans two documents."""
    for lengths in DOC_PATTERNS:
        cu = cu_seqlens_from_lengths(lengths)
        S = cu[-1]
        doc = _doc_of(cu, S)
        segs = [ring_segments(layout, S, R, r, cu_seqlens=cu) for r in range(R)]
        for i, j in itertools.product(range(R), repeat=2):
            qp, kp = segment_positions(segs[i]), segment_positions(segs[j])
            calls = plan_blocks(segs[i], segs[j], causal=causal, diagonal=i == j, cu_seqlens=cu)
            want = doc[qp].unsqueeze(1) == doc[kp].unsqueeze(0)
            if causal:
                want &= kp.unsqueeze(0) <= qp.unsqueeze(1)
            got = _coverage(calls, len(qp), len(kp))
            assert torch.equal(got, want.int()), f"{layout} R={R} docs={lengths} q{i} k{j}: {calls}"
            for c in calls:
                assert len(set(doc[qp[c.rows]].tolist()) | set(doc[kp[c.cols]].tolist())) == 1, c


@pytest.mark.parametrize("layout", ["basic", "zigzag", "varlen_zigzag"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(2, 1), (3, 0), (0, 2)])
def test_document_plan_with_window_keeps_true_offsets(layout, causal, window):
    R = 3
    for lengths in [(9, 1, 2, 11), (4, 4, 4), (23,)]:
        cu = cu_seqlens_from_lengths(lengths)
        S = cu[-1]
        doc = _doc_of(cu, S)
        for i, j in itertools.product(range(R), repeat=2):
            qs, ks = ring_segments(layout, S, R, i, cu_seqlens=cu), ring_segments(layout, S, R, j, cu_seqlens=cu)
            qp, kp = segment_positions(qs), segment_positions(ks)
            calls = plan_blocks(qs, ks, causal=causal, window=window, positional=True, diagonal=i == j, cu_seqlens=cu)
            dist = kp.unsqueeze(0) - qp.unsqueeze(1)
            want = (dist >= -window[0]) & (dist <= window[1]) & (doc[qp].unsqueeze(1) == doc[kp].unsqueeze(0))
            if causal:
                want &= dist <= 0
            cover = _coverage(calls, len(qp), len(kp))
            assert cover.max() <= 1, "a (query, key) pair is computed twice"
            assert bool((cover.bool() | ~want).all()), "a visible pair is missing"
            assert not bool((cover.bool() & (doc[qp].unsqueeze(1) != doc[kp].unsqueeze(0))).any()), \
                "a call crosses a document boundary"
            for c in calls:
                assert c.key_offset == int(kp[c.k_start] - qp[c.q_start]), c


def test_blocks_that_share_no_document_cost_no_call():
    cu = equal_documents(32, 4)
    segs = [ring_segments("basic", 32, 2, r, cu_seqlens=cu) for r in range(2)]
    for causal in (False, True):
        assert plan_blocks(segs[0], segs[1], causal=causal, cu_seqlens=cu) == []
        assert plan_blocks(segs[1], segs[0], causal=causal, cu_seqlens=cu) == []
        # the own block: one call per document, nothing between documents
        own = plan_blocks(segs[0], segs[0], causal=causal, diagonal=True, cu_seqlens=cu)
        assert [(c.q_start, c.q_stop, c.k_start, c.k_stop, c.causal) for c in own] == \
            [(0, 8, 0, 8, causal), (8, 16, 8, 16, causal)]
    assert ring_is_local(segs, cu)
    assert not ring_is_local(segs, None)
    zz = [ring_segments("varlen_zigzag", 32, 2, r, cu_seqlens=cu) for r in range(2)]
    assert not ring_is_local(zz, cu)
    # without documents the same blocks do see each other
    assert plan_blocks(segs[1], segs[0], causal=True) != []


def test_split_documents_cuts_stripes_and_contiguous_segments():
    from usp_hal.sequence.positions import Segment
    cu = (0, 3, 8, 8, 10)
    assert split_documents([Segment(1, 6)], cu) == [(0, Segment(1, 2), 0), (1, Segment(3, 4), 2)]
    # positions 1, 3, 5, 7, 9 (stripe): doc 0 {1}, doc 1 {3, 5, 7}, doc 3 {9}; empty doc 2 skipped
    assert split_documents([Segment(1, 5, 2)], cu) == [(0, Segment(1, 1, 2), 0), (1, Segment(3, 3, 2), 1),
                                                       (3, Segment(9, 1, 2), 4)]
    with pytest.raises(ValueError, match="outside the documents"):
        split_documents([Segment(9, 2)], cu)


@pytest.mark.parametrize("R", [2, 3, 4])
def test_varlen_zigzag_is_ring_flash_attentions_layout_for_divisible_lengths(R):
    lengths = [2 * R * m for m in (3, 1, 5, 2)]
    cu = cu_seqlens_from_lengths(lengths)
    for r in range(R):
        want = []
        for a, n in zip(cu, lengths):
            c = n // (2 * R)
            want += list(range(a + r * c, a + (r + 1) * c)) + list(range(a + (2 * R - 1 - r) * c, a + (2 * R - r) * c))
        got = segment_positions(ring_segments("varlen_zigzag", cu[-1], R, r, cu_seqlens=cu)).tolist()
        assert got == want, (r, got, want)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("R,U", [(1, 2), (2, 1), (2, 2), (3, 1), (4, 1), (2, 3)])
def test_layouts_with_documents_partition_in_order(layout, R, U):
    for lengths in DOC_PATTERNS + [(1,) * 9, (40, 1, 1, 1)]:
        cu = cu_seqlens_from_lengths(lengths)
        S = cu[-1]
        perm = permutation(layout, S, R, U, cu_seqlens=cu)
        assert sorted(perm.tolist()) == list(range(S))
        sizes = local_lengths(layout, S, R, U, cu_seqlens=cu)
        assert sum(n for row in sizes for n in row) == S
        for r, u in itertools.product(range(R), range(U)):
            pos = local_positions(layout, S, R, U, r, u, cu_seqlens=cu)
            assert pos.numel() == sizes[r][u]
            assert torch.all(pos[1:] > pos[:-1]), "local order must follow global order"
            x = torch.arange(S).view(1, S, 1)
            got = EXTRACT_FUNC_DICT[get_layout(layout).yunchang_name or layout](x, r * U + u, R * U, R, U,
                                                                                  cu_seqlens=cu)
            assert torch.equal(got.view(-1), pos)


def test_stream_layouts_ignore_the_boundaries_and_per_document_ones_use_them():
    cu = (0, 5, 16)
    for name in ("basic", "zigzag", "stripe"):
        assert torch.equal(permutation(name, 16, 2, cu_seqlens=cu), permutation(name, 16, 2))
    assert not torch.equal(permutation("varlen_zigzag", 16, 2, cu_seqlens=cu), permutation("varlen_zigzag", 16, 2))
    # without boundaries a per-document layout treats the sequence as one document
    assert torch.equal(permutation("varlen_zigzag", 16, 2), permutation("varlen_zigzag", 16, 2, cu_seqlens=(0, 16)))
    with pytest.raises(ValueError, match="ends at 16"):
        ring_segments("varlen_zigzag", 17, 2, 0, cu_seqlens=(0, 16))


def test_varlen_zigzag_spreads_tiny_documents():
    """Documents shorter than the ring (length 1 too) go to the least loaded ranks, not all
    to rank 0."""
    R = 4
    cu = cu_seqlens_from_lengths([1] * 8)
    counts = [sum(s.count for s in ring_segments("varlen_zigzag", 8, R, r, cu_seqlens=cu)) for r in range(R)]
    assert counts == [2, 2, 2, 2]
    cu = cu_seqlens_from_lengths([3, 2, 1, 3, 2, 1])
    work = ring_work("varlen_zigzag", cu[-1], R, cu_seqlens=cu)
    assert max(work) - min(work) <= 3, work


def _log_uniform(rng, n, lo, hi):
    return cu_seqlens_from_lengths(int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))) for _ in range(n))


@pytest.mark.parametrize("R,lo,hi", [(2, 16, 4096), (4, 16, 4096), (8, 16, 4096), (2, 1, 4096), (4, 1, 4096)])
def test_varlen_zigzag_balances_causal_packed_batches(R, lo, hi):
    """8 documents of log-uniform length: the per-document layout keeps the work balance
    (query-key pairs scored, max/min over ring ranks) <= 1.10 on every draw, where the basic
    layout is far off (the same numbers are in benchmarks/varlen.py)."""
    rng = random.Random(1234 + R + lo)
    ours, basic = [], []
    for _ in range(60):
        cu = _log_uniform(rng, 8, lo, hi)
        work = ring_work("varlen_zigzag", cu[-1], R, causal=True, cu_seqlens=cu)
        # the plan's work is exactly the visible pairs: nothing invisible is computed
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        assert sum(work) == sum(n * (n + 1) // 2 for n in lengths)
        ours.append(work_balance(work))
        basic.append(work_balance(ring_work("basic", cu[-1], R, causal=True, cu_seqlens=cu)))
    ours.sort()
    basic.sort()
    assert ours[-1] <= 1.10, f"varlen_zigzag worst balance {ours[-1]:.3f} (median {ours[30]:.3f})"
    assert basic[30] > 1.3, f"basic median balance {basic[30]:.3f}: the draws do not stress balance"


def test_call_work_counts_causal_squares_half():
    calls = [BlockCall(0, 4, 0, 4, True, 0), BlockCall(4, 6, 0, 4, False, 0)]
    assert call_work(calls) == 10 + 8
    assert work_balance([10, 5]) == 2.0 and work_balance([0, 0]) == 1.0 and work_balance([0, 3]) == float("inf")


@pytest.mark.parametrize("bad,err,match", [
    ([1, 5], ValueError, "start at 0"), ([0, 5, 3], ValueError, "non-decreasing"), ([0], ValueError, "two entries"),
    (torch.tensor([0.0, 4.0]), TypeError, "integer tensor"), (torch.tensor([[0, 4]]), ValueError, "1-D"),
    ([0, 2.5], TypeError, "integers"), ("0,4", TypeError, "list of ints"), ([0, True], TypeError, "integers"),
])
def test_cu_seqlens_are_checked(bad, err, match):
    with pytest.raises(err, match=match):
        as_cu_seqlens(bad)


def test_cu_seqlens_forms():
    assert as_cu_seqlens(torch.tensor([0, 3, 3, 7], dtype=torch.int32)) == (0, 3, 3, 7)
    assert as_cu_seqlens([0, 7], 7) == (0, 7)
    with pytest.raises(ValueError, match="ends at 7"):
        as_cu_seqlens([0, 7], 8)
    assert equal_documents(10, 3) == (0, 4, 7, 10)
    assert cu_seqlens_from_lengths([2, 0, 3]) == (0, 2, 2, 5)


def test_document_positions_restart_at_every_boundary():
    cu = [0, 3, 3, 7, 8]
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    assert document_ids(pos, cu).tolist() == [0, 0, 0, 2, 2, 2, 2, 3]
    assert document_positions(pos, cu).tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert document_positions(torch.tensor([6, 0, 7]), cu).tolist() == [3, 0, 0]
    with pytest.raises(ValueError, match="lie in"):
        document_ids(torch.tensor([8]), cu)


def test_accumulator_copies_fresh_rows_and_merges_overlaps_like_merge_block():
    g = torch.Generator().manual_seed(0)
    B, L, H, D = 2, 7, 3, 4
    q = torch.zeros(B, L, H, D)
    parts = [((0, 3), torch.randn(B, 3, H, D, generator=g), torch.randn(B, H, 3, generator=g)),
             ((3, 7), torch.randn(B, 4, H, D, generator=g), torch.randn(B, H, 4, generator=g)),
             ((1, 4), torch.randn(B, 3, H, D, generator=g), torch.randn(B, H, 3, generator=g))]
    parts[1][2][:, :, 1] = float("-inf")     # row 4: its only call sees no key
    acc = _Accumulator(q, D)
    ref_out, ref_lse = torch.zeros(B, L, H, D), torch.full((B, H, L), float("-inf"))
    for (a, b), out, lse in parts:
        acc.add(BlockCall(a, b, 0, 1, False, 0), out, lse)
        merge_block(ref_out, ref_lse, slice(a, b), out, lse)
    out, lse = acc.result()
    assert torch.allclose(out, ref_out, atol=1e-6) and torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert torch.allclose(lse.nan_to_num(0, 0, 0), ref_lse.nan_to_num(0, 0, 0), atol=1e-6)
    assert out[:, 4].abs().max() == 0 and torch.isinf(lse[:, :, 4]).all()      # saw no key: (0, -inf)


def test_varlen_capability_is_declared_data():
    from usp_hal.backends.sdpa import SDPABackend

    class _NoVarlen(SDPABackend):
        SUPPORTS_VARLEN = False
    req = AttnRequest(dtype=torch.float32, device_type="cpu", head_dim=8, varlen=True)
    assert not_supported_reasons(SDPABackend, req) == []
    reasons = not_supported_reasons(_NoVarlen, req)
    assert len(reasons) == 1 and "cu_seqlens" in reasons[0]
    assert not_supported_reasons(_NoVarlen, req.with_(varlen=False)) == []
    assert "varlen" in req.describe()


@pytest.mark.parametrize("layout", ["basic", "zigzag", "stripe", "varlen_zigzag"])
@pytest.mark.parametrize("R", [1, 2, 4])
def test_packed_steps_keep_every_call_once_in_at_most_two_calls_per_step(layout, R):
    """pack_calls (what the ring runs for a kernel with a varlen entry point): every call of the
    block plan exactly once, all of one kind per packed call, at most 2 kernel calls per
    ring step; ring_calls reports the same counts."""
    from usp_hal.parallel.ring import PackedCall, pack_calls
    from usp_hal.sequence.blocks import ring_calls
    rng = random.Random(R)
    for _ in range(20):
        cu = cu_seqlens_from_lengths(rng.choice([1, 2, 3, 7, 20, 33]) for _ in range(rng.randint(1, 9)))
        S = cu[-1]
        segs = [ring_segments(layout, S, R, r, cu_seqlens=cu) for r in range(R)]
        for me in range(R):
            total = 0
            for src in range(R):
                calls = plan_blocks(segs[me], segs[src], causal=True, diagonal=me == src, cu_seqlens=cu)
                steps = pack_calls(calls) if len(calls) > 1 else calls
                assert len(steps) <= 2
                flat = [c for st in steps for c in (st.calls if isinstance(st, PackedCall) else (st,))]
                assert sorted(flat, key=repr) == sorted(calls, key=repr)
                for st in steps:
                    if isinstance(st, PackedCall):
                        assert len({c.causal for c in st.calls}) == 1
                        if st.causal:
                            assert st.q_lens == st.k_lens
                total += len(steps)
            assert ring_calls(layout, S, R, cu_seqlens=cu, packed=True)[me] == total
