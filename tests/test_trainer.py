"""The HF Trainer path (usp_hal.integrations.training.trainer.USPTrainer): a tiny Llama trained by the
Trainer for 4 optimizer steps, against the plain Trainer in one process on the same global
batches (logged losses, gradient norms before clipping at 1.0, final parameters): Ring-2 on 2
gloo ranks on packed rows (DataCollatorWithFlattening, varlen_zigzag), and dp 2 x Ulysses-2 with
2 accumulation steps on 4 ranks on -100-padded rows of different token counts (only a loss
divided by the whole step's token count matches).  Also the refusals of what the path cannot
honour."""
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests import dist_trainer  # noqa: E402

pytestmark = pytest.mark.models

LOSS_TOL = 1e-5
NORM_TOL = 1e-5       # relative
PARAM_TOL = 1e-4      # AdamW amplifies rounding in near-zero-gradient elements (seen: 7e-6)

CASES = {   # name: (ranks, trainer_run kwargs)
    "ring2_packed": (2, dict(U=1, R=2, ga=1, packed=True, layout="varlen_zigzag")),
    "dp2_ulysses2_ga2": (4, dict(U=2, R=1, ga=2)),
    "ring2_low_memory": (2, dict(U=1, R=2, ga=1, low_memory=True)),     # USPTrainingArguments(usp_low_memory=True)
    # USPTrainingArguments(usp_tiled_loss=5): the loss in tiles of 5 of each rank's 12 tokens, under DDP
    "dp2_ring2_tiled_loss": (4, dict(U=1, R=2, ga=2, tiled_loss=5)),
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(CASES))
def test_trainer_matches_single_process_trainer(pools, case):
    world, kw = CASES[case]
    res = pools(world).run(dist_trainer.trainer_run, timeout=240, **kw)
    dp = world // (kw["U"] * kw["R"])
    ref = dist_trainer.reference_run(dp=dp, ga=kw["ga"], packed=kw.get("packed", False))
    r0 = res[0]
    assert r0["dp"] == dp, r0["dp"]
    assert len(ref["losses"]) == len(r0["losses"]) == 4, (ref["losses"], r0["losses"])
    assert all(r["losses"] == r0["losses"] for r in res), [r["losses"] for r in res]
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], ref["losses"]))
    assert loss_diff <= LOSS_TOL, (r0["losses"], ref["losses"])
    norm_diff = max(abs(a - b) / b for a, b in zip(r0["grad_norms"], ref["grad_norms"]))
    assert norm_diff <= NORM_TOL, (r0["grad_norms"], ref["grad_norms"])
    assert max(ref["grad_norms"]) > 1.0, ref["grad_norms"]     # clipping took part
    param_diff = float((r0["params"] - ref["params"]).abs().max())
    assert param_diff <= PARAM_TOL, param_diff
    print(f"{case}: loss diff {loss_diff:.1e}, grad-norm rel diff {norm_diff:.1e}, param diff {param_diff:.1e}")
    moved = float((ref["params"] - dist_trainer.initial_params()).abs().max())
    assert moved > 20 * PARAM_TOL, moved                         # it trained: the comparison is not trivial
    assert all(r["attn_after"] == "sdpa" for r in res)           # train() restored the model's attention
    assert all((r["module_low_memory"] != 0) == bool(kw.get("low_memory")) for r in res)
    assert not any(r["tiled_after"] for r in res)                # train() took the tiled loss off again
    # every micro-batch's loss was tiled (4 steps x ga), or none was
    assert all(r["tiled_calls"] == (4 * kw["ga"] if kw.get("tiled_loss") else 0) for r in res), res


def _args(**kw):
    from usp_hal.integrations.training.trainer import USPTrainingArguments
    return USPTrainingArguments(output_dir="unused", report_to=[], use_cpu=True, usp_ulysses_degree=2, **kw)


def _parallelism_config(**kw):
    from accelerate import ParallelismConfig
    return ParallelismConfig(**kw)


REFUSED = {
    "label_smoothing_factor": (lambda: _args(label_smoothing_factor=0.1), "shifts the labels again"),
    "average_tokens_across_devices": (lambda: _args(average_tokens_across_devices=False), "Leave it at its default"),
    "eval_strategy": (lambda: _args(eval_strategy="steps", eval_steps=1), "eval_strategy='no'"),
    # a cp/sp dim is usp-hal's sequence-parallel group (tests/test_engines_accelerate.py); tp is not composed
    "parallelism_config_tp": (lambda: _args(parallelism_config=_parallelism_config(tp_size=2, cp_size=2)), "tp_size=2"),
    "parallelism_config_no_sp": (lambda: _args(parallelism_config=_parallelism_config(dp_shard_size=2)),
                                 "no sequence-parallel group"),
    "deepspeed_alst": (lambda: _args(deepspeed={"sequence_parallel_size": 2, "zero_optimization": {"stage": 1}}),
                       "ALST"),
    "deepspeed_use_cpu": (lambda: _args(deepspeed={"zero_optimization": {"stage": 2}}), "never builds"),
    "batch_rebalance": (lambda: _args(train_sampling_strategy="batch_rebalance"), "load the same batch"),
    "fsdp": (lambda: _args(fsdp="full_shard"), "Use DDP (the default), or FSDP2 on the dp dim of a DeviceMesh"),
}


# transformers' TrainingArguments(deepspeed=...) needs the deepspeed package itself
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.optional_pkg) if n.startswith("deepspeed") else n
                                  for n in REFUSED])
def test_unsupported_trainer_features_are_refused(name):
    from accelerate.state import AcceleratorState
    if name.startswith("deepspeed"):
        pytest.importorskip("deepspeed")

    from usp_hal.integrations.training.trainer import USPTrainer
    make, reason = REFUSED[name]
    try:
        with pytest.raises(ValueError, match="USPTrainer does not support") as err:
            USPTrainer(model=None, args=make())
        assert reason in str(err.value), str(err.value)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.multirank
def test_dynamic_degree_trainer_matches_single_process_trainer(pools):
    """USPTrainingArguments(usp_dynamic_degree=True, usp_budget_tokens=16): each rank loads its own
    3 rows, every step's 12 rows (60 to 4 tokens) go to groups of 4, 2 and 1 rank; losses, grad
    norms (clipping takes part) and the parameters after 3 steps equal the plain Trainer in one
    process on 12 rows per step."""
    res = pools(4).run(dist_trainer.dynamic_trainer_run, timeout=240)
    ref = dist_trainer.dynamic_reference_run()
    r0 = res[0]
    assert all(r["sizes"] == [1, 2, 4] for r in res), [r["sizes"] for r in res]
    assert len(ref["losses"]) == len(r0["losses"]) == 3, (ref["losses"], r0["losses"])
    assert all(r["losses"] == r0["losses"] for r in res), [r["losses"] for r in res]
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], ref["losses"]))
    norm_diff = max(abs(a - b) / b for a, b in zip(r0["grad_norms"], ref["grad_norms"]))
    param_diff = float((r0["params"] - ref["params"]).abs().max())
    print(f"dynamic: loss diff {loss_diff:.1e}, grad-norm rel diff {norm_diff:.1e}, param diff {param_diff:.1e}")
    assert loss_diff <= LOSS_TOL and norm_diff <= NORM_TOL and param_diff <= PARAM_TOL, (loss_diff, norm_diff,
                                                                                        param_diff)
    assert max(ref["grad_norms"]) > 1.0, ref["grad_norms"]
    assert float((ref["params"] - dist_trainer.initial_params()).abs().max()) > 20 * PARAM_TOL
    assert all(r["attn_after"] == "sdpa" for r in res)


@pytest.mark.multirank
def test_dynamic_degree_trainer_takes_rows_shorter_than_a_group(pools):
    """4 rows of 9, 8, 8 and 3 tokens with at most 4 tokens per rank in a call (USPTrainer once
    refused this valid batch): trains like the plain Trainer in one process."""
    kw = dict(steps=2, bs=1, budget=4, lengths=(9, 8, 8, 3))
    res = pools(4).run(dist_trainer.dynamic_trainer_run, timeout=240, **kw)
    ref = dist_trainer.dynamic_reference_run(steps=2, bs=1, lengths=(9, 8, 8, 3))
    r0 = res[0]
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], ref["losses"]))
    param_diff = float((r0["params"] - ref["params"]).abs().max())
    assert len(r0["losses"]) == len(ref["losses"]) == 2
    assert loss_diff <= LOSS_TOL and param_diff <= PARAM_TOL, (loss_diff, param_diff)


@pytest.mark.multirank
def test_dynamic_degree_trainer_times_its_steps_for_the_measured_trial(pools):
    """usp_dynamic_trial_steps=1 and usp_dynamic_refit_steps=3: the Trainer's steps run the
    per-batch split and a fixed split in turn, each step timed by the lengths' gather (the same
    times on every rank), the price refitted to the last 3 of them (the same factors on every
    rank), and still train like the plain Trainer in one process."""
    res = pools(4).run(dist_trainer.dynamic_trainer_run, timeout=300, steps=5, trial_steps=1, refit_steps=3)
    ref = dist_trainer.dynamic_reference_run(steps=5)
    r0 = res[0]
    assert all(r["trial"] == r0["trial"] and r["refit"] == r0["refit"] for r in res), [r["trial"] for r in res]
    samples = r0["trial"]["samples"]
    assert len(samples["schedule"]) >= 1 and len(samples["fixed"]) >= 1, r0["trial"]
    assert 1 <= len(r0["refit"]["window"]) <= 3 and r0["refit"]["factors"] != {k: 1.0 for k in r0["refit"]["factors"]}
    assert all(r["losses"] == r0["losses"] for r in res), [r["losses"] for r in res]
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], ref["losses"]))
    param_diff = float((r0["params"] - ref["params"]).abs().max())
    assert len(r0["losses"]) == len(ref["losses"]) == 5
    assert loss_diff <= LOSS_TOL and param_diff <= PARAM_TOL, (loss_diff, param_diff)


def test_dynamic_degree_arguments_are_checked(tmp_path):
    from usp_hal.integrations.training.trainer import USPTrainingArguments, _sequence
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="needs usp_budget_tokens >= 1"):
        USPTrainingArguments(usp_dynamic_degree=True, **common)
    with pytest.raises(ValueError, match="leave usp_ulysses_degree and usp_ring_degree at 1"):
        USPTrainingArguments(usp_dynamic_degree=True, usp_budget_tokens=64, usp_ring_degree=2, **common)
    with pytest.raises(ValueError, match="usp_tiled_loss or usp_low_memory"):
        USPTrainingArguments(usp_dynamic_degree=True, usp_budget_tokens=64, usp_low_memory=True, **common)
    # the default profile prices bf16 GPU steps: in fp32 the arguments say so at set-up, naming the
    # Trainer's own arguments (once the first step's scheduling failed)
    with pytest.raises(ValueError, match=r"usp_profile='h100-nvlink', which has no attention kernel or linear-layer "
                                         r"rate for fp32 .* Set bf16=True .* set usp_profile="):
        USPTrainingArguments(usp_dynamic_degree=True, usp_budget_tokens=64, **common)
    with pytest.raises(ValueError, match="usp_profile='nope'"):
        USPTrainingArguments(usp_dynamic_degree=True, usp_budget_tokens=64, usp_profile="nope", **common)
    USPTrainingArguments(usp_dynamic_degree=True, usp_budget_tokens=64, bf16=True, **common)
    USPTrainingArguments(usp_dynamic_degree=True, usp_budget_tokens=64, usp_profile="cpu", **common)
    import torch
    ids = torch.arange(1, 9).view(1, 8)
    labels = ids.clone()
    labels[0, 5:] = -100
    got = _sequence({"input_ids": ids, "labels": labels}, 0)        # trailing ignored labels: right padding
    assert got[0].tolist() == [1, 2, 3, 4, 5]
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    assert _sequence({"input_ids": ids, "labels": ids, "attention_mask": mask}, 0)[0].tolist() == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="right-padded"):
        _sequence({"input_ids": ids, "labels": ids, "attention_mask": mask.flip(1)}, 0)
    with pytest.raises(ValueError, match="pack documents as separate rows"):
        _sequence({"input_ids": ids, "labels": ids, "position_ids": ids}, 0)


@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
def test_last_partial_batch_trains_as_the_plain_trainer(pools, iterable):
    # before: accelerate's sharding (over the 2 sequence-parallel ranks, then set to 1 replica)
    # filled the epoch's last batch (1 of 5 rows) with repeated rows; the plain Trainer in one
    # process trains on the short batch
    kw = dict(U=1, R=2, steps=3, rows=5)
    res = pools(2).run(dist_trainer.trainer_run, timeout=240, iterable=iterable, **kw)
    ref = dist_trainer.reference_run(steps=3, rows=5, iterable=iterable)
    r0 = res[0]
    assert len(ref["losses"]) == len(r0["losses"]) == 3, (ref["losses"], r0["losses"])
    assert all(r["losses"] == r0["losses"] for r in res), [r["losses"] for r in res]
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], ref["losses"]))
    assert loss_diff <= LOSS_TOL, (r0["losses"], ref["losses"])
    norm_diff = max(abs(a - b) / b for a, b in zip(r0["grad_norms"], ref["grad_norms"]))
    assert norm_diff <= NORM_TOL, (r0["grad_norms"], ref["grad_norms"])
    assert float((r0["params"] - ref["params"]).abs().max()) <= PARAM_TOL


@pytest.mark.multirank
def test_last_partial_batch_of_several_replicas_is_dropped_with_a_warning(pools):
    """dp 2 x Ring 2, 10 rows of 2 per replica: accelerate would fill the epoch's last batch (2 of
    4 rows) with repeated rows; USPTrainer drops it with a warning instead, and trains as the
    plain Trainer in one process with dataloader_drop_last=True (3 steps: the second epoch's
    first batch comes after the two whole ones)."""
    res = pools(4).run(dist_trainer.trainer_run, timeout=240, U=1, R=2, steps=3, rows=10)
    ref = dist_trainer.reference_run(dp=2, steps=3, rows=10, drop_last=True)
    r0 = res[0]
    assert all(r["drop_last"] for r in res)
    assert all(len(r["warned"]) == 1 and "last batch of 2 for 2 replicas" in r["warned"][0]
               and "dropped (dataloader_drop_last=True)" in r["warned"][0] for r in res), [r["warned"] for r in res]
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], ref["losses"]))
    assert len(ref["losses"]) == len(r0["losses"]) == 3 and loss_diff <= LOSS_TOL, (r0["losses"], ref["losses"])
    assert float((r0["params"] - ref["params"]).abs().max()) <= PARAM_TOL
