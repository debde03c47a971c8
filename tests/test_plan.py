"""Pure pieces, no process group: ring block plans, the lse merge, layouts, head plans."""
import itertools

import pytest
import torch

from usp_hal.compat.extract import EXTRACT_FUNC_DICT
from usp_hal.parallel.ring import merge_block, plan_blocks
from usp_hal.parallel.ulysses import head_plan
from usp_hal.sequence.positions import (
    LAYOUTS,
    local_lengths,
    local_positions,
    permutation,
    ring_segments,
    segment_positions,
)


def _coverage(calls, nq, nk):
    cover = torch.zeros(nq, nk, dtype=torch.int32)
    for c in calls:
        block = torch.ones(c.q_stop - c.q_start, c.k_stop - c.k_start, dtype=torch.int32)
        if c.causal:
            assert block.shape[0] == block.shape[1], f"causal call must be square: {c}"
            block = torch.tril(block)
        cover[c.rows, c.cols] += block
    return cover


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("S,R", [(16, 2), (13, 2), (7, 4), (31, 4), (3, 4), (24, 3)])
def test_causal_plan_covers_exactly_the_causal_mask(layout, S, R):
    for i, j in itertools.product(range(R), repeat=2):
        qs, ks = ring_segments(layout, S, R, i), ring_segments(layout, S, R, j)
        qp, kp = segment_positions(qs), segment_positions(ks)
        calls = plan_blocks(qs, ks, causal=True, diagonal=i == j)
        want = (kp.unsqueeze(0) <= qp.unsqueeze(1)).int()
        got = _coverage(calls, len(qp), len(kp))
        assert torch.equal(got, want), f"{layout} S={S} R={R} q{i} k{j}: {calls}"


@pytest.mark.parametrize("layout", ["basic", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(2, 1), (5, 0), (0, 3)])
def test_positional_plan_offsets_and_window_skips(layout, causal, window):
    S, R = 29, 3
    for i, j in itertools.product(range(R), repeat=2):
        qs, ks = ring_segments(layout, S, R, i), ring_segments(layout, S, R, j)
        qp, kp = segment_positions(qs), segment_positions(ks)
        calls = plan_blocks(qs, ks, causal=causal, window=window, positional=True, diagonal=i == j)
        dist = kp.unsqueeze(0) - qp.unsqueeze(1)
        want = (dist >= -window[0]) & (dist <= window[1])
        if causal:
            want &= dist <= 0
        cover = _coverage(calls, len(qp), len(kp))
        assert cover.max() <= 1, "a (query, key) pair is computed twice"
        assert bool((cover.bool() | ~want).all()), "a visible pair is missing"
        for c in calls:   # every call carries the true global offset of its first key and query
            assert c.key_offset == int(kp[c.k_start] - qp[c.q_start]), c


def test_plan_skips_empty_blocks_and_fuses_full_calls():
    assert plan_blocks(ring_segments("basic", 2, 4, 3), ring_segments("basic", 2, 4, 0), causal=True) == []
    # zigzag rank 1 of 2 vs rank 0's block: the first chunk is fully visible to both of its chunks -> one call
    calls = plan_blocks(ring_segments("zigzag", 16, 2, 1), ring_segments("zigzag", 16, 2, 0), causal=True)
    assert len(calls) == 1 and not calls[0].causal and (calls[0].q_start, calls[0].q_stop) == (0, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_block_equals_one_softmax(dtype):
    g = torch.Generator().manual_seed(0)
    B, S, H, D, K = 2, 5, 3, 4, 12
    s = torch.randn(B, H, S, K, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, K, D, generator=g, dtype=torch.float64)
    s[:, :, 0, :] = float("-inf")          # a row that sees nothing anywhere
    s[:, :, 1, :6] = float("-inf")         # a row that sees nothing in the first block
    acc_out = torch.zeros(B, S, H, D, dtype=dtype)
    acc_lse = torch.full((B, H, S), float("-inf"), dtype=dtype)
    for lo, hi in [(0, 6), (6, 9), (9, 12)]:
        blk = s[..., lo:hi]
        lse = torch.logsumexp(blk, -1)
        p = torch.exp(blk - lse.unsqueeze(-1).nan_to_num(0, 0, 0)).nan_to_num(0)
        out = (p @ v[:, :, lo:hi]).transpose(1, 2)
        merge_block(acc_out, acc_lse, slice(0, S), out.to(dtype), lse.to(dtype))
    ref_lse = torch.logsumexp(s, -1)
    ref = (torch.softmax(s, -1).nan_to_num(0) @ v).transpose(1, 2)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(acc_out.double(), ref, atol=tol)
    assert torch.equal(torch.isinf(acc_lse), torch.isinf(ref_lse))
    assert torch.allclose(acc_lse.double().nan_to_num(0, 0, 0), ref_lse.nan_to_num(0, 0, 0), atol=tol)
    assert not torch.isnan(acc_out).any()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("S,R,U", [(16, 2, 2), (7, 2, 2), (3, 4, 1), (33, 2, 3), (5, 1, 4)])
def test_layouts_partition_and_balance(layout, S, R, U):
    perm = permutation(layout, S, R, U)
    assert sorted(perm.tolist()) == list(range(S))
    sizes = local_lengths(layout, S, R, U)
    flat = [n for row in sizes for n in row]
    assert sum(flat) == S
    ring_sizes = [sum(row) for row in sizes]
    assert max(ring_sizes) - min(ring_sizes) <= (2 if layout == "zigzag" else 1)
    for r in range(R):
        for u in range(U):
            pos = local_positions(layout, S, R, U, r, u)
            assert torch.all(pos[1:] > pos[:-1]), "local order must follow global order"
            x = torch.arange(S).view(1, S, 1)
            got = EXTRACT_FUNC_DICT[layout](x, r * U + u, R * U, R, U)
            assert torch.equal(got.view(-1), pos)


def test_zigzag_and_stripe_examples():
    assert permutation("zigzag", 8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert permutation("stripe", 8, 2).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert [s.count for s in ring_segments("zigzag", 7, 2, 0)] == [2, 1]


@pytest.mark.parametrize("H,Hkv,U", [(8, 8, 2), (8, 2, 2), (8, 2, 3), (6, 3, 4), (8, 1, 4), (3, 1, 2),
                                     (1, 1, 4), (5, 5, 2), (12, 4, 8), (7, 7, 3)])
def test_head_plan_is_consistent(H, Hkv, U):
    plan = head_plan(H, Hkv, U)
    g = H // Hkv
    seen = []
    for u in range(U):
        a, b = plan.q[u]
        seen += list(range(a, b))
        ka, kb = plan.kv[u]
        n = b - a
        if n == 0:
            assert (ka, kb) == (0, 0) and plan.local_heads(u) == (0, 0)
            continue
        # exactly the distinct kv heads the local query heads use travel
        assert list(range(ka, kb)) == sorted({h // g for h in range(a, b)})
        exp = plan.kv_expand[u]
        hq, hk = plan.local_heads(u)
        assert hq == n
        if exp is None:   # local GQA: each received kv head serves n / hk consecutive query heads
            assert n % hk == 0
            for i in range(n):
                assert ka + i // (n // hk) == (a + i) // g
        else:             # the rank repeats kv heads locally, one per query head
            assert hk == n and all(ka + exp[i] == (a + i) // g for i in range(n))
    assert seen == list(range(H))
    counts = [b - a for a, b in plan.q]
    assert max(counts) - min(counts) <= 1
    # only the groups a split cuts travel to two ranks
    assert plan.wire_kv_heads() <= Hkv + U - 1


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (3, 0)), (False, (2, 2))])
def test_plan_runs_covers_exactly_the_visible_stored_keys(causal, window):
    """Decode's block plan over keys stored as runs (storage order != position order), cut at
    a row's first real key: every (query, stored key) pair the calls score is one the mask
    keeps, every kept pair is scored once, and each call's key offset is its keys' positions."""
    from usp_hal.sequence.blocks import plan_runs
    from usp_hal.sequence.positions import Segment
    runs = [[6, 3], [0, 4], [12, 2], [9, 3]]            # [start position, count], in storage order
    pos = [p for s, c in runs for p in range(s, s + c)]  # the position of each stored key
    queries = Segment(14, 3)                              # new tokens at 14, 15, 16
    positional = window != (-1, -1)
    for first in (0, 2, 7, 10, 15):
        calls = plan_runs(queries, runs, causal=causal, window=window, positional=positional, first=first)
        seen = []
        for c in calls:
            for m in range(c.q_start, c.q_stop):
                for j in range(c.k_start, c.k_stop):
                    qpos, kpos = 14 + m, pos[j]
                    d = c.key_offset + (j - c.k_start) - (m - c.q_start)     # what the kernel sees
                    if positional or c.causal:      # the contract's positions are the true ones
                        assert d == kpos - qpos, (first, c, m, j)
                    if c.causal and d > 0:
                        continue                            # above the call's causal diagonal
                    left, right = window
                    if (left >= 0 and d < -left) or (right >= 0 and d > right):
                        continue                            # the kernel's window drops it
                    seen.append((qpos, kpos))
        want = [(14 + m, p) for m in range(3) for p in pos
                if p >= first and (not causal or p <= 14 + m)
                and (window[0] < 0 or p >= 14 + m - window[0]) and (window[1] < 0 or p <= 14 + m + window[1])]
        assert sorted(seen) == sorted(want), (first, calls)
