"""usp-hal sequence parallelism under DeepSpeed ZeRO stages 1-3 (deepspeed==0.19.8, the ``engines``
extra), on 4 gloo ranks with DeepSpeed's CPU accelerator and torch AdamW as its client optimizer:

* a custom loop (tests/dist_engines_deepspeed.py ``engine_loop``, 3 lines of usp-hal glue) whose
  only switch between a DeepSpeed engine and FSDP2 is how the model was wrapped: loss, gradient
  norm before clipping and parameters after 3 steps against one process;
* the bypassed variant (the engine averages each rank's share over the world with no sum over the
  sp group): gradient norm exactly 0.5x one process, so the comparison can fail;
* USPTrainer with ``args.deepspeed`` a ZeRO config dict, against the plain Trainer in one process;
* an engine that runs DeepSpeed's own sequence parallelism (ALST) is refused on every rank."""
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")
pytest.importorskip("triton")   # its ZeRO engine path imports triton (ModuleNotFoundError without it)

from tests import dist_engines_deepspeed as dsd  # noqa: E402
from tests import dist_trainer  # noqa: E402
from tests.test_trainer import LOSS_TOL, NORM_TOL, PARAM_TOL  # noqa: E402

pytestmark = [pytest.mark.models, pytest.mark.optional_pkg]


def _close(res, ref_losses, ref_norms):
    loss_diff = max(abs(a - b) for a, b in zip(res["losses"], ref_losses))
    norm_rel = max(abs(a - b) / b for a, b in zip(res["norms"], ref_norms))
    return loss_diff, norm_rel


@pytest.mark.parametrize("engine", ["zero1", "zero2", "zero3", "fsdp"])
def test_one_loop_matches_one_process(pools, engine):
    res = pools(4).run(dsd.engine_loop, timeout=300, engine=engine)
    r0 = res[0]
    assert all(r["losses"] == r0["losses"] for r in res), [r["losses"] for r in res]
    assert all(r["norms"] == r0["norms"] for r in res), [r["norms"] for r in res]
    loss_diff, norm_rel = _close(r0, r0["ref_losses"], r0["ref_norms"])
    print(f"{engine} ({r0['kind']}, {r0['optimizer']}): loss diff {loss_diff:.1e}, grad-norm rel diff "
          f"{norm_rel:.1e} (norms {r0['norms']} vs {r0['ref_norms']}), param diff {r0['param_diff']:.1e}")
    assert r0["kind"] == ("DeepSpeedEngine" if engine.startswith("zero") else "FSDPLlamaForCausalLM"), r0["kind"]
    assert loss_diff <= LOSS_TOL, (r0["losses"], r0["ref_losses"])
    assert norm_rel <= NORM_TOL, (r0["norms"], r0["ref_norms"])
    assert max(r0["ref_norms"]) > 1.0, r0["ref_norms"]          # clipping took part
    assert r0["param_diff"] <= PARAM_TOL, r0["param_diff"]
    assert r0["moved"] > 20 * PARAM_TOL, r0["moved"]             # it trained


@pytest.mark.parametrize("engine", ["zero2", "fsdp"])
def test_bypassed_gradient_sum_differs(pools, engine):
    """Without the sum over the sp group the exact test above would fail.  DeepSpeed's bypass is a
    pure scale (each rank's share averaged over the world: half the exact gradient at sp = 2, the
    mirror of ALST's 2x): clipping and AdamW hide a scale in the parameters, the gradient norm
    does not.  FSDP2 on the dp dim without the sum steps each rank on its own tokens' gradient."""
    r0 = pools(4).run(dsd.engine_loop, timeout=300, engine=engine, bypass=True)[0]
    ratio = r0["norms"][0] / r0["ref_norms"][0]
    print(f"{engine} bypassed: first grad norm {ratio:.4f}x one process")
    assert abs(ratio - 1.0) > 100 * NORM_TOL, ratio
    if engine == "zero2":
        assert abs(ratio - 0.5) < 1e-5, ratio
    else:
        assert r0["param_diff"] > PARAM_TOL, r0["param_diff"]


def test_alst_loss_doubles_the_gradient_and_usp_hal_does_not(pools):
    """DeepSpeed ALST's measured 2.00x, reproduced with its own loss function and ZeRO's reduction
    rule under sequence_parallel_size (the engine itself needs its sp groups): two sums over the
    sp group (the all_gather's backward and ZeRO's divide by dp only); usp-hal's is 1.00x."""
    res = pools(2).run(dsd.alst_grad_norm_ratio, timeout=200)      # sp = 2 = the world (see its doc)
    print("first grad norm over one process's:", res[0])
    assert all(abs(r["alst"] - 2.0) < 1e-5 for r in res), res
    assert all(abs(r["usp"] - 1.0) < NORM_TOL for r in res), res


def test_engines_that_cannot_give_the_exact_gradient_are_refused(pools):
    res = pools(4).run(dsd.engine_refusals, timeout=200)
    assert all(r["alst"] and "ALST" in r["alst"] and "sequence_parallel_size=2" in r["alst"] for r in res), res
    assert all(r["mpu"] and "without an mpu" in r["mpu"] for r in res), res
    assert all(r["plain"] == 2 for r in res), res           # the world-wide engine: loss times sp


@pytest.mark.parametrize("stage,ga", [(1, 1), (2, 1), (3, 1), (2, 2)])
def test_trainer_with_deepspeed_matches_single_process_trainer(pools, stage, ga):
    """ga=2: the engine accumulates (the Trainer turns off its scaling by the accumulation steps)
    and the loss divides by the whole step's token count."""
    res = pools(4).run(dsd.trainer_run, timeout=300, stage=stage, U=2, R=1, ga=ga)
    ref = dist_trainer.reference_run(dp=2, ga=ga)
    r0 = res[0]
    assert r0["dp"] == 2 and r0["kind"] == "DeepSpeedEngine", (r0["dp"], r0["kind"])
    assert len(ref["losses"]) == len(r0["losses"]) == 4, (ref["losses"], r0["losses"])
    assert all(r["losses"] == r0["losses"] for r in res), [r["losses"] for r in res]
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], ref["losses"]))
    norm_rel = max(abs(a - b) / b for a, b in zip(r0["grad_norms"], ref["grad_norms"]))
    param_diff = float((r0["params"] - ref["params"]).abs().max())
    print(f"Trainer ZeRO-{stage} ga {ga}: loss diff {loss_diff:.1e}, grad-norm rel diff {norm_rel:.1e}, "
          f"param diff {param_diff:.1e}")
    assert loss_diff <= LOSS_TOL, (r0["losses"], ref["losses"])
    assert norm_rel <= NORM_TOL, (r0["grad_norms"], ref["grad_norms"])
    assert max(ref["grad_norms"]) > 1.0, ref["grad_norms"]
    assert param_diff <= PARAM_TOL, param_diff
    assert all(r["attn_after"] == "sdpa" for r in res)


def test_trainer_with_deepspeed_without_a_gloo_state_is_refused(pools):
    """Without an accelerator accelerate finds no backend for DeepSpeed and counts one process:
    refused on every rank, saying how to make the state."""
    res = pools(4).run(dsd.trainer_run, timeout=200, stage=1, premade_state=False)
    assert all("use_configured_state" in r["refused"] and "1 process(es) under DeepSpeed" in r["refused"]
               for r in res), res
