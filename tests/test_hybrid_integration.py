"""Hybrid models under the transformers integration on real gloo ranks: refused by name on
every rank before any data moves (see usp_hal.integrations.hybrid)."""
import pytest

pytest.importorskip("transformers")

from tests import hybrid_cases as cases  # noqa: E402

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("split", [(2, 1), (1, 2)], ids=["u2", "r2"])
def test_refusals_on_every_rank(pools, split):
    U, R = split
    res = pools(2).run(cases.hybrid_refusals, timeout=180, U=U, R=R)
    layers = {"mamba": "MambaMixer"}
    for rank, r in enumerate(res):
        for mt, cls in layers.items():
            for case in (mt, mt + "_again", mt + "_generate"):
                assert r[case] is not None, f"rank {rank}: {case} ran"
                assert f"model type {mt!r}" in r[case] and cls in r[case], f"rank {rank}: {case}: {r[case]}"
            assert "layers.0" in r[mt], r[mt]
        assert "OlmoHybridGatedDeltaNet" in (r["olmo_hybrid"] or ""), r["olmo_hybrid"]
        assert "packed documents" in (r["qwen3_next_packed"] or ""), r["qwen3_next_packed"]
        assert "use_cache=True" in (r["qwen3_next_cache"] or ""), r["qwen3_next_cache"]
        assert "recurrent or convolution state" in (r["qwen3_next_generate"] or ""), r["qwen3_next_generate"]
        assert r["qwen3_next_runs"] is None, r["qwen3_next_runs"]
    # a refusal names every rank that refused: both did
    assert "rank 0" in res[0]["mamba"] and "rank 1" in res[0]["mamba"]


SPLITS = [(2, 2, 1, "zigzag"), (2, 1, 2, "zigzag"), (4, 2, 2, "zigzag")]


WIRED = {"qwen3_next": ["model.layers.0.linear_attn"], "lfm2": ["model.layers.0.conv"],
         "nemotron_h": ["model.layers.0.mixer"]}


@pytest.mark.parametrize("model_type", sorted(WIRED))
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"w{s[0]}-u{s[1]}r{s[2]}-{s[3]}")
def test_hybrid_matches_one_process(pools, split, model_type):
    """qwen3_next (gated DeltaNet + its causal conv), lfm2 (gated short conv) and nemotron_h
    (Mamba2: conv + SSD scan, 6 heads in 3 groups): the layers' per-head operators through
    the head-parallel region, attention through usp_hal; logits,
    loss, every gradient and 3 AdamW steps against one process (fp32)."""
    world, U, R, layout = split
    res = pools(world).run(cases.hybrid_training, timeout=240, model_type=model_type, U=U, R=R, layout=layout)
    r0 = res[0]
    assert r0["wired"] == WIRED[model_type], r0
    assert r0["same_grads"] and r0["n_grads"] > 10, r0
    assert r0["logits_diff"] <= 1e-5, r0
    assert r0["loss_diff"] <= 1e-4, r0
    assert r0["grad_rel"] <= 1e-4, r0
    assert r0["param_diff"] <= 1e-5, r0
    for r in res[1:]:
        assert r["losses"] == r0["losses"]


def test_qwen3_next_with_head_parallel_convolutions(pools):
    """The convolutions through the head-parallel region instead of the halo exchange."""
    r0 = pools(4).run(cases.hybrid_training, timeout=240, model_type="qwen3_next", U=2, R=2, conv="head_parallel")[0]
    assert r0["logits_diff"] <= 1e-5 and r0["loss_diff"] <= 1e-4 and r0["grad_rel"] <= 1e-4, r0


def test_qwen3_next_without_the_region_is_caught(pools):
    """The comparison can fail: the same model with its recurrent layers left on each rank's
    shard (what happened before) is far from one process."""
    r0 = pools(2).run(cases.hybrid_training, timeout=240, model_type="qwen3_next", U=1, R=2, unwired=True,
                      steps=1)[0]
    assert r0["wired"] == [], r0
    assert r0["logits_diff"] > 1e-2 and r0["grad_rel"] > 1e-2, r0
