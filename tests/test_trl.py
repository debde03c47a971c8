"""TRL 1.16's trainers with usp-hal sequence parallelism (usp_hal.integrations.trl), against TRL's
plain trainers in one process on the same global batches: logged losses, gradient norms (before
clipping at 1.0), the parameters after 3 AdamW steps (under tests/test_trainer.py's bounds) and
the logged num_tokens; on Ring-2 and Ulysses-2 (2 gloo ranks), Ulysses-2 x Ring-2 and dp 2 x
Ring-2 (4 ranks).  Tiny Llama and Qwen2 models from configs, a word-level tokenizer built locally
and synthetic datasets: nothing is downloaded.  Every case also counts the model's attention-layer
calls and usp-hal's attention calls (they must be equal), and the bypassed variants (usp-hal's
attention left out, each rank attending over its own shard) must fail the comparison.

GRPO runs twice: its training step on given completions, and its whole ``train()`` with TRL's own
transformers generation (sequence-parallel, through usp-hal's sharded KV cache), where the ranks
of a replica must train on the same completions and, on one replica, on one process's.

The glue a TRL script adds (each test's docstring says what it uses): 3 lines, the import,
``SFTTrainer, SFTConfig = usp_trainer(SFTTrainer), usp_config(SFTConfig)`` (likewise DPO, GRPO)
and the ``usp_*`` degrees in the config (the whole GRPO recipe, examples/engines/trl_grpo.py, run
here, counts them); before, a hand-written mixin and arguments class took 9."""
import dataclasses
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from tests import dist_trl  # noqa: E402
from tests.mp import environ  # noqa: E402
from tests.test_trainer import LOSS_TOL, NORM_TOL, PARAM_TOL  # noqa: E402

pytestmark = [pytest.mark.models, pytest.mark.optional_pkg]

RUNS = {"sft": (dist_trl.sft_run, dist_trl.sft_reference), "dpo": (dist_trl.dpo_run, dist_trl.dpo_reference),
        "grpo": (dist_trl.grpo_run, dist_trl.grpo_reference)}

MESHES = {   # name: (ranks, degrees, model)
    "ring2": (2, dict(U=1, R=2), "llama"),
    "ulysses2": (2, dict(U=2, R=1), "qwen"),
    "ulysses2_ring2": (4, dict(U=2, R=2), "llama"),
    "dp2_ring2": (4, dict(U=1, R=2), "qwen"),
}

CASES = {f"{t}_{m}": (t, m, {}) for t in RUNS for m in MESHES}
CASES["sft_padded_ring2"] = ("sft", "ring2", dict(packing=False))         # rows with an attention_mask
CASES["sft_padded_dp2_ring2"] = ("sft", "dp2_ring2", dict(packing=False))
CASES["grpo_dapo_dp2_ring2"] = ("grpo", "dp2_ring2", dict(loss_type="dapo"))   # a token-count normaliser
CASES["sft_checkpointing_ulysses2_ring2"] = ("sft", "ulysses2_ring2", dict(checkpointing=True))   # TRL's default


def _compare(res, ref, steps: int = 3):
    r0 = res[0]
    assert len(ref["losses"]) == len(r0["losses"]) == steps, (ref["losses"], r0["losses"])
    assert all(r["losses"] == r0["losses"] for r in res), [r["losses"] for r in res]
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], ref["losses"]))
    norm_diff = max(abs(a - b) / b for a, b in zip(r0["grad_norms"], ref["grad_norms"]))
    param_diff = float((r0["params"] - ref["params"]).abs().max())
    return loss_diff, norm_diff, param_diff


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(CASES))
def test_trl_trainer_matches_single_process(pools, case):
    """Glue: 3 lines (the import, ``X, XConfig = usp_trainer(X), usp_config(XConfig)``, the
    ``usp_ulysses_degree=/usp_ring_degree=`` in the config); DPO's ``ref_model=`` and GRPO's given
    completions are TRL's own arguments.  Loss, grad norm and parameters after 3 steps within
    tests/test_trainer.py's bounds; every attention call went through usp-hal."""
    kind, mesh, extra = CASES[case]
    world, degrees, model = MESHES[mesh]
    run, reference = RUNS[kind]
    with environ(dist_trl.OFFLINE):
        res = pools(world).run(run, timeout=300, kind=model, **degrees, **extra)
        dp = world // (degrees["U"] * degrees["R"])
        ref = reference(dp=dp, kind=model, **extra)
    assert res[0]["dp"] == dp
    loss_diff, norm_diff, param_diff = _compare(res, ref)
    print(f"{case}: loss diff {loss_diff:.1e}, grad-norm rel diff {norm_diff:.1e}, param diff {param_diff:.1e}")
    assert loss_diff <= LOSS_TOL and norm_diff <= NORM_TOL and param_diff <= PARAM_TOL, (loss_diff, norm_diff,
                                                                                        param_diff)
    assert max(ref["grad_norms"]) > 1.0, ref["grad_norms"]                    # clipping took part
    moved = float((ref["params"] - dist_trl.initial_params(model)).abs().max())
    assert moved > 20 * PARAM_TOL, moved                                       # it trained
    for r in res:      # every attention call of every step went through usp-hal (2 layers per forward)
        calls = r["layer_calls"] + r.get("ref_layer_calls", 0)
        assert r["layer_calls"] >= 3 * 2 and r["usp_calls"] == calls, r
        assert r["attn_after"] == "sdpa" and r.get("ref_attn_after", "sdpa") == "sdpa"
    if kind == "dpo":       # the Trainer's default optimizer: these are 3 AdamW steps
        assert all(r["optimizer"] == "AdamW" for r in res), [r["optimizer"] for r in res]
    if kind != "grpo":      # TRL's logged num_tokens: the real tokens of the global batches, as one process
        assert all(r["num_tokens"] == ref["num_tokens"] for r in res), ([r["num_tokens"] for r in res],
                                                                          ref["num_tokens"])


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_bypassed_usp_attention_fails_the_comparison(pools, kind):
    """The negative control (the same 3 lines of glue, then the trainer's attention set back to SDPA):
    each rank attends over its own shard only, no call reaches usp-hal, and the losses and
    parameters leave the single-process reference by far more than the bounds."""
    run, reference = RUNS[kind]
    with environ(dist_trl.OFFLINE):
        res = pools(2).run(run, timeout=300, U=1, R=2, bypass=True)
        ref = reference(dp=1)
    loss_diff, _, param_diff = _compare(res, ref)
    print(f"{kind} bypassed: loss diff {loss_diff:.1e}, param diff {param_diff:.1e}")
    assert all(r["usp_calls"] == 0 and r["layer_calls"] > 0 for r in res), res
    assert loss_diff > 100 * LOSS_TOL and param_diff > 10 * PARAM_TOL, (loss_diff, param_diff)


@pytest.mark.multirank
def test_dpo_drift_on_a_diverging_sgd_run_is_rounding(pools):
    """DPO's drift after step 1 on a diverging SGD run (rel 1.6e-4 seen): rounding compounded by
    the run, not a wrong step.  6 SGD steps at lr 0.5 without clipping on Ring-2 (the loss
    swings from 0.69 to 22 through 3e-11): left free, one process's run leaves usp-hal's by more
    than 10x the grad-norm bound; started from usp-hal's parameters at every step (TRL's plain
    trainer, the parameters loaded before each step), one process gives each step's loss and
    grad norm within the bounds, so every step is exact and only the trajectories part.  (TRL's
    fused log-probabilities accumulate in float32 whatever the model's dtype, so a float64 run
    would not separate the two.)"""
    run = dict(steps=6, lr=0.5, optim="sgd", max_grad_norm=0.0)
    with environ(dist_trl.OFFLINE):
        res = pools(2).run(dist_trl.dpo_run, timeout=300, U=1, R=2, **run)
        free = dist_trl.dpo_reference(dp=1, **run)
        forced = dist_trl.dpo_reference(dp=1, forced=res[0]["trajectory"], **run)
    assert res[0]["optimizer"] == "SGD" and len(res[0]["trajectory"]) == 6
    assert max(free["losses"]) > 10 * free["losses"][0] and min(free["losses"]) < 1e-6, free["losses"]   # diverging
    _, free_norm, _ = _compare(res, free, steps=6)
    loss_diff, norm_diff, param_diff = _compare(res, forced, steps=6)
    print(f"dpo sgd: free grad-norm rel diff {free_norm:.1e}; from the same parameters each step: loss diff "
          f"{loss_diff:.1e}, grad-norm rel diff {norm_diff:.1e}, param diff after the last step {param_diff:.1e}")
    assert free_norm > 10 * NORM_TOL, free_norm
    assert loss_diff <= LOSS_TOL and norm_diff <= NORM_TOL and param_diff <= PARAM_TOL, (loss_diff, norm_diff,
                                                                                        param_diff)


GRPO_TRAIN = {   # name: (ranks, degrees, model, beta, loss type, steps per generation)
    "ring2": (2, dict(U=1, R=2), "llama", 0.0, "dapo", 1),
    "ring2_beta": (2, dict(U=1, R=2), "llama", 0.1, "grpo", 1),
    # one generation for 2 steps: the old policy's log-probabilities scored in the generation step
    "ring2_two_steps_per_generation": (2, dict(U=1, R=2), "llama", 0.0, "grpo", 2),
    "ulysses2": (2, dict(U=2, R=1), "qwen", 0.0, "grpo", 1),
    "ulysses2_beta": (2, dict(U=2, R=1), "qwen", 0.1, "dapo", 1),
    "dp2_ring2": (4, dict(U=1, R=2), "llama", 0.0, "dapo", 1),
    "dp2_ring2_beta": (4, dict(U=1, R=2), "qwen", 0.1, "grpo", 1),
}


def _replicas_calls(res) -> dict:
    """Each replica's reward calls (its prompts and completions per generation), after checking
    that every rank of the replica recorded the same ones."""
    by: dict = {}
    for r in res:
        by.setdefault(r["replica"], []).append(r["calls"])
    for replica, calls in by.items():
        assert all(c == calls[0] for c in calls), f"replica {replica}: its ranks trained on different completions"
    return {k: v[0] for k, v in sorted(by.items())}


def _joined(by: dict) -> list:
    """The replicas' calls of each generation joined in replica order (one process's batch)."""
    return [{"prompts": [p for calls in by.values() for p in calls[step]["prompts"]],
             "completion_ids": [c for calls in by.values() for c in calls[step]["completion_ids"]]}
            for step in range(len(next(iter(by.values()))))]


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(GRPO_TRAIN))
def test_grpo_train_matches_single_process(pools, case):
    """Glue: 3 lines (the import, ``GRPO, Config = usp_trainer(GRPOTrainer), usp_config(GRPOConfig)``,
    the ``usp_*`` degrees in the config).  ``GRPOTrainer.train()`` for 3 AdamW steps with TRL's
    own transformers generation (sampling, completions of different lengths), ``beta=0`` and
    ``beta=0.1`` with TRL's reference model: every rank of a replica trains on the same
    completions; on one replica they are one process's with the same prompts and seed; loss,
    grad norm, parameters and the logged num_tokens match one process training on the same
    completions.  Every attention call went through usp-hal: the training ones through its
    attention module, the generation ones through its sharded KV cache."""
    world, degrees, kind, beta, loss_type, spg = GRPO_TRAIN[case]
    dp = world // (degrees["U"] * degrees["R"])
    run = dict(kind=kind, beta=beta, loss_type=loss_type, steps_per_generation=spg)
    generations = -(-3 // spg)
    with environ(dist_trl.OFFLINE):
        res = pools(world).run(dist_trl.grpo_train_run, timeout=600, **run, **degrees)
        by = _replicas_calls(res)
        assert len(by) == dp and all(len(calls) == generations for calls in by.values()), by
        if dp == 1:         # TRL's own generation in one process, with the same prompts and seed
            ref = dist_trl.grpo_train_reference(dp=1, **run)
            assert ref["calls"] == by[0], "the completions differ from one process's"
        else:               # one process, given the replicas' completions
            assert by[0] != by[1], "the replicas sampled the same prompts"
            ref = dist_trl.grpo_train_reference(dp=dp, completions=_joined(by), **run)
            assert ref["calls"] == _joined(by)
    lengths = {len(c) for calls in by.values() for call in calls for c in call["completion_ids"]}
    assert len(lengths) > 2, lengths            # the completions differ in length (dapo's count is not trivial)
    loss_diff, norm_diff, param_diff = _compare(res, ref)
    print(f"grpo train {case}: loss diff {loss_diff:.1e}, grad-norm rel diff {norm_diff:.1e}, "
          f"param diff {param_diff:.1e}")
    assert loss_diff <= LOSS_TOL and norm_diff <= NORM_TOL and param_diff <= PARAM_TOL, (loss_diff, norm_diff,
                                                                                        param_diff)
    moved = float((ref["params"] - dist_trl.initial_params(kind)).abs().max())
    assert moved > 20 * PARAM_TOL, moved                                       # it trained
    if beta or spg > 1:     # the KL term, or the old policy's ratio, takes part
        assert max(abs(x) for x in ref["losses"][1:]) > 100 * LOSS_TOL, ref["losses"]
    for r in res:
        assert r["num_tokens"] == ref["num_tokens"], (r["num_tokens"], ref["num_tokens"])
        assert r["generation_batch_size"] == 4 * dp * spg    # the sampler counts the replicas
        assert r["initial_seed"] == r["replica"]             # seed 0 + the replica, as TRL's dp processes
        # the generations of 2 layers: the prefill and every decode step through the sharded cache
        assert r["prefill_calls"] == generations * 2 and r["decode_calls"] >= generations * 2, r
        training = r["layer_calls"] - r["prefill_calls"] - r["decode_calls"]
        # one forward of the loss per step; with spg > 1 the old policy's, in spg chunks per generation
        assert training == 2 * (3 + (generations * spg if spg > 1 else 0)), r
        assert r["usp_calls"] == training + r.get("ref_layer_calls", 0), r
        assert (r.get("ref_layer_calls", 0) == 2 * generations * spg) == bool(beta), r
        assert r["attn_after"] == "sdpa" and r.get("ref_attn_after", "sdpa") == "sdpa"
        assert r["error"] is None


@pytest.mark.multirank
def test_grpo_train_with_bypassed_training_attention_fails_the_comparison(pools):
    """The negative control of GRPO ``train()``: generation sequence-parallel as above, but the
    loss's forward on plain SDPA (each rank attends over its own shard): no training call
    reaches usp-hal (only the reference model's), and the losses, grad norms and parameters
    leave one process's by far more than the bounds."""
    with environ(dist_trl.OFFLINE):
        res = pools(2).run(dist_trl.grpo_train_run, timeout=600, U=1, R=2, beta=0.1, bypass="training")
        ref = dist_trl.grpo_train_reference(dp=1, beta=0.1)
    loss_diff, norm_diff, param_diff = _compare(res, ref)
    print(f"grpo train bypassed: loss diff {loss_diff:.1e}, grad-norm rel diff {norm_diff:.1e}, "
          f"param diff {param_diff:.1e}")
    assert all(r["usp_calls"] == r["ref_layer_calls"] for r in res), res
    # (the losses are small: the KL term's, beta 0.1, and dapo's policy term is 0 on-policy)
    assert loss_diff > 20 * LOSS_TOL and norm_diff > 100 * NORM_TOL and param_diff > 10 * PARAM_TOL, (
        loss_diff, norm_diff, param_diff)


@pytest.mark.multirank
def test_grpo_ranks_with_different_completions_are_refused(pools):
    """The other control: TRL's own generation on each rank from TRL's per-process seed (what
    each rank would do without usp-hal's generation) gives the ranks of the replica different
    completions; the first sequence-parallel call of the step refuses them on every rank."""
    with environ(dist_trl.OFFLINE):
        res = pools(2).run(dist_trl.grpo_train_run, timeout=600, U=1, R=2, bypass="generation")
    assert res[0]["calls"][0] != res[1]["calls"][0], "the control did not make the completions differ"
    for r in res:
        assert r["error"] and "passed different batches" in r["error"], r["error"]
        assert r["losses"] == [], r["losses"]


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["varlen_zigzag", "zigzag", "basic"])
def test_shard_batch_shards_trls_seq_idx_with_the_tokens(pools, layout):
    """Glue: none (shard_batch runs inside the trainer).  TRL 1.16's padding-free collator adds
    seq_idx (each token's document); shard_batch gives
    each rank the documents of its own tokens, and refuses a seq_idx that disagrees with the
    boundaries (on every rank)."""
    with environ(dist_trl.OFFLINE):
        res = pools(2).run(dist_trl.seq_idx_shards, timeout=120, layout=layout)
    assert sorted(x for r in res for x in r["seq_idx"]) == sorted(x for r in res for x in r["docs"])
    for r in res:
        assert r["seq_idx"] == r["docs"], r
        assert r["dtype"] == "torch.int32"
        assert "does not number the documents" in r["bad"], r["bad"]
    assert res[0]["n_docs"] == 4


@pytest.mark.multirank
def test_plain_sft_trainer_with_usp_attention_names_the_trainers(pools):
    """Glue: none, the failing case (usp-hal's attention on the model, TRL's plain SFTTrainer):
    refused on every rank, and
    the message names USPTrainer and usp_hal.integrations.trl (a Trainer user cannot call shard_batch)."""
    with environ(dist_trl.OFFLINE):
        res = pools(2).run(dist_trl.plain_sft_refused, timeout=120)
    for r in res:
        assert r["error"] and "did not come through shard_batch" in r["error"], r
        assert "USPTrainer" in r["error"] and "usp_hal.integrations.trl" in r["error"], r["error"]


REFUSED = {
    "precompute_ref_log_probs": "precompute_ref_log_probs=True",
    "no_ref_model": "Pass ref_model=",
    "use_vllm": "must share theirs",
    "continuous_batching": "continuous batching does not go through the sequence-parallel generate()",
    "tools": "tool calls, custom rollouts and environments would run once on every rank",
    "positional": "pass the arguments by name",
    "moe_router_loss": "Pass router_aux_loss_coef=0.0",
    # USPTrainer takes a ParallelismConfig's cp/sp dim as its group (docs/engines.md); on one
    # process a cp of 2 does not fit, and that is refused before TRL's set-up
    "parallelism_config_cp": "make the product the world size",
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_unsupported_trl_options_are_refused_before_set_up(what):
    """Glue: the same 3 lines; each refusal comes from the arguments, before TRL's set-up."""
    with environ(dist_trl.OFFLINE):
        err = dist_trl.refusal(what)
    assert err is not None and REFUSED[what] in err, err


def test_import_patches_nothing_and_other_trainers_are_refused():
    """Glue: the import alone changes no TRL class; the configs keep TRL's defaults."""
    import trl

    import usp_hal.integrations.trl as ut
    before = (trl.SFTTrainer.compute_loss, trl.DPOTrainer.compute_loss, trl.GRPOTrainer._generate)
    assert ut.USPSFTTrainer is ut.usp_trainer(trl.SFTTrainer)
    assert issubclass(ut.USPDPOConfig, trl.DPOConfig)
    defaults = {f.name: f.default for f in dataclasses.fields(ut.USPSFTConfig)}
    theirs = {f.name: f.default for f in dataclasses.fields(trl.SFTConfig)}
    assert all(defaults[k] == v for k, v in theirs.items() if not callable(v)), "TRL's defaults kept"
    assert {"usp_ulysses_degree", "usp_ring_degree", "usp_layout"} <= set(defaults)
    assert (trl.SFTTrainer.compute_loss, trl.DPOTrainer.compute_loss, trl.GRPOTrainer._generate) == before
    with pytest.raises(ValueError, match="only the losses of TRL's SFTTrainer, DPOTrainer and GRPOTrainer"):
        ut.usp_trainer(trl.RewardTrainer)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


GRPO_RECIPE = os.path.join(ROOT, "examples", "engines", "trl_grpo.py")


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_grpo_recipe_runs_under_torchrun_and_adds_three_lines(tmp_path):
    """examples/engines/trl_grpo.py, the whole GRPO script docs/engines.md links, runs as written
    under ``torchrun --nproc_per_node 2`` (3 steps, Ring 2), and the lines it marks as usp-hal's
    are the 3 the TRL row counts."""
    from pathlib import Path

    from tests.test_engine_recipes import marked_lines
    with open(os.path.join(ROOT, "docs", "engines.md"), encoding="utf-8") as f:
        row = next(line for line in f.read().splitlines() if line.startswith("| **TRL"))
    with open(GRPO_RECIPE, encoding="utf-8") as f:
        code = f.read()
    added = marked_lines(Path(GRPO_RECIPE))
    assert len(added) == 3 and "| 3 lines (DPO 4, with `ref_model=`), for each trainer" in row, added
    assert not re.search(r"\b(register|set_attn_implementation|shard_batch)\(", code)   # the trainer does them
    script = tmp_path / "grpo_sp.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               **dist_trl.OFFLINE)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                          str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    # both ranks print it (their lines may interleave with the Trainer's); torchrun's exit 0 says both finished
    assert "GRPO steps: 3" in res.stdout, res.stdout[-2000:]
