"""Hybrid models (tests/hybrid_cases.py's tiny nemotron_h: a Mamba2 mixer beside attention)
through the rest of usp-hal: the HF Trainer path (USPTrainer on Ring-2, where the SSD scan
runs by state passing, against the plain Trainer in one process: logged losses, gradient norms
before clipping, final parameters) and the recurrence option of the training arguments."""
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests import dist_hybrid_compose as dhc  # noqa: E402

pytestmark = pytest.mark.models

LOSS_TOL = 1e-5
NORM_TOL = 1e-5       # relative
PARAM_TOL = 1e-4      # AdamW scales fp32 rounding in near-zero gradient entries towards lr


@pytest.mark.multirank
@pytest.mark.parametrize("recurrence,mode", [("auto", "state_passing")])
def test_usp_trainer_on_a_hybrid_matches_the_plain_trainer(pools, recurrence, mode):
    res = pools(2).run(dhc.trainer_run, timeout=300, U=1, R=2, recurrence=recurrence)
    ref = dhc.trainer_reference(dp=1)
    r0 = res[0]
    assert r0["modes"] == [mode], r0["modes"]
    assert len(r0["losses"]) == len(ref["losses"]) == 3, (r0["losses"], ref["losses"])
    assert all(r["losses"] == r0["losses"] for r in res), [r["losses"] for r in res]
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], ref["losses"]))
    norm_diff = max(abs(a - b) / b for a, b in zip(r0["grad_norms"], ref["grad_norms"]))
    param_diff = float((r0["params"] - ref["params"]).abs().max())
    print(f"trainer {recurrence}: loss {loss_diff:.1e}, grad norm rel {norm_diff:.1e}, params {param_diff:.1e}")
    assert loss_diff <= LOSS_TOL, (r0["losses"], ref["losses"])
    assert norm_diff <= NORM_TOL, (r0["grad_norms"], ref["grad_norms"])
    assert param_diff <= PARAM_TOL, param_diff
    moved = float((ref["params"] - ref["start"]).abs().max())
    assert moved > 20 * PARAM_TOL, moved          # it trained: the comparison is not trivial
    assert all(r["attn_after"] == "sdpa" for r in res)


def test_training_arguments_refuse_a_bad_recurrence():
    from usp_hal.integrations.training.trainer import USPTrainingArguments
    with pytest.raises(ValueError, match=r"recurrence='scan': expected one of \('auto', 'head_parallel', "
                                         r"'state_passing'\)"):
        USPTrainingArguments(output_dir="unused", report_to=[], use_cpu=True, usp_recurrence="scan")
    args = USPTrainingArguments(output_dir="unused", report_to=[], use_cpu=True, usp_recurrence="head_parallel")
    assert args.usp_recurrence == "head_parallel"


def test_recurrence_on_the_command_line():
    from transformers import HfArgumentParser

    from usp_hal.integrations.training.trainer import USPTrainingArguments
    parser = HfArgumentParser(USPTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", "unused", "--report_to", "none", "--use_cpu",
                                                  "--usp_recurrence", "state_passing"])
    assert args.usp_recurrence == "state_passing"
    with pytest.raises(SystemExit):     # argparse refuses a value outside the choices
        parser.parse_args_into_dataclasses(["--output_dir", "unused", "--usp_recurrence", "scan"])


DP_SP_TOL = dict(loss=1e-5, grad=1e-4, param=1e-4)     # fp32; grad: relative to each gradient's largest entry


@pytest.mark.multirank
def test_hybrid_dp2_ring2_matches_one_process(pools):
    """dp 2 x Ring-2 on 4 ranks: DDP over the dp group with the SSD scan by state passing
    ("auto" on a ring) and head-parallel, and FSDP2 over the dp sub-mesh with state passing,
    against one process training on both replicas' batches."""
    runs = (("ddp", "auto"), ("ddp", "head_parallel"), ("fsdp", "auto"))
    res = pools(4).run(dhc.dp_sp_training, timeout=300, runs=runs)
    modes = {"auto": ["state_passing"], "head_parallel": ["head_parallel"]}
    for wrapper, rec in runs:
        key = f"{wrapper}-{rec}"
        r0 = res[0][key]
        print(f"dp x sp {key}: loss {r0['loss_diff']:.1e}, grad rel {r0['grad_rel']:.1e}, "
              f"params {r0['param_diff']:.1e}")
        assert r0["modes"] == modes[rec], r0["modes"]
        assert all(r[key]["losses"] == r0["losses"] for r in res), [r[key]["losses"] for r in res]
        assert r0["loss_diff"] <= DP_SP_TOL["loss"], r0
        assert r0["grad_rel"] <= DP_SP_TOL["grad"], r0
        assert r0["param_diff"] <= DP_SP_TOL["param"], r0
        assert r0["loss_change"] > 0.05, r0         # it trained
