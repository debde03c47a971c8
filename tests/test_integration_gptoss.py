"""A tiny gpt-oss from its config (attention sinks as s_aux, a sliding-window layer, MoE) through
attn_implementation='usp_hal' on 2 gloo ranks: logits and AdamW steps (the sinks learn too)
equal one process (tests/dist_gptoss.py)."""
import pytest

pytest.importorskip("transformers")

from tests import dist_gptoss  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.models]


@pytest.mark.parametrize("split", [(1, 2, "zigzag"), (2, 1, "basic")], ids=["r2-zigzag", "u2"])
def test_gpt_oss_with_sinks_matches_single_process(pools, split):
    U, R, layout = split
    r = pools(2).run(dist_gptoss.gpt_oss_training, timeout=180, U=U, R=R, layout=layout)[0]
    assert r["sink_effect"] > 1e-2, r           # the sinks change the logits: they are applied
    assert r["sinks_moved"] > 1e-4, r           # and they were trained
    assert r["logits_diff"] <= 2e-5, r
    assert r["loss_diff"] <= 2e-5, r
    assert r["param_diff"] <= 2e-5, r
    assert r["sinks_diff"] <= 2e-5, r
    # the sinks' gradient itself (partial per rank, summed by sync_gradients) against one process
    assert r["sinks_grad_scale"] > 1e-4 and r["sinks_grad_diff"] <= 1e-3 * r["sinks_grad_scale"], r


@pytest.mark.parametrize("split", [(1, 2, "zigzag"), (2, 1, "basic")], ids=["r2-zigzag", "u2"])
def test_gpt_oss_generate_with_sinks_over_the_sharded_cache(pools, split):
    U, R, layout = split
    res = pools(2).run(dist_gptoss.gpt_oss_generate, timeout=180, U=U, R=R, layout=layout)
    assert res[0]["tokens"] == res[0]["ref_tokens"], res[0]
    assert res[1]["tokens"] == res[0]["tokens"]              # the same tokens on every rank
    assert res[0]["no_sink_tokens"] != res[0]["ref_tokens"]  # the sinks decide tokens here: they were applied
