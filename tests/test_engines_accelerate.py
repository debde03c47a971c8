"""usp-hal on accelerate 1.15.0's ``ParallelismConfig``: its ``cp``/``sp`` dim as usp-hal's
sequence-parallel group (split into Ulysses x Ring), ``dp_shard`` (FSDP2) and ``dp_replicate`` on
the same DeviceMesh, on 4 gloo ranks, exact against one process (loss, gradient norm before
clipping at 1.0, parameters after 3 steps; tolerances of tests/test_trainer.py):

* a custom loop with accelerate (tests/dist_engines_accelerate.py ``accelerate_loop``: 2 lines of
  usp-hal glue beside ``shard_batch``/``register``) for ``ParallelismConfig(dp_shard_size=2,
  cp_size=2)`` as FSDP2 x Ring 2, ``(dp_replicate_size=2, sp_size=2)`` as accelerate's DDP x
  Ulysses 2, and ``(cp_size=4)`` as Ulysses 2 x Ring 2;
* the same loop with usp-hal's gradient reduction bypassed, which differs;
* USPTrainer with ``parallelism_config=`` for the first two, against the plain Trainer;
* the configurations usp-hal refuses, on every rank.

accelerate itself refuses every one of these on a machine without accelerators
(``ParallelismConfig is only compatible DistributedType.FSDP (version 2) or
DistributedType.Multi{Device} or DistributedType.DEEPSPEED, but got DistributedType.MULTI_CPU``),
and ``ParallelismConfig(dp_replicate_size=2, cp_size=2)`` anywhere (its ``__post_init__``: cp with
pure data parallel); usp-hal builds the DeviceMesh from the config instead."""
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests import dist_engines_accelerate as dea  # noqa: E402
from tests import dist_trainer  # noqa: E402
from tests.test_trainer import LOSS_TOL, NORM_TOL, PARAM_TOL  # noqa: E402

pytestmark = pytest.mark.models

LOOPS = {   # name: (ParallelismConfig kwargs, ulysses, ring, wrap, DeviceMesh dims)
    "fsdp2_dp_shard2_x_cp2_ring2": (dict(dp_shard_size=2, cp_size=2), 1, 2, "fsdp", ["dp_shard", "cp"]),
    # accelerate's own DeviceMesh (ParallelismConfig.build_device_mesh) handed to usp-hal, FSDP2 on its
    # flattened dp_shard_cp dim as accelerate's FSDP2 plugin would shard (sync_gradients scales by sp)
    "accelerate_mesh_fsdp2_dp_shard_cp_ulysses2": (dict(dp_shard_size=2, cp_size=2), 2, 1, "fsdp_dp_shard_cp",
                                                   ["dp_shard", "cp"]),
    "ddp_dp_replicate2_x_sp2_ulysses2": (dict(dp_replicate_size=2, sp_size=2), 2, 1, "accelerate",
                                         ["dp_replicate", "sp"]),
    "cp4_ulysses2_x_ring2": (dict(cp_size=4), 2, 2, "accelerate", ["cp"]),
}


@pytest.mark.parametrize("case", list(LOOPS))
def test_accelerate_loop_matches_one_process(pools, case):
    pc, U, R, wrap, dims = LOOPS[case]
    res = pools(4).run(dea.accelerate_loop, timeout=300, pc=pc, U=U, R=R, wrap=wrap,
                       accelerate_mesh=case.startswith("accelerate_mesh"))
    r0 = res[0]
    assert r0["dims"] == dims and tuple(r0["split"]) == (U, R), (r0["dims"], r0["split"])
    assert all(r["losses"] == r0["losses"] and r["norms"] == r0["norms"] for r in res)
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], r0["ref_losses"]))
    norm_rel = max(abs(a - b) / b for a, b in zip(r0["norms"], r0["ref_norms"]))
    print(f"{case} ({r0['kind']}, sp ranks of rank 0 {r0['sp_ranks']}): loss diff {loss_diff:.1e}, grad-norm rel "
          f"diff {norm_rel:.1e}, param diff {r0['param_diff']:.1e}")
    assert loss_diff <= LOSS_TOL, (r0["losses"], r0["ref_losses"])
    assert norm_rel <= NORM_TOL, (r0["norms"], r0["ref_norms"])
    assert max(r0["ref_norms"]) > 1.0, r0["ref_norms"]
    assert r0["param_diff"] <= PARAM_TOL, r0["param_diff"]


@pytest.mark.parametrize("case", ["fsdp2_dp_shard2_x_cp2_ring2", "ddp_dp_replicate2_x_sp2_ulysses2"])
def test_accelerate_loop_without_usp_reduction_differs(pools, case):
    pc, U, R, wrap, _ = LOOPS[case]
    r0 = pools(4).run(dea.accelerate_loop, timeout=300, pc=pc, U=U, R=R, wrap=wrap, bypass=True)[0]
    norm_rel = max(abs(a - b) / b for a, b in zip(r0["norms"], r0["ref_norms"]))
    print(f"{case} bypassed: grad-norm rel diff {norm_rel:.2e}, param diff {r0['param_diff']:.1e}")
    assert norm_rel > 100 * NORM_TOL, (r0["norms"], r0["ref_norms"])


TRAINER = {   # name: (ParallelismConfig kwargs, usp_ulysses_degree, usp_ring_degree, expected split)
    "dp_shard2_x_cp2_ring2": (dict(dp_shard_size=2, cp_size=2), 1, 2, (1, 2)),
    "dp_replicate2_x_sp2_default_ulysses": (dict(dp_replicate_size=2, sp_size=2), 1, 1, (2, 1)),
}


@pytest.mark.parametrize("case", list(TRAINER))
def test_trainer_with_parallelism_config_matches_single_process_trainer(pools, case):
    pc, U, R, split = TRAINER[case]
    res = pools(4).run(dea.trainer_run, timeout=300, pc=pc, U=U, R=R)
    ref = dist_trainer.reference_run(dp=2)
    r0 = res[0]
    assert r0["dp"] == 2 and tuple(r0["split"]) == split and r0["sp_ranks"] == [0, 1], r0
    assert all(r["kept"] and not r["accelerate_pc"] for r in res)     # accelerate never saw the config
    assert len(ref["losses"]) == len(r0["losses"]) == 4
    assert all(r["losses"] == r0["losses"] for r in res)
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], ref["losses"]))
    norm_rel = max(abs(a - b) / b for a, b in zip(r0["grad_norms"], ref["grad_norms"]))
    param_diff = float((r0["params"] - ref["params"]).abs().max())
    print(f"Trainer {case}: loss diff {loss_diff:.1e}, grad-norm rel diff {norm_rel:.1e}, param diff {param_diff:.1e}")
    assert loss_diff <= LOSS_TOL and norm_rel <= NORM_TOL and param_diff <= PARAM_TOL, (loss_diff, norm_rel,
                                                                                          param_diff)
    assert max(ref["grad_norms"]) > 1.0
    assert all(r["attn_after"] == "sdpa" for r in res)


REFUSED = {   # ParallelismConfig kwargs: words of the refusal
    "tp": (dict(tp_size=2, cp_size=2), "tp_size=2"),
    "no_sp_dim": (dict(dp_shard_size=4), "no sequence-parallel group"),
    "world_mismatch": (dict(dp_shard_size=2, cp_size=4), "8 but the process group has 4 ranks"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_parallelism_configs_are_refused_on_every_rank(pools, name):
    pc, words = REFUSED[name]
    res = pools(4).run(dea.refused_everywhere, timeout=60, pc=pc)
    assert all(r and words in r for r in res), res


def test_hsdp_x_cp_on_8_ranks_matches_one_process(pools):
    """dp_replicate 2 x dp_shard 2 x cp 2 (Ring 2): HSDP (FSDP2 on the 2-D dp sub-mesh) and
    usp-hal on one DeviceMesh, 4 replicas."""
    pc = dict(dp_replicate_size=2, dp_shard_size=2, cp_size=2)
    res = pools(8).run(dea.accelerate_loop, timeout=400, pc=pc, U=1, R=2, wrap="hsdp", layers=1)
    r0 = res[0]
    assert r0["dims"] == ["dp_replicate", "dp_shard", "cp"] and r0["sp_ranks"] == [0, 1], r0
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], r0["ref_losses"]))
    norm_rel = max(abs(a - b) / b for a, b in zip(r0["norms"], r0["ref_norms"]))
    print(f"hsdp x cp2: loss diff {loss_diff:.1e}, grad-norm rel diff {norm_rel:.1e}, "
          f"param diff {r0['param_diff']:.1e}")
    assert loss_diff <= LOSS_TOL and norm_rel <= NORM_TOL and r0["param_diff"] <= PARAM_TOL, r0
    assert max(r0["ref_norms"]) > 1.0, r0["ref_norms"]
