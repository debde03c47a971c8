"""The sharded KV cache (usp_hal.serving): the exact lse merge, the block placement, decode
steps on 1, 2 and 4 gloo ranks for every U x R split against float64 attention over the
whole cache (uneven lengths, a sequence wholly on one rank, an empty one; causal, window,
softcap + ALiBi, full; GQA with head groups cut by the Ulysses split), the USP prefill
feeding the cache, and the refusals raised on every rank."""
import pytest
import torch

from tests import dist_serving as ds
from usp_hal.serving import ShardedKVCache, decode_bytes, merge_partials

ALL = tuple(ds.OPTIONS)
SPLITS = [(2, 2, 1), (2, 1, 2), (4, 4, 1), (4, 2, 2), (4, 1, 4)]     # (world, U, R)


def _check_decode(res, R, block=3, lengths=(13, 5, 7, 0), steps=(1, 2, 3, 1)):
    for label, errs in res["errors"].items():
        assert errs["out"] <= 1 and errs["lse"] <= 1, (label, errs)
    grown = sum(steps)
    for label, counts in res["counts"].items():
        for b, per in enumerate(counts):
            assert sum(per) == lengths[b] + grown, (label, b, per)
            if b != 2:          # sequences that start balanced stay within one block
                assert max(per) - min(per) <= block + 1, (label, b, per)


def test_merge_partials_is_exact_and_nan_free():
    torch.manual_seed(0)
    P, B, n, h, D = 3, 2, 2, 3, 4
    s = torch.randn(B, h, n, 9, dtype=torch.float64)
    vals = torch.randn(B, 9, h, D, dtype=torch.float64)
    cuts = [(0, 4), (4, 4), (4, 9)]          # the middle part holds no key
    outs, lses = [], []
    for a, b in cuts:
        part = s[..., a:b]
        lse = torch.logsumexp(part, -1) if b > a else torch.full((B, h, n), float("-inf"), dtype=torch.float64)
        p = torch.softmax(part, -1) if b > a else part
        outs.append(torch.einsum("bhqk,bkhd->bqhd", p, vals[:, a:b]) if b > a else torch.zeros(B, n, h, D,
                                                                                            dtype=torch.float64))
        lses.append(lse)
    out, lse = merge_partials(torch.stack(outs), torch.stack(lses))
    ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vals)
    assert torch.allclose(out, ref, atol=1e-12) and torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-12)
    empty = torch.full((P, B, h, n), float("-inf"), dtype=torch.float64)
    out, lse = merge_partials(torch.zeros(P, B, n, h, D, dtype=torch.float64), empty)
    assert not torch.isnan(out).any() and bool((out == 0).all()) and bool(torch.isneginf(lse).all())


def test_decode_bytes_formula():
    assert decode_bytes(1, 1, 8, 128, 4) == {"send": 8 * 129 * 4, "recv": 8 * 129 * 4 * 4}


def test_one_process_decode_matches_float64_every_option():
    res = ds.decode_case(U=1, R=1, dtype="fp64", options=ALL)
    _check_decode(res, 1)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_process_decode_lower_precision(dtype):
    res = ds.decode_case(U=1, R=1, dtype=dtype, options=("window",), H=4, Hkv=1)
    _check_decode(res, 1)


def test_softcap_alibi_decode_with_a_real_kernel():
    """FlexAttention (the registry's flex backend) serves softcap on CPU: the split tests use
    a reference contract backend for speed; this runs the real kernel once, on one process."""
    res = ds.decode_case(U=1, R=1, dtype="fp64", options=("softcap_alibi",), softcap_backend="flex")
    _check_decode(res, 1)


def test_block_placement_evens_out_a_sequence_on_one_rank():
    """Pure placement (no process group needed): a sequence loaded wholly on ring rank 0 of 4
    receives new blocks on the least-loaded ranks until they catch up."""
    cache = ShardedKVCache(None, num_layers=1, batch_size=1, num_heads=1, head_dim=2, block_size=4)
    ly = cache.layers[0]
    ly.ring = 4
    ly.counts, ly.total = [[10, 0, 0, 0]], [10]
    owners = []
    for _ in range(12):
        owners += [r for r, _, _ in cache._place(ly, 0, 4)]
    assert owners[:3] == [1, 2, 3], owners
    assert max(ly.counts[0]) - min(ly.counts[0]) <= 4, ly.counts


@pytest.mark.multirank
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"u{s[1]}r{s[2]}")
def test_decode_matches_float64_on_every_split(pools, split):
    world, U, R = split
    res = pools(world).run(ds.decode_case, timeout=120, U=U, R=R, dtype="fp64", options=ALL)
    for r in res:
        _check_decode(r, R)
    # every rank returns the same outputs, and the placement is the same everywhere
    assert all(r["prints"] == res[0]["prints"] for r in res)
    assert all(r["counts"] == res[0]["counts"] for r in res)
    # the sequence placed on the last ring rank: only that ring rank holds its loaded tokens
    for rank, r in enumerate(res):
        pos = r["positions"]["causal"][2]
        ring_rank = rank // U
        if ring_rank != R - 1:
            assert all(p >= 7 for p in pos), (rank, pos)
        else:
            assert set(range(7)) <= set(pos), (rank, pos)


@pytest.mark.multirank
def test_decode_float32_on_two_by_two(pools):
    res = pools(4).run(ds.decode_case, timeout=120, U=2, R=2, dtype="fp32", options=("causal", "softcap_alibi"),
                       H=8, Hkv=2)
    for r in res:
        _check_decode(r, 2)


@pytest.mark.multirank
@pytest.mark.parametrize("split,window", [((2, 2, 1), (-1, -1)), ((2, 1, 2), (3, 0)), ((4, 2, 2), (-1, -1)),
                                          ((4, 1, 4), (3, 0))], ids=["u2r1", "u1r2-window", "u2r2", "u1r4-window"])
def test_usp_prefill_fills_the_cache_then_decode_matches(pools, split, window):
    world, U, R = split
    res = pools(world).run(ds.prefill_case, timeout=120, U=U, R=R, window=window)
    S, B = 11, 2
    for r in res:
        assert r["prefill"] <= 1, r
        assert r["errors"]["out"] <= 1 and r["errors"]["lse"] <= 1, r
        assert all(sum(c) == S + 4 for c in r["counts"]), r
    assert all(r["prints"] == res[0]["prints"] for r in res)
    # each rank stores its ring shard of the prompt (the layout's split of 11 tokens over R ring ranks)
    from usp_hal.sequence.positions import shard_lengths
    for rank, r in enumerate(res):
        assert r["prompt_stored"] == [shard_lengths("zigzag", S, R)[rank // U]] * B, (rank, r)
        assert 0 <= r["capacity_bytes"] - r["used_bytes"] <= r["block_bytes"], r   # at most one block unused


EXPECTED_REFUSALS = {
    "wrong_mesh": "decode with the mesh the cache was prefilled on",
    "length_differs": "tokens per sequence, but the ranks' placement table says",
    "table_differs": "the placement table",
    "new_keys_differ": "q, k and v",
    "options_differ": "the options",
    "heads_mismatch": "does not match the cache",
    "layer_out_of_range": "out of range",
    "needs_grad": "passes no gradient",
    "softcap_on_sdpa": "softcap=5.0 not supported",
    "prefill_twice": "already holds tokens",
}


@pytest.mark.multirank
def test_bad_decode_calls_fail_on_every_rank(pools):
    res = pools(2).run(ds.refusal_case, timeout=120, U=1, R=2)
    for rank, r in enumerate(res):
        for key, needle in EXPECTED_REFUSALS.items():
            assert r[key] is not None and needle in r[key], (rank, key, r[key])
        assert r["empty_layer_ok"] is None, r
        assert r["step_layer0_ok"] is None and r["step_layer1_ok"] is None and r["step_layer0_again_ok"] is None, r
        assert r["step_layer1_differs"] and "decode failed on rank(s) [1]" in r["step_layer1_differs"], r
        assert r["after_refusals"] <= 1, r
        assert "this rank holds" in r["step_layer1_differs"], r
    for key in list(EXPECTED_REFUSALS) + ["step_layer1_differs"]:      # the same message on every rank
        assert res[0][key] == res[1][key], key
