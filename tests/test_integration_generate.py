"""generate() with the usp_hal attention and a ShardedCache: the prompt sharded by shard_batch,
the USP prefill filling the cache, decode steps through the sharded cache.  A tiny random GQA
Llama and a tiny Mistral (sliding window 8 < prompt 23) give the same greedy tokens (and
logits) as one process, on 1, 2 and 4 gloo ranks, and the same tokens on every rank.

Padding: a batch of left-padded prompts of different lengths (the global attention_mask
given to shard_batch) generates what one process's ``generate(ids, attention_mask=mask)``
does; a padded model forward with labels gives one process's logits at the real tokens,
loss and gradients; the core's prefill with the padding mask and decode with ``key_start``
match float64 attention; right padding in generate() is refused on every rank."""
import pytest

pytest.importorskip("transformers")

from tests import dist_serving as ds  # noqa: E402

pytestmark = pytest.mark.models

LOGITS_TOL = 1e-4


def _check(res, new=6, S=23):
    r0 = res[0]
    assert r0["tokens"] == r0["ref_tokens"], r0
    assert r0["logits_diff"] <= LOGITS_TOL * max(1.0, r0["logits_scale"]), r0
    for r in res:       # the same tokens, logits and cache lengths on every rank
        assert r["tokens"] == r0["tokens"] and r["logits_sum"] == r0["logits_sum"], (r, r0)
        assert r["lengths"] == [S + new - 1] * len(r["lengths"]), r


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_generate_one_process_matches(arch):
    _check([ds.generate_case(1, 1, arch=arch)])


@pytest.mark.multirank
@pytest.mark.parametrize("split,arch", [((2, 1, 2), "llama"), ((2, 2, 1), "mistral"), ((4, 2, 2), "llama"),
                                        ((4, 1, 4), "mistral")], ids=["u1r2-llama", "u2r1-mistral",
                                                                       "u2r2-llama", "u1r4-mistral"])
def test_generate_matches_single_process(pools, split, arch):
    world, U, R = split
    res = pools(world).run(ds.generate_case, timeout=240, U=U, R=R, arch=arch)
    _check(res)
    # every ring rank holds about 1/R of every sequence (block 4: within one block)
    for per in res[0]["counts"]:
        assert max(per) - min(per) <= 4 + 1, res[0]["counts"]


@pytest.mark.multirank
def test_generate_refusals_on_every_rank(pools):
    res = pools(2).run(ds.generate_refusals, timeout=120, U=1, R=2)
    for r in res:
        assert r["padding"] and "pass the attention_mask to shard_batch" in r["padding"], r
        assert r["right_padding"] and "right padding" in r["right_padding"], r
        assert r["empty_row"] and "no token" in r["empty_row"], r
        assert r["beams"] and "beam search" in r["beams"], r
        assert r["no_positions"] and "position_ids" in r["no_positions"], r
        assert r["no_max_new_tokens"] and "max_new_tokens" in r["no_max_new_tokens"], r
        # before: generate(use_cache=False) returned wrong tokens, the same on every rank
        assert r["no_cache"] and "use_cache=True" in r["no_cache"], r
        assert r["no_cache_config"] and "use_cache=True" in r["no_cache_config"], r
        assert r["ok"] is None, r
    assert res[0] == res[1]


def test_other_attention_implementations_still_generate():
    import torch

    from tests.integration_cases import tiny_llama
    from usp_hal.integrations import transformers as usp

    usp.register("usp_hal_test_generate_plain", enable=True)
    model = tiny_llama(0, num_hidden_layers=1)
    model.set_attn_implementation("sdpa")
    assert model.generate(torch.randint(0, 8, (1, 6)), max_new_tokens=2, do_sample=False).shape == (1, 8)


# ----------------------------------------------------------------------------- padding


def _check_padded_core(res):
    r0 = res[0]
    assert r0["prefill"] <= 1 and r0["pad_rows_zero"], r0
    assert r0["errors"]["out"] <= 1 and r0["errors"]["lse"] <= 1, r0
    for r in res:
        assert r["prints"] == r0["prints"] and r["lengths"] == r0["lengths"], (r, r0)


@pytest.mark.parametrize("window", [(-1, -1), (5, 0)], ids=["full", "window"])
def test_padded_prefill_and_decode_one_process(window):
    _check_padded_core([ds.padded_prefill_case(1, 1, window=window)])


@pytest.mark.multirank
@pytest.mark.parametrize("split", [(2, 1), (1, 2)], ids=["u2", "r2"])
def test_padded_prefill_and_decode_match_float64(pools, split):
    U, R = split
    _check_padded_core(pools(2).run(ds.padded_prefill_case, timeout=120, U=U, R=R))


def _check_padded_generate(res, pads=(0, 5, 12), S=19, new=5):
    r0 = res[0]
    assert r0["tokens"] == r0["ref_tokens"], r0
    assert r0["logits_diff"] <= LOGITS_TOL * max(1.0, r0["logits_scale"]), r0
    # the control: attending the pads changes the logits by far more than the tolerance
    assert r0["unmasked_diff"] > 1000 * LOGITS_TOL * max(1.0, r0["logits_scale"]), r0
    for r in res:
        assert r["tokens"] == r0["tokens"] and r["logits_sum"] == r0["logits_sum"], (r, r0)
        assert r["lengths"] == [S + new - 1] * len(pads), r


def test_left_padded_generate_one_process():
    _check_padded_generate([ds.padded_generate_case(1, 1)])


@pytest.mark.multirank
@pytest.mark.parametrize("split,arch", [((2, 2, 1), "llama"), ((2, 1, 2), "llama"), ((2, 1, 2), "mistral"),
                                        ((4, 2, 2), "llama")], ids=["u2-llama", "r2-llama", "r2-mistral",
                                                                     "u2r2-llama"])
def test_left_padded_generate_matches_single_process(pools, split, arch):
    world, U, R = split
    _check_padded_generate(pools(world).run(ds.padded_generate_case, timeout=240, U=U, R=R, arch=arch))


def _check_padded_forward(res):
    r0 = res[0]
    assert r0["loss_diff"] <= LOGITS_TOL, r0
    assert r0["logits_diff"] <= LOGITS_TOL * max(1.0, r0["logits_scale"]), r0
    assert r0["grad_diff"] <= LOGITS_TOL * max(1.0, r0["grad_scale"]), r0
    assert r0["unmasked_diff"] > 1000 * LOGITS_TOL, r0      # the padding mask matters here
    assert all(r["loss"] == r0["loss"] for r in res), res


def test_padded_forward_one_process():
    _check_padded_forward([ds.padded_forward_case(1, 1)])


@pytest.mark.multirank
@pytest.mark.parametrize("split", [(2, 1), (1, 2)], ids=["u2", "r2"])
def test_padded_forward_matches_single_process(pools, split):
    U, R = split
    _check_padded_forward(pools(2).run(ds.padded_forward_case, timeout=120, U=U, R=R))


def test_padding_refused_for_recurrent_layers():
    """A covered hybrid (lfm2's short convolutions) would mix the pads into the real tokens'
    state: a padded batch is refused, naming the reason; without padding it runs."""
    import torch

    from tests.dist_cases import get_mesh
    from tests.hybrid_cases import tiny_hybrid
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(1, 1)
    name = usp.register("usp_hal_test_generate_u1r1", mesh=mesh, layout="zigzag", attn_type="sdpa", enable=True)
    model = tiny_hybrid("lfm2")
    model.set_attn_implementation(name)
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        model(**usp.shard_batch({"input_ids": ids}, mesh))
        with pytest.raises(ValueError, match="padding mask with model type 'lfm2'"):
            model(**usp.shard_batch({"input_ids": ids, "attention_mask": mask}, mesh))


@pytest.mark.multirank
@pytest.mark.parametrize("split", [(2, 1), (1, 2)], ids=["u2", "r2"])
def test_dynamic_padding_batches_that_shrink_match_single_process(pools, split):
    # before: the second (shorter) padded batch raised USPIndexError on every rank: its padding
    # mask was evaluated at the first batch's length
    U, R = split
    res = pools(2).run(ds.dynamic_padding_case, timeout=180, U=U, R=R)
    for step in res[0]:
        assert step["loss_diff"] <= LOGITS_TOL, step
        assert step["logits_diff"] <= LOGITS_TOL * max(1.0, step["logits_scale"]), step
        assert step["grad_diff"] <= LOGITS_TOL * max(1.0, step["grad_scale"]), step
    assert [s["S"] for s in res[0]] == [24, 18, 30]
    assert [s["loss"] for s in res[0]] == [s["loss"] for s in res[1]], res
