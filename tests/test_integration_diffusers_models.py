"""diffusers transformers beyond Flux under parallelize(): tiny random Wan 2.1 (1-D and per-token
timesteps; cross-attention to the unsharded text), Qwen-Image (joint text+image) and LTX-Video
(cross-attention to sharded text) against one process: output, summed input gradients, synced
parameter gradients; Flux.2, ChronoEdit and MiniMax-H3 (one packed text, keyframe, audio and video
sequence split inside the model) likewise; a negative control; every diffusers transformer with a
_cp_plan is verified here or refused with its name."""
import pytest

pytest.importorskip("diffusers")

from tests import diffusers_cases as cases  # noqa: E402

pytestmark = pytest.mark.models

TOL = 1e-5


def _check(r, cross: bool):
    assert r["out_diff"] <= TOL * max(1.0, r["out_scale"]), r
    assert r["input_grad_diff"] <= TOL * max(1.0, r["input_grad_scale"]), r
    assert r["param_grad_diff"] <= TOL * max(1.0, r["param_grad_scale"]), r
    assert r["params_compared"] > 50 and not r["params_missing"], r
    assert (r["cross_calls"] > 0) == cross, r


CASES = [("wan", 2, 2, 1, {}), ("wan", 2, 1, 2, {"timestep_dims": 2}), ("wan", 4, 2, 2, {}),
         ("qwen", 2, 2, 1, {}), ("qwen", 2, 1, 2, {}), ("ltx", 2, 2, 1, {}), ("ltx", 4, 2, 2, {}),
         # text padding: Qwen-Image's joint key mask over [text; image] (Ring-2 with 21 image
         # tokens: local joint lengths 4+11 and 3+10, not the basic split of 28, so both are
         # padded to 15), LTX-Video's encoder mask in cross-attention, also with as many video
         # as text tokens per rank (still cross-attention)
         ("qwen", 2, 2, 1, {"text_pad": 3}), ("qwen", 2, 1, 2, {"text_pad": 3, "h": 3, "w": 7}),
         ("ltx", 2, 2, 1, {"text_pad": 3}), ("ltx", 2, 1, 2, {"text_pad": 3, "frames": 1, "h": 1, "w": 7}),
         ("flux2", 2, 2, 1, {}), ("flux2", 2, 1, 2, {}), ("chronoedit", 2, 2, 1, {}), ("chronoedit", 2, 1, 2, {}),
         # one packed [text | keyframe | audio | video] sequence of 25 rows, split inside the model
         ("minimax_h3", 2, 2, 1, {}), ("minimax_h3", 2, 1, 2, {})]


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-w{c[1]}-u{c[2]}r{c[3]}" + "".join(
    f"-{k}{v}" for k, v in c[4].items()))
def test_model_output_and_gradients_match_single_process(pools, case):
    name, world, U, R, kw = case
    r = pools(world).run(cases.model_case, timeout=120, name=name, U=U, R=R, **kw)[0]
    _check(r, cross=name in ("wan", "ltx", "chronoedit"))


@pytest.mark.multirank
def test_cross_attention_to_sharded_text_needs_the_gather(pools):
    """Negative control: LTX-Video's cross-attention to the local text shard only is far off."""
    r = pools(2).run(cases.model_case, timeout=120, name="ltx", U=2, R=1, control="local_cross")[0]
    assert r["out_diff"] > 1000 * TOL and r["cross_calls"] > 0, r


def _plan_classes():
    """Every diffusers model class with a context-parallel plan (its top-level exports; the
    plans live in diffusers.models.transformers)."""
    import inspect

    import diffusers
    import torch
    out = []
    for name in dir(diffusers):
        try:
            obj = getattr(diffusers, name)
        except Exception:       # an optional dependency missing: not a model class here
            continue
        if inspect.isclass(obj) and issubclass(obj, torch.nn.Module) and getattr(obj, "_cp_plan", None):
            out.append(obj)
    return out


# the test case that verifies each model of VERIFIED_MODELS (Flux: tests/test_integration_diffusers.py)
VERIFIED_BY = {"FluxTransformer2DModel": "flux", "WanTransformer3DModel": "wan", "QwenImageTransformer2DModel": "qwen",
               "LTXVideoTransformer3DModel": "ltx", "Flux2Transformer2DModel": "flux2",
               "ChronoEditTransformer3DModel": "chronoedit", "MiniMaxH3Transformer3DModel": "minimax_h3"}
# not verified yet: refused unless allow_unverified=True, with that reason (none at present)
UNVERIFIED: set = set()


def test_every_model_with_a_plan_is_verified_or_refused_by_name():
    import torch

    from usp_hal.integrations import diffusers as usp
    classes = _plan_classes()
    names = {c.__name__ for c in classes}
    assert len(classes) >= 9, sorted(names)
    assert set(VERIFIED_BY) == usp.VERIFIED_MODELS
    assert {c[0] for c in CASES} | {"flux"} >= set(VERIFIED_BY.values())
    unclassified = names - usp.VERIFIED_MODELS - set(usp.REFUSED_MODELS) - UNVERIFIED
    assert not unclassified, f"diffusers model classes with a _cp_plan that are neither verified nor refused: " \
        f"{sorted(unclassified)}"
    for cls in classes:
        if cls.__name__ in usp.VERIFIED_MODELS:
            continue
        model = cls.__new__(cls)              # refused from the class alone: no weights built
        torch.nn.Module.__init__(model)
        with pytest.raises(ValueError, match=f"{cls.__name__} declares a context-parallel plan .*not verified"
                           if cls.__name__ in UNVERIFIED else f"{cls.__name__} is not supported: its context"):
            usp.parallelize(model)
        if cls.__name__ in usp.REFUSED_MODELS:
            with pytest.raises(ValueError, match=f"{cls.__name__} is not supported"):
                usp.parallelize(model, allow_unverified=True)


def test_an_unverified_class_with_a_plan_is_refused_unless_allowed():
    """A class of another name (a subclass here) is not taken as verified because its plan is
    inherited from a verified one: it is refused, naming allow_unverified."""
    import torch
    from diffusers import MiniMaxH3Transformer3DModel

    from usp_hal.integrations import diffusers as usp
    cls = type("CustomH3Transformer", (MiniMaxH3Transformer3DModel,), {})
    model = cls.__new__(cls)
    torch.nn.Module.__init__(model)
    with pytest.raises(ValueError, match="CustomH3Transformer declares a context-parallel plan .*not verified.*"
                       "allow_unverified=True"):
        usp.parallelize(model)


def test_a_plan_that_gathers_and_splits_again_is_refused_naming_the_module():
    """Helios' plan shape: split before and gather after each attention module; the parts in
    between would run whole on every rank (parameter gradients counted once per rank)."""
    import torch
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    from usp_hal.integrations import diffusers as usp

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn1 = torch.nn.Linear(2, 2)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([Block(), Block()])
    plan = {"blocks.*.attn1": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
            **{f"blocks.{i}.attn1": ContextParallelOutput(gather_dim=1, expected_dims=3) for i in range(2)}}
    with pytest.raises(ValueError, match="gathers the sequence at module 'blocks.0.attn1' and splits it again"):
        usp.parallelize(model, plan=plan)


@pytest.mark.multirank
def test_joint_masks_that_are_not_key_padding_are_refused_on_every_rank(pools):
    res = pools(2).run(cases.mask_refusals, timeout=120, U=1, R=2)
    for r in res:
        for what in ("bias", "per_head"):
            assert "that is not key padding" in (r[what] or ""), (what, r)
        assert "only key masks [B, H or 1, 1, S_keys]" in (r["per_query"] or ""), r
        assert "an attention mask on some ranks and none on others" in (r["one_rank"] or ""), r
    assert res[0]["padding_diff"] <= TOL and res[0]["padding_effect"] > 100 * TOL, res[0]


@pytest.mark.multirank
@pytest.mark.parametrize("name, U, R", [("ltx", 1, 2), ("qwen", 2, 1), ("flux", 1, 2), ("wan", 2, 1)])
def test_pipeline_with_default_arguments_matches_single_process(pools, name, U, R):
    """LTXPipeline, QwenImagePipeline (prompts of different lengths: text padding masks, and
    the classifier-free guidance both run by default), FluxPipeline and WanPipeline, two
    denoising steps, with usp-hal on the transformer: the same latents as one process."""
    r = pools(2).run(cases.pipeline_case, timeout=240, name=name, U=U, R=R)[0]
    assert r["diff"] <= TOL * max(1.0, r["scale"]), r
    if name in ("ltx", "qwen"):
        assert r["mask_effect"] > 1000 * TOL, r


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["qwen", "ltx"])
def test_a_text_shorter_than_the_group_is_refused_on_every_rank(pools, name):
    """A one-token prompt on two ranks left one rank without a text token (on 5edbecd: a crash
    there, a hang on the other); each rank refuses it alike, naming the shortest that fits."""
    res = pools(2).run(cases.short_text_case, timeout=60, name=name, text_len=1)
    assert all(r and "of 1 tokens leaves a rank" in r and "at least 2 tokens" in r for r in res), res
    assert pools(2).run(cases.short_text_case, timeout=60, name=name, text_len=2) == [None, None]
