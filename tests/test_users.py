"""What users of the integrations do next, on 2 gloo ranks against one process (and float64):
mixed precision, calls outside the sequence-parallel group, gradient bookkeeping, sampling in
generate()."""
import pytest

pytest.importorskip("transformers")

from tests import dist_users as du  # noqa: E402

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
