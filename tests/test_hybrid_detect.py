"""Every causal-LM model type of the pinned transformers, built from its config on the meta
device (no memory, no forward): each is either clean (attention is its only mixing of
positions) or refused by name; the types known to mix positions outside attention are
refused by the layer (module path and class), not only by the model's declaration; and
dropping a detection rule makes this test fail."""
from __future__ import annotations

import warnings

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from usp_hal.integrations.hybrid import find_sequence_mixers, model_problem, model_type  # noqa: E402

# model types of transformers 5.23.0's causal-LM mapping with a layer that mixes positions
# outside attention (a recurrence, a convolution over the sequence, a token shift), from
# their modeling sources; the vision/audio towers of multimodal models are listed apart
KNOWN_MIXERS = {
    "bailing_hybrid", "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "inkling2_text", "inkling_text",
    "jamba", "kimi_linear", "lfm2", "lfm2_moe", "lfm3", "mamba", "mamba2", "minimax", "nemotron_h",
    "olmo_hybrid", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "recurrent_gemma",
    "rwkv", "xlstm", "zamba", "zamba2", "zaya",
}
# multimodal causal LMs whose image/audio encoder convolves (patch embeddings, pooling)
KNOWN_TOWERS = {"gemma3", "git", "got_ocr2", "moss_transcribe_diarize", "phi4_multimodal"}

# configs whose defaults do not build, or build without the hybrid layer
OVERRIDES = {
    "lfm2": dict(num_hidden_layers=2, full_attn_idxs=[1]),
    "lfm2_moe": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"]),
}
# default configs transformers 5.23.0 cannot build (missing fields, optional packages)
UNBUILDABLE = {"cohere_compass_text", "dbrx", "dots1", "gemma3n", "gemma4_assistant", "gemma4_unified_assistant",
               "hunyuan_v1_dense", "hunyuan_v1_moe", "ministral", "musicgen", "musicgen_melody", "nemotron",
               "qwen4_exp", "qwen4_exp_text", "reformer"}


def _build(model_type):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    cfg = CONFIG_MAPPING[model_type](**OVERRIDES.get(model_type, {}))
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(cfg)


@pytest.fixture(scope="module")
def walked():
    """model type -> its findings (None when its config does not build)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging
    logging.set_verbosity_error()
    out = {}
    for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            model = _build(mt)
        except Exception:        # a config that does not build: checked against UNBUILDABLE below
            out[mt] = None
            continue
        out[mt] = (model, find_sequence_mixers(model))
    return out


def _layer_level(findings):
    return [f for f in findings if f.rule != "declared"]


def test_version_pinned():
    assert transformers.__version__ == "5.23.0", "KNOWN_MIXERS was read from transformers 5.23.0's sources"


def test_every_causal_lm_type_is_clean_or_refused_by_name(walked):
    assert len(walked) > 150
    assert {mt for mt, r in walked.items() if r is None} == UNBUILDABLE
    for mt in KNOWN_MIXERS | KNOWN_TOWERS:
        model, findings = walked[mt]
        layers = _layer_level(findings)
        assert layers, f"{mt}: no layer that mixes positions was found"
        why = model_problem(model, findings)
        assert why and repr(model_type(model)) in why and layers[0].path in why and layers[0].cls in why, why
    # the models the integration is tested with stay clean (no over-refusal of plain attention)
    for mt in ("llama", "mistral", "qwen2", "qwen3", "gpt_oss", "gemma2", "gemma3_text", "deepseek_v3"):
        assert walked[mt][1] == [], (mt, walked[mt][1])
    # every verdict is clean or a refusal that names the model type
    for r in walked.values():
        if r is not None and r[1]:
            assert repr(model_type(r[0])) in model_problem(r[0], r[1])


@pytest.mark.parametrize("rule", ["class", "conv"])
def test_dropping_a_rule_misses_a_known_mixer(walked, rule):
    """The walk above fails when a detection rule is taken away: some known type then has no
    layer-level finding (minimax's lightning attention is seen by its class only; zaya's
    convolution inside the attention projection, by its structure only)."""
    missed = [mt for mt in sorted(KNOWN_MIXERS | KNOWN_TOWERS)
              if not _layer_level(find_sequence_mixers(walked[mt][0], skip_rules=(rule,)))]
    assert missed, rule


def test_token_shift_and_recurrent_parameters_are_seen_without_class_names():
    """A layer with an unknown class name is still seen by its structure."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.shift = torch.nn.ZeroPad2d((0, 0, 1, -1))
            self.A_log = torch.nn.Parameter(torch.zeros(2))
            self.pointwise = torch.nn.Conv1d(4, 4, kernel_size=1)     # pointwise: not a mixer

    found = find_sequence_mixers(Block())
    assert sorted(f.rule for f in found) == ["pad", "param"], found
    assert find_sequence_mixers(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Conv1d(2, 2, 1))) == []
