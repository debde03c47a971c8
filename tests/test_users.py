"""What users of the integrations do next, on 2 gloo ranks against one process (and float64):
mixed precision, calls outside the sequence-parallel group, gradient bookkeeping, sampling in
generate()."""
import pytest

pytest.importorskip("transformers")

from tests import dist_users as du  # noqa: E402

pytestmark = pytest.mark.models

BF16_EPS = 2.0 ** -8


@pytest.mark.multirank
def test_autocast_casts_qkv_like_sdpa_and_returns_grads_in_input_dtypes(pools):
    res = pools(2).run(du.autocast_core, timeout=120)
    r0 = res[0]
    # output bf16 (the autocast dtype); each gradient in its input's dtype, as torch's SDPA gives
    assert r0["dtypes"] == r0["ref_dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float32",
                                                 "torch.bfloat16"], r0
    assert all(r["dtypes"] == r0["dtypes"] for r in res)
    # as close to float64 as one process's SDPA under the same autocast (bf16 rounding of the output)
    for sp, ref in zip(r0["sp_vs_exact"], r0["ref_vs_exact"]):
        assert sp <= 2 * ref + 4 * BF16_EPS, (r0["sp_vs_exact"], r0["ref_vs_exact"])
    assert max(r0["diffs"]) <= 8 * BF16_EPS * 4, r0["diffs"]


@pytest.mark.multirank
def test_custom_loop_under_autocast_matches_one_process(pools):
    res = pools(2).run(du.autocast_llama, timeout=180)
    r0 = res[0]
    assert res[1]["losses"] == r0["losses"]
    diff = max(abs(a - b) for a, b in zip(r0["losses"], r0["ref_losses"]))
    # within bf16 rounding of a ~5.5 loss, and the loop trained
    assert diff <= 4 * BF16_EPS * max(r0["ref_losses"]), (r0["losses"], r0["ref_losses"])
    assert r0["ref_losses"] != r0["fp32_losses"]          # autocast did take effect in the reference
    # the first step's gradients: no further from one process under autocast than bf16 itself moves them
    assert r0["grad_rel"] <= max(2 * r0["bf16_effect"], 4 * BF16_EPS), (r0["grad_rel"], r0["bf16_effect"])
    print("autocast loop:", r0["losses"], r0["ref_losses"], r0["grad_rel"], r0["bf16_effect"])


@pytest.mark.multirank
def test_trainer_bf16_loss_curve_matches_plain_trainer(pools):
    pytest.importorskip("accelerate")
    from tests import dist_trainer
    res = pools(2).run(dist_trainer.trainer_run, timeout=240, U=1, R=2, bf16=True)
    ref = dist_trainer.reference_run(dp=1, bf16=True)
    fp32 = dist_trainer.reference_run(dp=1)
    r0 = res[0]
    assert len(r0["losses"]) == len(ref["losses"]) == 4
    diff = max(abs(a - b) for a, b in zip(r0["losses"], ref["losses"]))
    assert diff <= 4 * BF16_EPS * max(ref["losses"]), (r0["losses"], ref["losses"])
    assert ref["losses"] != fp32["losses"]            # bf16 autocast did take effect
    norm = max(abs(a - b) / b for a, b in zip(r0["grad_norms"], ref["grad_norms"]))
    assert norm <= 4 * BF16_EPS, (r0["grad_norms"], ref["grad_norms"])
    print("trainer bf16:", r0["losses"], ref["losses"], fp32["losses"], norm)


@pytest.mark.multirank
def test_evaluation_on_rank_0_alone_raises_at_once(pools):
    res = pools(2).run(du.rank0_alone, timeout=120)
    r0 = res[0]
    assert r0["seconds"] < 5.0, r0                  # no collective: the groups would wait 20 s
    for case in ("forward", "generate"):
        assert r0[case] and "did not come through shard_batch" in r0[case], r0[case]
        assert "set_attn_implementation('sdpa')" in r0[case], r0[case]
    assert all(r["after_diff"] <= 1e-4 for r in res), res


@pytest.mark.multirank
def test_sync_gradients_refuses_to_sync_twice(pools):
    res = pools(2).run(du.sync_twice, timeout=120)
    for r in res:
        assert r["twice"] and "twice" in r["twice"], r
        assert r["twice_unchanged"] == 0.0, r
        assert r["per_micro_batch"] and "after the last micro-batch" in r["per_micro_batch"], r
        assert r["zeroed_in_place"] is None and r["set_to_none"] is None, r
    assert max(res[0]["ref_diffs"]) <= 1e-5, res[0]["ref_diffs"]


@pytest.mark.multirank
def test_dp_sp_loop_with_unequal_label_counts_matches_one_process(pools):
    res = pools(4).run(du.dp_sp_unequal_labels, timeout=240)
    r0 = res[0]
    assert all(r["losses"] == r0["losses"] for r in res), [r["losses"] for r in res]
    assert r0["loss_diff"] <= 1e-5, (r0["losses"], r0["ref_losses"])
    assert r0["grad_diff"] <= 1e-5 * max(1.0, r0["grad_scale"]), r0
    # without the dp group the step gets the mean of the replicas' means: visibly off
    assert r0["plain_loss_diff"] > 1e-3 and r0["plain_grad_diff"] > 100 * r0["grad_diff"], r0
    print("dp x sp:", r0["loss_diff"], r0["grad_diff"], r0["plain_loss_diff"], r0["plain_grad_diff"])


@pytest.mark.multirank
def test_sampled_generate_same_on_every_rank_and_equal_to_one_process(pools):
    res = pools(2).run(du.generate_sampling, timeout=180)
    r0 = res[0]
    assert all(r["tokens"] == r0["tokens"] for r in res), [r["tokens"] for r in res]
    assert r0["tokens"] == r0["ref_tokens"], (r0["tokens"], r0["ref_tokens"])
    assert r0["other_seed"] != r0["ref_tokens"]          # the seed matters: the match is not by chance
    # a criterion that fires on rank 1 only stops every rank on the same step (3 new tokens)
    assert [r["stopped_new"] for r in res] == [3, 3], [r["stopped_new"] for r in res]
    assert len({r["max_time_new"] for r in res}) == 1, [r["max_time_new"] for r in res]   # max_time: agreed
    for r in res:
        assert r["different_max_new"] and "different max_new_tokens" in r["different_max_new"], r
        assert r["after"] == r0["ref_greedy"], (r["after"], r0["ref_greedy"])


@pytest.mark.multirank
@pytest.mark.parametrize("world,U,R", [(2, 1, 2), (4, 2, 1)], ids=["ring2", "dp2-ulysses2"])
def test_trainer_evaluate_matches_plain_trainer(pools, world, U, R):
    pytest.importorskip("accelerate")
    from tests import dist_trainer
    res = pools(world).run(dist_trainer.evaluate_run, timeout=180, U=U, R=R)
    r0 = dict(res[0], **dist_trainer.evaluate_reference(dp=world // (U * R)))
    assert all(r["eval_loss"] == r0["eval_loss"] for r in res), [r["eval_loss"] for r in res]
    assert abs(r0["eval_loss"] - r0["ref_loss"]) <= 1e-5, (r0["eval_loss"], r0["ref_loss"])
    assert abs(r0["one_batch_loss"] - r0["ref_loss"]) > 1e-4, r0       # batches matter: the match is exact
    assert all(r["attn_after"] == "sdpa" for r in res)
    if world // (U * R) > 1:
        assert all(r["odd"] and "multiple of 4" in r["odd"] for r in res), [r["odd"] for r in res]


def test_run_fp8_on_a_ring_only_split_is_refused(capsys):
    from usp_hal.cli import build_parser, main
    from usp_hal.cli.run import config_from_args
    rc = main(["run", "--nproc", "2", "--ring", "2", "--fp8", "qvo"])
    assert rc == 2 and "has no all-to-all to apply it to" in capsys.readouterr().err
    for ok in (["--ring", "2", "--fp8", "qvo", "--ring-fp8"], ["--ulysses", "2", "--fp8", "qvo"]):
        cfg = config_from_args(build_parser().parse_args(["run", "--nproc", "2", *ok]))
        assert cfg.fp8 == "qvo"


def test_readme_plot_line_names_the_bench_extra():
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert "--plot" in text
    assert re.search(r"pip install -e '\.\[[a-z,]*bench[a-z,]*\]'", text), "no install line with the bench extra"


@pytest.mark.multirank
def test_one_line_per_distinct_refusal_naming_its_ranks(pools):
    res = pools(2).run(du.refusal_messages, timeout=60)
    for r in res:
        assert r["same"].endswith("the call: rank 0, rank 1: a padding mask"), r["same"]
        assert r["different"].endswith("the call: rank 0: reason 0; rank 1: reason 1"), r["different"]
        assert r["one"].endswith("the call: rank 1: only here"), r["one"]
    assert res[0] == res[1]


@pytest.mark.multirank
def test_ltx_text_padding_mask_matches_one_process(pools):
    pytest.importorskip("diffusers")
    from tests import diffusers_cases as dc
    r = pools(2).run(dc.model_case, timeout=120, name="ltx", U=2, R=1, text_pad=3)[0]
    assert r["out_diff"] <= 1e-5 * max(1.0, r["out_scale"]), r
    assert r["input_grad_diff"] <= 1e-5 * max(1.0, r["input_grad_scale"]), r
    assert r["param_grad_diff"] <= 1e-5 * max(1.0, r["param_grad_scale"]), r
    assert not r["params_missing"] and r["cross_calls"] > 0, r
    import torch
    model = dc.tiny_ltx(0)          # the padding changes the output: the mask is not a no-op
    with torch.no_grad():
        a = model(**dc.ltx_inputs(text_pad=3), return_dict=False)[0]
        b = model(**dc.ltx_inputs(), return_dict=False)[0]
    assert float((a - b).abs().max()) > 1e-3
