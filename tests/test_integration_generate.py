"""generate() with the usp_hal attention and a ShardedCache: the prompt sharded by shard_batch,
the USP prefill filling the cache, decode steps through the sharded cache.  A tiny random GQA
Llama and a tiny Mistral (sliding window 8 < prompt 23) give the same greedy tokens (and
logits) as one process, on 1, 2 and 4 gloo ranks, and the same tokens on every rank."""
import pytest

pytest.importorskip("transformers")

from tests import dist_serving as ds  # noqa: E402

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
        assert r["padding"] and "left-padded batched prompts are not supported" in r["padding"], r
        assert r["beams"] and "beam search" in r["beams"], r
        assert r["no_positions"] and "position_ids" in r["no_positions"], r
        assert r["no_max_new_tokens"] and "max_new_tokens" in r["no_max_new_tokens"], r
        assert r["ok"] is None, r
    assert res[0] == res[1]


def test_other_attention_implementations_still_generate():
    import torch

    from tests.integration_cases import tiny_llama
    from usp_hal.integrations import transformers as usp

    usp.register("usp_hal_test_generate_plain")
    model = tiny_llama(0, num_hidden_layers=1)
    model.set_attn_implementation("sdpa")
    assert model.generate(torch.randint(0, 8, (1, 6)), max_new_tokens=2, do_sample=False).shape == (1, 8)
