"""usp_hal.integrations.diffusers on real gloo ranks: a tiny FluxTransformer2DModel (2 double-
and 2 single-stream blocks) from a config under parallelize(), vs single-process in the same
worker, output and gradients, text lengths 16 and 7; negative controls; refusals; the example."""
import pytest

pytest.importorskip("diffusers")

from tests import integration_cases as cases  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.models]

TOL = 1e-5
SPLITS = [(2, 2, 1), (2, 1, 2), (4, 2, 2)]


def _check(r):
    assert r["out_diff"] <= TOL, r
    assert r["input_grad_diff"] <= TOL, r
    # parameter gradients reach |g| ~ 30 here: compare relative to the largest one
    assert r["param_grad_diff"] <= TOL * max(1.0, r["param_grad_scale"]), r
    assert r["params_compared"] > 100, r


@pytest.mark.parametrize("text_len", [16, 7])
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"w{s[0]}-u{s[1]}r{s[2]}")
def test_flux_output_and_gradients_match_single_process(pools, split, text_len):
    world, U, R = split
    _check(pools(world).run(cases.flux_case, timeout=120, U=U, R=R, text_len=text_len)[0])


def test_flux_with_gradient_checkpointing(pools):
    """Recomputation in backward runs the attention modules again: still usp-hal attention."""
    _check(pools(2).run(cases.flux_case, timeout=120, U=1, R=2, text_len=7, checkpointing=True)[0])


@pytest.mark.parametrize("control", ["img_ids", "local"])
def test_flux_negative_controls(pools, control):
    """The comparison can fail: image RoPE ids of other tokens, or attention over each rank's
    own tokens only, give errors far above the tolerance."""
    r = pools(2).run(cases.flux_case, timeout=120, U=2, R=1, text_len=7, control=control)[0]
    assert r["out_diff"] > 1000 * TOL, r


def test_flux_refusals_on_every_rank(pools):
    res = pools(2).run(cases.flux_refusals, timeout=120, U=1, R=2)
    for r in res:
        assert "only key masks [B, H or 1, 1, S_keys] over this rank's keys" in (r["attention_mask"] or ""), r
        assert "without calling dispatch_attention_fn" in (r["bypassing_processor"] or ""), r
        assert "already prepared" in (r["twice"] or ""), r
        assert "expected a 2-D tensor" in (r["ids_3d"] or ""), r
        assert r["after_remove_diff"] <= TOL, r       # remove() restores single-process behaviour
        assert r["after_refusals_diff"] <= TOL, r
        assert r["active_backend_restored"], r


def test_untested_diffusers_version_is_refused(monkeypatch):
    import diffusers
    import torch

    from usp_hal.integrations import diffusers as usp
    monkeypatch.setattr(diffusers, "__version__", "0.99.0")
    with pytest.raises(RuntimeError, match="tested with diffusers 0.42.1 and found 0.99.0"):
        usp.parallelize(torch.nn.Linear(2, 2))


def test_example_adds_at_most_five_lines():
    added = cases.added_lines("flux_single.py", "flux_sp.py")
    assert len(added) <= 5, added
    assert all("# usp-hal" in ln for ln in added), added


def test_example_matches_single_process_example(pools):
    r = pools(2).run(cases.example_pair, timeout=240, sp="flux_sp", single="flux_single")[0]
    assert r["max_diff"] <= TOL, r
