"""Data parallel x sequence parallel: dp 2 x sp 2 on 4 gloo ranks from one DeviceMesh, a tiny
Llama (2 layers) trained with AdamW under FSDP2 (``fully_shard`` over the dp sub-mesh, and over
the whole world), DDP (over the dp group, and over the world) and a plain module; losses and the
first step's gradients against one process training on both replicas' batches; forgetting
``sync_gradients`` raises at the optimizer step; the per-parameter reduction rules."""
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from tests import dist_dp_sp  # noqa: E402

pytestmark = pytest.mark.models

LOSS_TOL = 1e-5
GRAD_TOL = 1e-6       # fp32 gradients of |g| <= 0.1
PARAM_TOL = 2e-4      # 4 AdamW steps at lr 2e-3 amplify rounding in the first, near-zero-gradient steps


@pytest.mark.multirank
@pytest.mark.parametrize("wrapper", ["fsdp", "ddp", "plain", "fsdp_world", "ddp_world"])
def test_dp2_sp2_training_matches_single_process(pools, wrapper):
    res = pools(4).run(dist_dp_sp.dp_sp_training, timeout=180, wrapper=wrapper, steps=4)
    r0 = res[0]
    assert r0["loss_diff"] <= LOSS_TOL, r0
    assert r0["grad_diff"] <= GRAD_TOL and r0["grad_scale"] > 1e-2, r0
    assert r0["param_diff"] <= PARAM_TOL, r0
    assert r0["loss_change"] > 0.5, r0          # it trained: the comparison is not trivial
    assert all(r["losses"] == r0["losses"] for r in res), [r["losses"] for r in res]
    assert r0["grad_kinds"] == (["DTensor"] if wrapper.startswith("fsdp") else ["Parameter"]), r0


@pytest.mark.multirank
@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_skipping_sync_is_far_from_single_process(pools, wrapper):
    """Negative control: the same run stepping on partial gradients (check off) is far off."""
    r0 = pools(4).run(dist_dp_sp.dp_sp_training, timeout=180, wrapper=wrapper, steps=4, sync=False)[0]
    assert r0["grad_diff"] > 1e-2 and r0["loss_diff"] > 1e-2, r0


@pytest.mark.multirank
@pytest.mark.parametrize("wrapper", ["plain", "fsdp"])
def test_optimizer_step_without_sync_raises_on_every_rank(pools, wrapper):
    for r in pools(4).run(dist_dp_sp.forgotten_sync, timeout=180, wrapper=wrapper):
        assert r["error"] and "without usp_hal.integrations.sync_gradients" in r["error"], r
        assert r["untouched"], r        # the refused step changed nothing
        assert r["stepped"], r          # after sync_gradients the step runs


def _mesh(rank, sp_ranks, world=8):
    return SimpleNamespace(rank=rank, sp_ranks=tuple(sp_ranks), sp_size=len(sp_ranks),
                           dp_degree=world // len(sp_ranks))


@pytest.mark.models
def test_custom_fsdp_divide_factor_is_refused_on_every_rank(pools):
    """torchtitan sets FSDP's divide factor to 1.0 (a sum); sync_gradients' rules assume the
    default mean, and applying them there doubled the gradient norm.  A custom factor is refused
    on every rank before any collective; the default one is synced."""
    for r in pools(4).run(dist_dp_sp.custom_divide_factor, timeout=180, factor=1.0):
        assert r["error"] and "divide factor" in r["error"] and "mark_synced" in r["error"], r
        assert r["grads_unchanged"], r
    for r in pools(4).run(dist_dp_sp.custom_divide_factor, timeout=180, factor=None):
        assert r["error"] is None and not r["grads_unchanged"], r      # synced: times sp


def test_reduction_rules_per_wrapper_group():
    from usp_hal.integrations.training import grads

    m = _mesh(1, (0, 1, 2, 3))
    assert grads._mode_for(None, m, "x") == (grads.SUM_SP_MEAN_DP, None)          # plain module
    assert grads._mode_for((1, 5), m, "x") == (grads.SUM_SP, None)                # dp group: orthogonal to sp
    assert grads._mode_for(tuple(range(8)), m, "x") == (grads.SCALE_SP, None)     # the world: contains sp
    mode, why = grads._mode_for((0, 1, 4, 5), m, "the gradient of w")            # half of the sp group
    assert mode == 0 and "some but not all" in why and "the gradient of w" in why
    assert grads._mode_for(None, _mesh(0, (0, 1, 2, 3), world=4), "x") == (grads.SUM_SP, None)


def test_set_sync_check_rejects_unknown_modes():
    from usp_hal.integrations import set_sync_check
    with pytest.raises(ValueError, match="'raise', 'warn' or 'off'"):
        set_sync_check("loud")
    assert set_sync_check("raise") == "raise"
