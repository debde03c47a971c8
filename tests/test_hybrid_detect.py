"""Every model type of the pinned transformers (``CONFIG_MAPPING``), walked once: each is
either clean (attention is its only mixing of positions), refused by name, or a model that
``shard_batch`` cannot feed; the types known to mix positions outside attention are refused
by the layer (module path and class), not only by the model's declaration; and dropping a
detection rule makes this test fail.

What a user can run sequence-parallel is decided by what ``shard_batch`` shards: token
inputs (``input_ids``, ``inputs_embeds``, ``token_type_ids``); any other tensor of the batch
(``pixel_values``, ``input_values``, ``input_features``, ``decoder_input_ids``, ...) is
refused, and a batch without ``input_ids``/``inputs_embeds`` is refused.  So each model type
falls in one of these classes, and the walk checks each:

* **token models** (the class's ``forward`` takes ``input_ids`` or ``inputs_embeds``: causal
  LMs, encoders, multimodal LMs run on text): built from the default config on the meta
  device (no memory, no forward) and classified: clean, or ``model_problem`` names the
  model type and, for the types known to mix positions, the offending layer;
* **models that take no tokens** (vision, audio, time-series, ... models): built only for a
  listed sample of known position mixers (``KNOWN_NO_TOKENS``, also refused by name); every
  one is checked to be refused at ``shard_batch`` (its main input is a tensor shard_batch
  refuses, and its ``forward`` takes no token input that shard_batch could give it);
* **sub-model types** (a config type with no model class of its own in the auto mappings,
  e.g. ``siglip_text_model``): built inside their parent, whose verdict covers them; the
  ones whose parent is not built (no tokens, or unbuildable) are listed;
* **unbuildable** types (their default config does not build here): listed exactly.
"""
from __future__ import annotations

import gc
import inspect
import warnings

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from usp_hal.integrations.sequence_mixers import find_sequence_mixers, model_problem, model_type  # noqa: E402

pytestmark = pytest.mark.models

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

# the other token models (base-model and head mappings) whose text path mixes positions
# outside attention, from their modeling sources (transformers 5.23.0):
KNOWN_TOKEN_MIXERS = {
    "canine",                   # CanineModel: chars_to_molecules / projection Conv1d over characters
    "convbert",                 # ConvBertSelfAttention: key_conv_attn_layer, a depthwise Conv1d (kernel 9)
    "fastspeech2_conformer", "fastspeech2_conformer_with_hifigan",   # conformer conv modules, conv FFN
    "glm5_next", "glm5_next_text",          # Glm5NextTextLinearAttention (+ its Conv1d, forget gate)
    "inkling2", "inkling_mm_model",         # *ShortConvolution on k/v in the attention layer
    "jev",                      # Qwen3_5GatedDeltaNet layers
    "lfm2_vl", "lfm3_vl",       # Lfm2ShortConv / Lfm3ShortConv layers
    "minicpm_ocr", "minicpmv4_6", "minicpmv4_7",   # Qwen3_5GatedDeltaNet language model
    "mobilebert",               # MobileBertEmbeddings: trigram_input token shift (nn.functional.pad)
    "nemo_speechlm", "nemotron_h_omni",     # NemotronHMamba2Mixer language model
    "nystromformer",            # NystromformerSelfAttention: depthwise Conv2d over the values (kernel 65)
    "sam3_lite_text_text_model",            # Sam3LiteTextRepMixer, a Conv2d token mixer
    "vits",                     # VitsTextEncoder: Conv1d feed-forward (kernel 3)
}
# token models whose image/audio/codec tower convolves (patch embeddings, conv subsamplers,
# pooling, detection backbones): refused as a whole, though their text path would be exact
KNOWN_TOKEN_TOWERS = {
    "aimv2", "align", "altclip", "aria", "audioflamingo3", "blip", "blip-2", "bridgetower", "chinese_clip", "clap",
    "clip", "clipseg", "cohere2_vision", "colmodernvbert", "colpali", "colqwen2", "cosmos3_omni", "csm", "d_fine",
    "deepseek_vl", "deepseek_vl_hybrid", "deimv2", "exaone4_5", "flava", "florence2", "fun_asr_nano", "glm46v",
    "glm4v", "glm4v_moe", "glm_image", "glm_ocr", "glmasr", "glmga", "granite_docling", "granite_speech",
    "granite_speech_plus", "grounding-dino", "groupvit", "hyperclovax_vision_v2", "idefics", "idefics2",
    "idefics3", "instructblip", "instructblipvideo", "internvl", "janus", "kimi_k25", "kosmos-2", "layoutlmv3",
    "lighton_ocr", "llava", "llava_next", "llava_next_video", "llava_onevision", "metaclip_2", "minimax_m3_vl",
    "mistral3", "mistral_large4", "mm-grounding-dino", "modernvbert", "muse_spark", "musicflamingo",
    "nemotron3_5_transcribe_word_timestamp", "nemotron3_diarization", "ovis2", "owlv2", "owlvit", "paddleocr_vl",
    "paligemma", "pe_audio", "pi0", "pp_chart2table", "pp_doclayout_v2", "pp_formulanet", "qianfan_ocr",
    "qwen2_5_omni_thinker", "qwen2_5_vl", "qwen2_audio", "qwen2_vl", "qwen3_asr", "qwen3_omni_moe_thinker",
    "qwen3_vl", "qwen3_vl_moe", "rt_detr", "rt_detr_v2", "sam3", "sam3_lite_text", "seamless_m4t",
    "seamless_m4t_v2", "shieldgemma2", "siglip", "smolvlm", "step3p7", "t5gemma2", "tipsv2", "tvp", "udop",
    "ultravbert", "unlimited_ocr", "vibevoice", "vibevoice_asr", "video_llama_3", "video_llava", "videoprism",
    "vilt", "vipllava", "vision-text-dual-encoder", "voxtral", "voxtral_realtime", "voxtral_realtime_encoder",
    "xclip",
}
# token models that mix positions in plain tensor code that no structural rule sees; their
# classes declare _supports_attention_backend = False, which refuses them
KNOWN_DECLARED = {
    "fnet",                     # FNetBasicFourierTransform: an FFT over the sequence, no attention
    "mra",                      # MraSelfAttention: block-sparse attention of its own (low-resolution pooling)
    "yoso",                     # YosoSelfAttention: LSH attention of its own (and an optional conv)
    "longformer", "led",        # sliding-window chunked attention of their own (padding to windows)
}
# models that take no tokens and whose layers mix positions, from their modeling sources;
# refused at shard_batch, and built to check that the rules see them too
KNOWN_NO_TOKENS = {
    "wav2vec2",                 # Wav2Vec2PositionalConvEmbedding (pos_conv_embed), conv feature encoder
    "hubert",                   # HubertPositionalConvEmbedding, conv feature encoder
    "wavlm", "data2vec-audio", "sew", "unispeech", "wav2vec2-conformer",   # the same pos_conv / conformer convs
    "parakeet_encoder",         # ParakeetEncoder: conv subsampling and conformer depthwise convs
    "speech_to_text",           # Conv1dSubsampler
    "vit",                      # ViTPatchEmbeddings: Conv2d patch embedding
    "siglip_vision_model",      # SiglipVisionEmbeddings: Conv2d patch embedding
}

# configs whose defaults do not build, or build without the hybrid layer
OVERRIDES = {
    "lfm2": dict(num_hidden_layers=2, full_attn_idxs=[1]),
    "lfm2_moe": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"]),
    "lfm2_vl": dict(text_config=dict(model_type="lfm2", num_hidden_layers=2, full_attn_idxs=[1])),
}
# causal-LM types whose default config transformers 5.23.0 cannot build (missing fields,
# optional packages)
UNBUILDABLE = {"cohere_compass_text", "dbrx", "dots1", "gemma3n", "gemma4_assistant", "gemma4_unified_assistant",
               "hunyuan_v1_dense", "hunyuan_v1_moe", "ministral", "musicgen", "musicgen_melody", "nemotron",
               "qwen4_exp", "qwen4_exp_text", "reformer"}
# the other model types that do not build here: their default config does not build, or
# their class needs a package that is not installed (timm, torchaudio, detectron2)
UNBUILDABLE_OTHER = {
    "aya_vision", "chameleon", "cohere_compass", "conditional_detr", "dab-detr", "deepseek_ocr2", "deformable_detr",
    "detr", "diffusion_gemma", "esm", "fast_vlm", "granite4_vision", "higgs_audio_v2_tokenizer", "hunyuan_vl",
    "hunyuan_vl_text", "layoutlmv2", "pe_audio_video", "pe_video", "perception_lm", "t5gemma2_encoder",
    "table-transformer", "voxtral_realtime_text",
}
# config types of parts that are built only inside a parent (no model class of their own in
# the auto mappings) and that the walk does not meet inside a built model: their parent takes
# no tokens or does not build, or keeps the part under a config of another type, or the part
# is absent from the parent's default config (a parent that is built carries its verdict)
NOT_REACHED = {
    "EvollaModel", "canary_decoder", "chameleon_vqgan", "deepseek_ocr2_encoder", "deepseek_ocr2_sam_vision_model",
    "deepseek_ocr2_text", "deepseek_ocr2_vision", "diffusion_gemma_text", "dots3_note_audio_encoder",
    "dots3_note_vision_encoder", "edgetam_mask_decoder", "edgetam_prompt_encoder", "edgetam_video_mask_decoder",
    "edgetam_video_prompt_encoder", "emu3_vqgan", "esmfold2", "flava_image_codebook", "gemma4_unified_audio",
    "gemma4_unified_vision", "granite4_vision_text", "idefics_perciever", "layoutxlm", "llama4_vision_model",
    "mllama_vision_model", "moonshine_streaming_encoder", "moshi_depth", "musicgen_decoder",
    "musicgen_melody_decoder", "nougat", "pix2struct_text_model", "pix2struct_vision_model", "qwen2_5_omni_bigvgan",
    "qwen2_5_omni_dit", "qwen2_5_omni_talker", "qwen2_5_omni_token2wav", "qwen3_omni_moe_talker_code_predictor",
    "qwen3_omni_moe_talker_text", "rag", "sam2_mask_decoder", "sam2_prompt_encoder", "sam2_video_mask_decoder",
    "sam2_video_prompt_encoder", "sam3_tracker_mask_decoder", "sam3_tracker_prompt_encoder",
    "sam3_tracker_video_mask_decoder", "sam3_tracker_video_prompt_encoder", "sam_hq_mask_decoder",
    "sam_hq_prompt_encoder", "sam_mask_decoder", "sam_prompt_encoder", "sapiens2_head", "slanext_vision",
    "speecht5_hifigan",
}

_TOKENS = ("input_ids", "inputs_embeds")


def _head_classes():
    """model type -> the class name of its base model, else of its first head mapping."""
    from transformers.models.auto import modeling_auto as ma
    out = {}
    names = ["MODEL_MAPPING_NAMES"] + sorted(n for n in dir(ma) if n.startswith("MODEL_FOR_")
                                              and n.endswith("_MAPPING_NAMES"))
    for name in names:
        for mt, cls in getattr(ma, name).items():
            out.setdefault(mt, cls if isinstance(cls, str) else cls[0])
    return out


def _build(model_type, cls=None):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    from transformers import initialization as init
    cfg = CONFIG_MAPPING[model_type](**OVERRIDES.get(model_type, {}))
    with torch.device("meta"), warnings.catch_warnings(), init.no_init_weights():
        warnings.simplefilter("ignore")
        if cls is None:
            return AutoModelForCausalLM.from_config(cfg)
        return cls._from_config(cfg)


def _sub_types(model):
    return {getattr(m.__dict__.get("config"), "model_type", None) for m in model.modules()} - {None}


@pytest.fixture(scope="module")
def walked_all():
    """Every config type: ``kind`` ("tokens", "no_tokens", "sub", "unbuildable"), the class,
    and for built models the model and its findings."""
    from transformers.utils import logging
    logging.set_verbosity_error()
    heads = _head_classes()
    out = {}
    # the walk keeps a few hundred models (meta tensors, ~10^5 modules): with the cyclic
    # collector on, its passes over them cost more than the builds; they are freed at teardown
    gc.disable()
    try:
        _walk(out, heads)
    finally:
        gc.freeze()
        gc.enable()
    yield out
    out.clear()
    gc.unfreeze()


def _walk(out, heads):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    for mt in sorted(CONFIG_MAPPING_NAMES):
        causal = mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if not causal and mt not in heads:
            out[mt] = dict(kind="sub")
            continue
        try:
            cls = None if causal else getattr(transformers, heads[mt])
            params = () if cls is None else inspect.signature(cls.forward).parameters
        except Exception:           # an optional package the class needs is missing
            out[mt] = dict(kind="unbuildable")
            continue
        if cls is not None and not any(t in params for t in _TOKENS):
            out[mt] = dict(kind="no_tokens", cls=cls)
            if mt not in KNOWN_NO_TOKENS:
                continue
        try:
            model = _build(mt, cls)
        except Exception:           # a config that does not build: checked against the UNBUILDABLE sets
            out[mt] = dict(kind="unbuildable", cls=cls)
            continue
        out[mt] = dict(kind=out.get(mt, {}).get("kind", "tokens"), cls=type(model), model=model,
                       findings=find_sequence_mixers(model), inside=_sub_types(model))


@pytest.fixture(scope="module")
def walked(walked_all):
    """causal-LM model type -> (model, findings) (None when its config does not build)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return {mt: (walked_all[mt]["model"], walked_all[mt]["findings"]) if "model" in walked_all[mt] else None
            for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}


def _layer_level(findings):
    return [f for f in findings if f.rule != "declared"]


def _refused_by_layer(mt, model, findings):
    layers = _layer_level(findings)
    assert layers, f"{mt}: no layer that mixes positions was found"
    why = model_problem(model, findings)
    assert why and repr(model_type(model)) in why and layers[0].path in why and layers[0].cls in why, why


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


def test_every_model_type_is_classified(walked_all):
    """Every config type falls in exactly one class; the token models are each clean or
    refused by name, the known mixers by their layer."""
    # transformers' own types: a package that registers its configs on import (fla does, when a
    # modeling module imports its kernels during the walk) adds types that are not transformers'
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    assert set(walked_all) == set(CONFIG_MAPPING_NAMES) and len(walked_all) > 700
    kinds = {k: {mt for mt, r in walked_all.items() if r["kind"] == k}
             for k in ("tokens", "no_tokens", "sub", "unbuildable")}
    assert kinds["unbuildable"] == UNBUILDABLE | UNBUILDABLE_OTHER, kinds["unbuildable"] ^ (
        UNBUILDABLE | UNBUILDABLE_OTHER)
    tokens = {mt: walked_all[mt] for mt in kinds["tokens"]}
    assert len(tokens) > 300
    for mt in KNOWN_TOKEN_MIXERS | KNOWN_TOKEN_TOWERS | KNOWN_MIXERS | KNOWN_TOWERS:
        assert mt in tokens, mt
        _refused_by_layer(mt, tokens[mt]["model"], tokens[mt]["findings"])
    for mt in KNOWN_DECLARED:
        assert {f.rule for f in tokens[mt]["findings"]} - {"encoder_decoder"} == {"declared"}, \
            (mt, tokens[mt]["findings"])
        assert repr(mt) in model_problem(tokens[mt]["model"], tokens[mt]["findings"])
    # every token model: clean, or a refusal that names its model type
    clean = set()
    for mt, r in tokens.items():
        if r["findings"]:
            assert repr(model_type(r["model"])) in model_problem(r["model"], r["findings"]), mt
        else:
            clean.add(mt)
    # attention-only encoders and the tested decoders stay clean (no over-refusal)
    assert {"bert", "roberta", "modernbert", "distilbert", "llama", "qwen3"} <= clean
    for mt in KNOWN_NO_TOKENS:
        assert walked_all[mt]["kind"] == "no_tokens", mt
        _refused_by_layer(mt, walked_all[mt]["model"], walked_all[mt]["findings"])


def test_models_without_tokens_are_refused_at_shard_batch(walked_all):
    """A model whose forward takes neither input_ids nor inputs_embeds gets nothing it can
    use from shard_batch: its main input is a tensor shard_batch refuses, on its own or
    next to input_ids."""
    import usp_hal
    from usp_hal.integrations.transformers import shard_batch
    mesh = usp_hal.init_sequence_parallel(1, 1, set_default=False)
    no_tokens = {mt: r["cls"] for mt, r in walked_all.items() if r["kind"] == "no_tokens"}
    assert len(no_tokens) > 200
    primary = {}            # the first input of each forward: pixel_values, input_values, input_features, ...
    for mt, cls in no_tokens.items():
        first = next(n for n in inspect.signature(cls.forward).parameters if n != "self")
        primary.setdefault(first, mt)
    shard_batch_keys = {"input_ids", "inputs_embeds", "token_type_ids", "position_ids", "labels", "shift_labels",
                        "attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert not set(primary) & shard_batch_keys, primary
    assert {"pixel_values", "input_values", "input_features", "past_values"} <= set(primary), sorted(primary)
    ids = torch.zeros(1, 4, dtype=torch.long)
    for name in primary:      # (the SAM video models' inference_session is an object: they take no tokens either)
        x = torch.zeros(1, 4, 3)
        with pytest.raises(ValueError, match="neither input_ids nor inputs_embeds"):
            shard_batch({name: x}, mesh)
        with pytest.raises(ValueError, match=f"don't know how to shard the tensor '{name}'"):
            shard_batch({"input_ids": ids, name: x}, mesh)


def test_sub_model_types_are_walked_inside_their_parent(walked_all):
    """A config type with no model class of its own is built inside its parent (the
    parent's verdict covers it), unless its parent takes no tokens or does not build."""
    inside = set().union(*(r["inside"] for r in walked_all.values() if "inside" in r))
    subs = {mt for mt, r in walked_all.items() if r["kind"] == "sub"}
    assert len(subs) > 100
    unreached = subs - inside
    assert unreached == NOT_REACHED, sorted(unreached ^ NOT_REACHED)


@pytest.mark.parametrize("rule", ["class", "conv"])
def test_dropping_a_rule_misses_a_known_mixer(walked, rule):
    """The walk above fails when a detection rule is taken away: some known type then has no
    layer-level finding (minimax's lightning attention is seen by its class only; zaya's
    convolution inside the attention projection, by its structure only)."""
    missed = [mt for mt in sorted(KNOWN_MIXERS | KNOWN_TOWERS)
              if not _layer_level(find_sequence_mixers(walked[mt][0], skip_rules=(rule,)))]
    assert missed, rule


@pytest.mark.parametrize("rule", ["class", "conv", "shift", "declared"])
def test_dropping_a_rule_fails_the_whole_walk(walked_all, rule):
    """The walk's assertions fail when a rule is taken away (the findings without it are the
    walk's findings less that rule's, as ``skip_rules`` gives them): without the class rule
    minimax's lightning attention is missed, without the conv rule the patch embeddings and
    zaya's convolution, without the shift rule mobilebert, and without the declaration
    fnet's Fourier transform."""
    def without(mt):
        return [f for f in walked_all[mt]["findings"] if f.rule != rule]

    if rule == "declared":
        missed = [mt for mt in sorted(KNOWN_DECLARED) if not without(mt)]
    else:
        known = KNOWN_MIXERS | KNOWN_TOWERS | KNOWN_TOKEN_MIXERS | KNOWN_TOKEN_TOWERS | KNOWN_NO_TOKENS
        missed = [mt for mt in sorted(known) if not _layer_level(without(mt))]
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



def test_encoder_decoder_models_are_refused_by_name(walked_all):
    """A seq2seq model makes its decoder inputs by shifting the whole sequence (e.g. BartModel's
    shift_tokens_right) and cross-attends to the whole encoder output: every walked token model
    whose config is an encoder-decoder is refused by that rule, including the ones no other
    rule refuses; and dropping the rule leaves those clean."""
    encdec = {mt: r for mt, r in walked_all.items() if r["kind"] == "tokens"
              and getattr(getattr(r["model"], "config", None), "is_encoder_decoder", False) is True}
    assert len(encdec) > 20 and "t5" in encdec, sorted(encdec)
    only = []
    for mt, r in encdec.items():
        rules = {f.rule for f in r["findings"]}
        assert "encoder_decoder" in rules, mt
        assert repr(model_type(r["model"])) in model_problem(r["model"], r["findings"]), mt
        if rules == {"encoder_decoder"}:
            only.append(mt)
    assert only, "no encoder-decoder type relies on the rule alone"
    for mt in only:
        assert find_sequence_mixers(encdec[mt]["model"], skip_rules=("encoder_decoder",)) == [], mt
