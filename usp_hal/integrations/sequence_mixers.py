"""Layers that mix positions outside attention, under ``attn_implementation="usp_hal"``.

Covered (run sequence-parallel, tested against one process): the gated DeltaNet layers of
``qwen3_next``, the short convolutions of ``lfm2``, the Mamba2 mixers of ``nemotron_h`` and the
KDA layers of ``kimi_linear``: their projections stay on the sequence shards and only their
per-head operators (the causal convolution, the chunked gated delta rule or KDA, the SSD scan)
run through :func:`usp_hal.head_parallel`, the convolutions through their halo exchange, and
the GDN, KDA and SSD recurrences through :mod:`usp_hal.mixers.state_passing` when ``recurrence`` says so
(see :func:`wire` and :data:`RECURRENCES`).  Every other such layer is refused.

Sequence parallelism shards the sequence for the attention layers; any other layer that
mixes positions (a recurrence, a convolution over the sequence, a token shift) would then
see only its rank's tokens and compute something else than the model: the model would
train, with wrong gradients.  This module finds such layers and refuses the model by name
(model type, module path, class, what gave it away), on every rank, before its first
sequence-parallel forward.

How a model is checked (:func:`find_sequence_mixers`), on the built model's modules:

* **the model's own declaration**: a ``PreTrainedModel`` (the model or any sub-model) whose
  class says ``_supports_attention_backend = False``: transformers does not declare that its
  layers go through ``AttentionInterface`` alone (its attention may be its own code, or it
  has layers that are not attention: most hybrids of transformers 5.23.0 say so, not
  ``lfm2``, ``lfm3``, ``minimax``, ``granitemoehybrid``, ``recurrent_gemma`` or ``zaya``,
  which the rules below find);
* **known sequence-mixing classes**, by class name: Mamba, Mamba2/SSD mixers, gated DeltaNet,
  KDA, short convolutions, lightning and other linear attention, RWKV, xLSTM, RG-LRU, ...;
* **structure**: ``nn.Conv1d/2d/3d`` (and transposed) with a kernel wider than one position,
  recurrent ``nn.RNNBase`` layers (LSTM, GRU), pooling layers, padding layers (a token shift
  is a pad by one position), and parameters with the names state-space and recurrent layers
  give their decay and step parameters (``A_log``, ``dt_bias``, ``time_decay``, ...);
* **sequence kernels held as attributes**: a function whose name says it scans or convolves
  over the sequence (``causal_conv1d_fn``, ``chunk_gated_delta_rule``, ``selective_scan``...).

Limits: a layer whose ``forward`` mixes positions with plain tensor code (a ``cumsum`` or a
``roll`` over the sequence) and none of the marks above is not seen.  Every model type of
the pinned transformers is walked by the tests (``tests/test_hybrid_detect.py``) with a
list of the types known to mix positions outside attention; a rule that stops seeing one
of them fails that test.

Its error is :class:`SequenceMixerError`.  The check runs from a forward pre-hook that
:func:`usp_hal.integrations.transformers.enable` adds to every model built afterwards; a
sequence-parallel attention call on a model whose layers were not checked is refused
(:func:`layers_checked`).
"""
from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn

__all__ = ["Finding", "find_sequence_mixers", "model_problem", "SequenceMixerError", "RECURRENCES", "wire"]


class SequenceMixerError(NotImplementedError):
    """The model has layers that mix positions outside attention and are not sequence-parallel."""


@dataclass(frozen=True)
class Finding:
    """One layer that mixes positions outside attention: where it is and what gave it away."""

    path: str           # module path in the model ("" for the model itself)
    cls: str            # the module's class name
    why: str            # which rule saw it
    rule: str           # "declared", "class", "conv", "rnn", "pool", "pad", "param", "kernel"

    def __str__(self) -> str:
        return f"{self.path or '<model>'} ({self.cls}): {self.why}"


# class names of layers known to mix positions outside attention (transformers 5.23.0:
# mamba, mamba2, falcon_mamba, jamba, bamba, zamba, zamba2, nemotron_h, granitemoehybrid,
# falcon_h1 -> *Mamba*Mixer / *Mamba*Layer; qwen3_next, qwen3_5, olmo_hybrid -> *GatedDeltaNet;
# kimi_linear -> KimiDeltaAttention; lfm2 -> Lfm2ShortConv; minimax -> MiniMaxLightningAttention;
# rwkv -> RwkvSelfAttention/RwkvFeedForward (token shift); xlstm -> mLSTM/sLSTM blocks;
# recurrent_gemma -> RecurrentGemmaRglru/RecurrentBlock)
_CLASS_PATTERN = re.compile(
    r"Mamba|Mixer(?!tral)|DeltaNet|DeltaAttention|GatedDelta|ShortConv|Lightning|LinearAttention|LinearAttn|"
    r"Rwkv|RWKV|[mMsS]LSTM|xLSTM|Lstm|Rglru|RGLRU|RecurrentBlock|Recurrent(?!Gemma)|SSM|Ssm|Retention|Hyena|"
    r"TimeMix|ChannelMix|TokenShift|StateSpace")

# parameter names of recurrent / state-space layers (decays, step sizes, token-shift mixes)
_PARAM_NAMES = {"A_log", "dt_bias", "time_decay", "time_first", "time_faaaa", "time_maa_x", "recurrent_param",
                "time_mix_key", "time_mix_value", "time_mix_receptance"}

# functions held as module attributes that run over the sequence
_KERNEL_PATTERN = re.compile(r"conv1d|scan|delta_rule|recurrent|lightning|_kda|ssd|gla_|rwkv|retention",
                             re.IGNORECASE)

# pooling over positions; Conv1D of transformers.pytorch_utils is a Linear (not an nn.Conv1d)
_POOLS = (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd, nn.modules.pooling._AdaptiveAvgPoolNd,
          nn.modules.pooling._AdaptiveMaxPoolNd, nn.modules.pooling._LPPoolNd)
_PADS = (nn.modules.padding._ConstantPadNd, nn.modules.padding._ReflectionPadNd,
         nn.modules.padding._ReplicationPadNd, getattr(nn.modules.padding, "_CircularPadNd", nn.modules.padding
                                                       ._ConstantPadNd))


def _declared(module) -> Optional[str]:
    try:
        from transformers import PreTrainedModel
    except ImportError:          # pragma: no cover - the integration needs transformers anyway
        return None
    if isinstance(module, PreTrainedModel) and not getattr(type(module), "_supports_attention_backend", False):
        return (f"{type(module).__name__}._supports_attention_backend is False (transformers does not declare that "
                "this model's layers go through AttentionInterface alone)")
    return None


def _module_findings(path: str, module: nn.Module) -> List[Finding]:
    cls = type(module).__name__
    out: List[Finding] = []
    why = _declared(module) if hasattr(type(module), "_supports_attention_backend") else None
    if why:
        out.append(Finding(path, cls, why, "declared"))
    if _CLASS_PATTERN.search(cls):
        out.append(Finding(path, cls, "a recurrent, state-space, linear-attention or short-convolution layer "
                                      "(by its class)", "class"))
    if isinstance(module, nn.modules.conv._ConvNd):
        ks = tuple(module.kernel_size)
        if any(k > 1 for k in ks):
            out.append(Finding(path, cls, f"a convolution over positions (kernel {ks})", "conv"))
    elif isinstance(module, nn.RNNBase):
        out.append(Finding(path, cls, "a recurrent layer", "rnn"))
    elif isinstance(module, _POOLS):
        out.append(Finding(path, cls, "pooling over positions", "pool"))
    elif isinstance(module, _PADS):
        out.append(Finding(path, cls, "padding (a shift of positions)", "pad"))
    # a token shift written as tensor code, switched on by an attribute: MobileBertEmbeddings
    # (transformers models/mobilebert/modeling_mobilebert.py) joins each token's embedding with
    # its neighbours' (nn.functional.pad of inputs_embeds[:, 1:] and [:, :-1]) when trigram_input
    if getattr(module, "trigram_input", None) is True:
        out.append(Finding(path, cls, "a token shift (trigram_input: each token's embedding is joined with its "
                                      "neighbours')", "shift"))
    names = sorted(n for n in (*module._parameters, *module._buffers) if n in _PARAM_NAMES)
    if names:
        out.append(Finding(path, cls, f"recurrent / state-space parameters {names}", "param"))
    for name, value in vars(module).items():
        if name.startswith("_") or not callable(value) or isinstance(value, (nn.Module, torch.Tensor, type)):
            continue
        fname = getattr(value, "__name__", "") or type(value).__name__
        if _KERNEL_PATTERN.search(fname) or _KERNEL_PATTERN.search(name):
            out.append(Finding(path, cls, f"a sequence kernel held as {name!r} ({fname})", "kernel"))
    return out


def find_sequence_mixers(model: nn.Module, *, skip_rules=()) -> List[Finding]:
    """Every layer of ``model`` that mixes positions outside attention (see the module doc).
    Layers wired for sequence parallelism (marked by :func:`mark_covered`) are left out, with
    their children.  ``skip_rules``: rule names to leave out (for tests that show each rule
    is needed)."""
    out: List[Finding] = []
    covered: List[str] = []
    for path, module in model.named_modules():
        if any(path == c or path.startswith(c + ".") for c in covered):
            continue
        if getattr(module, _COVERED, False):
            covered.append(path)
            continue
        out.extend(f for f in _module_findings(path, module) if f.rule not in skip_rules)
    if getattr(type(model), _COVERED, False) or getattr(model, _COVERED_MODEL, False):
        out = [f for f in out if f.rule != "declared"]
    cfg = getattr(model, "config", None)
    if getattr(cfg, "is_encoder_decoder", False) is True and "encoder_decoder" not in skip_rules:
        # e.g. transformers' BartModel makes its decoder inputs by shifting input_ids
        # (shift_tokens_right), which on a shard shifts within the shard, and its
        # cross-attention reads the encoder's whole output
        out.append(Finding("", type(model).__name__, "an encoder-decoder model (its decoder inputs are shifted from "
                                                     "the whole sequence and its cross-attention reads the whole "
                                                     "encoder output)", "encoder_decoder"))
    return out


_COVERED = "_usp_hal_sequence_parallel"          # a layer wired through the head-parallel region
_COVERED_MODEL = "_usp_hal_hybrid_model"          # a model whose every mixer is wired (tested family)


def mark_covered(module: nn.Module) -> None:
    setattr(module, _COVERED, True)


def model_type(model) -> str:
    cfg = getattr(model, "config", None)
    return str(getattr(cfg, "model_type", None) or type(model).__name__)


def model_problem(model: nn.Module, findings: Optional[List[Finding]] = None, limit: int = 6) -> Optional[str]:
    """Why ``model`` cannot run sequence-parallel (None when it can): its model type and
    every uncovered layer that mixes positions (the first ``limit`` by path, and a count)."""
    found = find_sequence_mixers(model) if findings is None else findings
    if not found:
        return None
    found = sorted(found, key=lambda f: f.rule == "declared")      # the layers first, by path
    shown = "\n  ".join(str(f) for f in found[:limit])
    more = f"\n  ... and {len(found) - limit} more" if len(found) > limit else ""
    return (f"model type {model_type(model)!r} ({type(model).__name__}) has layers that mix positions outside "
            f"attention, which sequence parallelism would run on each rank's shard only (silently wrong "
            f"results):\n  {shown}{more}\nRun it without sequence parallelism (ulysses_degree=ring_degree=1), "
            "or use a model whose layers are covered (see docs/hybrid.md)")


# ----------------------------------------------------------------------------- the check before a forward
# on a checked model: (its last key, the keys checked); a key: (implementation, id of the mesh, recurrence)
_CHECKED = "_usp_hal_checked"
_HOOKED = "_usp_hal_hooked"


def install(lookup) -> List[str]:
    """Make every transformers model check itself before its first forward under one of our
    attention implementations.  ``lookup(name)`` gives the registered attention function of
    an implementation name (None for names that are not ours).  Patches (through
    :mod:`usp_hal.integrations.patching`, once; :func:`uninstall` and ``patching.restore_all``
    undo it) ``PreTrainedModel.post_init`` (models built from now on) and
    ``set_attn_implementation`` (models switched later) to add a forward pre-hook, and routes
    the per-head functions of the covered layers' modeling modules (:data:`COVERED_LAYERS`),
    which call the originals except while a wired layer runs; the hook costs one attribute
    lookup per forward once the model has been checked.  Called by
    :func:`usp_hal.integrations.transformers.enable`; returns the labels of the patches."""
    global _LOOKUP
    _LOOKUP = lookup
    import importlib

    from transformers import PreTrainedModel

    from .patching import patch
    done = [patch(PreTrainedModel, "post_init", _attaching),
            patch(PreTrainedModel, "set_attn_implementation", _attaching)]
    for modname, names in COVERED_LAYERS.values():
        try:
            importlib.import_module(modname)
        except ImportError:     # a transformers without this model type: none of its layers can be built
            continue
        done += _route(modname, names)
    return done


def uninstall() -> None:
    """Models stop looking up our attention functions (their hooks then do nothing); the
    patches themselves are put back by ``patching.restore_all``."""
    global _LOOKUP
    _LOOKUP = _no_lookup


def _attaching(original):
    import functools

    @functools.wraps(original)
    def patched(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        attach(self)
        return out
    return patched


def _route(modname: str, names) -> List[str]:
    """Route the functions ``names`` of the modeling module ``modname`` (once)."""
    import importlib

    from .patching import patch
    mod = importlib.import_module(modname)
    return [patch(mod, name, _ROUTES[name]) for name in names]


def _no_lookup(name):
    return None


_LOOKUP = _no_lookup


def attach(model: nn.Module) -> None:
    """Add the check to ``model`` (once)."""
    if not model.__dict__.get(_HOOKED):
        model.register_forward_pre_hook(_before_forward, with_kwargs=True)
        model.__dict__[_HOOKED] = True


def _implementation(model) -> Optional[str]:
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return impl if isinstance(impl, str) else None


# the modules of every model whose forward pre-hook ran: the attention function refuses a
# sequence-parallel call from any other module (its model's layers were never checked)
_HOOKED_MODULES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


@torch.compiler.disable
def _mark_hooked(model: nn.Module) -> None:
    """Record ``model``'s modules as checked, run eagerly: under ``torch.compile`` a traced
    update of the set would only be replayed after the frame, after the attention calls in it
    have looked the modules up."""
    _HOOKED_MODULES.update(model.modules())


def layers_checked(module: nn.Module) -> bool:
    """Whether ``module`` belongs to a model whose layers the forward pre-hook checks (the model
    was built, or switched to a registered name, after :func:`install`).  One set lookup."""
    return module in _HOOKED_MODULES


def _before_forward(model, args, kwargs):
    fn = _LOOKUP(_implementation(model))
    if fn is None:
        return None
    import usp_hal
    mesh = fn.mesh if fn.mesh is not None else usp_hal.get_default_mesh()
    recurrence = _RECURRENCE.get(_implementation(model), "auto")
    key = (_implementation(model), id(mesh), recurrence)
    last, checked = model.__dict__.get(_CHECKED, (None, frozenset()))
    if last != key:
        _mark_hooked(model)
        if mesh.sp_size > 1 or getattr(model, _COVERED_MODEL, False):
            # a model wired before is rewired on a one-rank mesh too: its layers must not keep
            # exchanging on the groups of the mesh they last ran on
            wire(model, mesh, fn.layout, recurrence)
        # the check is an agreement over the mesh's group: made at the first call on each mesh,
        # which every rank of the group makes together, whatever meshes a rank used in between
        # (per-batch degrees: a rank that ran a one-rank job since must not check again alone)
        if key not in checked:
            check_model(model, mesh, recurrence)
            checked = checked | {key} if len(checked) < 64 else frozenset({key})
        for sub in model.modules():           # sub-models (the base model inside a ForCausalLM) are checked too
            if _HOOKED in sub.__dict__:
                sub.__dict__[_CHECKED] = (key, checked)
    if mesh.sp_size > 1 and getattr(model, _COVERED_MODEL, False) and model.__dict__.get(_HOOKED):
        from usp_hal.parallel.comm import agree
        problem = call_problem(model, kwargs)
        agree(problem, mesh.metadata_group, what="usp_hal sequence parallelism (transformers)",
              where=mesh.where("sequence-parallel"), ranks=mesh.sp_ranks)
        return args, kwargs
    return None


def check_model(model: nn.Module, mesh, recurrence: str = "auto") -> None:
    """Refuse ``model`` on every rank of ``mesh``'s sequence-parallel group (one small
    all-gather on its CPU metadata group) when it has uncovered layers that mix positions, or
    covered layers that cannot run ``recurrence``; nothing to do on a group of one rank
    (nothing is sharded)."""
    if mesh.sp_size == 1:
        return
    from usp_hal.parallel.comm import agree
    problem = model_problem(model) or recurrence_problem(model, recurrence)
    agree(problem, mesh.metadata_group, what="usp_hal sequence parallelism (transformers)",
          where=mesh.where("sequence-parallel"), ranks=mesh.sp_ranks)


def generation_problem(model: nn.Module) -> Optional[str]:
    """Why ``generate()`` cannot run sequence-parallel on this model for its layers (None when
    it can): every layer that mixes positions outside attention, covered or not (their
    recurrent and convolution states are not carried by the sharded cache)."""
    if not find_sequence_mixers(model) and not _covered_layers(model):
        return None
    names = [f"{p} ({type(m).__name__})" for p, m in _covered_layers(model)][:4]
    return model_problem(model) or (
        f"generation for model type {model_type(model)!r}: its layers {names} carry a recurrent or convolution "
        "state that the sharded cache does not hold; generate without sequence parallelism")


def _covered_layers(model: nn.Module):
    return [(p, m) for p, m in model.named_modules() if getattr(m, _COVERED, False)]


# ----------------------------------------------------------------------------- covered layers
# A covered layer keeps its projections on the sequence shards; only its per-head sequence
# operators (transformers' causal_conv1d_fn and chunk gated delta rule, looked up as globals of
# the modeling module at call time) run through usp_hal.head_parallel while the layer runs.
_GDN_FUNCTIONS = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")
COVERED_LAYERS = {
    # class name -> (modeling module, the module globals its forward calls per head)
    "Qwen3NextGatedDeltaNet": ("transformers.models.qwen3_next.modeling_qwen3_next", _GDN_FUNCTIONS),
    "Qwen3_5GatedDeltaNet": ("transformers.models.qwen3_5.modeling_qwen3_5", _GDN_FUNCTIONS),
    "Qwen3_5MoeGatedDeltaNet": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", _GDN_FUNCTIONS),
    "Lfm2ShortConv": ("transformers.models.lfm2.modeling_lfm2", ("causal_conv1d_fn",)),
    "NemotronHMamba2Mixer": ("transformers.models.nemotron_h.modeling_nemotron_h",
                             ("mamba2_split_conv1d_scan_combined", "causal_conv1d_fn", "mamba2_chunk_scan")),
    "KimiLinearDeltaAttention": ("transformers.models.kimi_linear.modeling_kimi_linear",
                                 ("causal_conv1d_fn", "chunk_kimi_delta_attention")),
}
# attention layers whose class name reads like a sequence mixer's: they mix positions through
# AttentionInterface only (hence usp_hal's attention); wire() marks them covered, nothing more
ATTENTION_LAYERS = {"KimiLinearAttention"}      # kimi_linear's MLA
# model types whose every layer that mixes positions is covered, tested against one process
COVERED_MODEL_TYPES = {"qwen3_next", "lfm2", "nemotron_h", "kimi_linear"}
# covered layers whose recurrence can also run by state passing (usp_hal.mixers.state_passing; KDA is
# the gated delta rule with a decay per key channel: the same call, its own kernel)
STATE_PASSING_LAYERS = {"Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
                        "NemotronHMamba2Mixer", "KimiLinearDeltaAttention"}
# covered layers with no recurrence (a short convolution only: its halo is all that crosses ranks)
CONV_ONLY_LAYERS = {"Lfm2ShortConv"}
# model types tested with packed documents (shard_batch(..., cu_seqlens=...)) against one process
# that runs each document on its own; the others refuse packed input
PACKED_MODEL_TYPES = {"qwen3_next", "nemotron_h"}

#: how a covered layer's recurrence (gated delta rule, KDA, SSD scan) crosses the shards; the
#: default of :func:`usp_hal.integrations.transformers.register`'s ``recurrence=``:
#: "head_parallel" (all-to-all of every head's sequence: bytes grow with S),
#: "state_passing" (each rank keeps its tokens; one all-gather of every piece's state, bytes
#: independent of S; refused for a layer without it), or "auto": state passing when the ring
#: degree is above 1, the layout is not ``stripe`` (whose pieces are single tokens) and the
#: layer has it, else head-parallel
RECURRENCES = ("auto", "head_parallel", "state_passing")

_WIRED = "_usp_hal_wired"


def check_recurrence(recurrence) -> str:
    """``recurrence`` if it is one of :data:`RECURRENCES`, else ValueError naming them."""
    if recurrence not in RECURRENCES:
        raise ValueError(f"recurrence={recurrence!r}: expected one of {RECURRENCES}")
    return recurrence


_RECURRENCE: dict = {}       # attention implementation name -> its register(..., recurrence=)


def set_recurrence(name: str, recurrence: str) -> None:
    """The ``recurrence`` of the attention implementation ``name`` (checked)."""
    _RECURRENCE[name] = check_recurrence(recurrence)


def layer_recurrence(cls_name: str, recurrence: str, mesh, layout: str) -> str:
    """How the recurrence of a covered layer of class ``cls_name`` runs: "none" (no recurrence),
    "head_parallel" or "state_passing" (see :data:`RECURRENCES` for the rule of "auto")."""
    if cls_name in CONV_ONLY_LAYERS:
        return "none"
    if recurrence == "auto":
        use = mesh.ring_degree > 1 and layout != "stripe" and cls_name in STATE_PASSING_LAYERS
        return "state_passing" if use else "head_parallel"
    return check_recurrence(recurrence)


def recurrence_problem(model: nn.Module, recurrence: str) -> Optional[str]:
    """Why ``recurrence`` cannot run on ``model``'s covered layers (None when it can): forcing
    state passing on a layer that has no state-passing form."""
    if recurrence != "state_passing":
        return None
    bad = [f"{p} ({type(m).__name__})" for p, m in _covered_layers(model)      # attention layers have no recurrence
           if type(m).__name__ not in STATE_PASSING_LAYERS | CONV_ONLY_LAYERS | ATTENTION_LAYERS]
    if not bad:
        return None
    return (f"recurrence='state_passing' for model type {model_type(model)!r}: its layers {bad[:4]} have no "
            "state-passing form in usp_hal; use recurrence='auto' or 'head_parallel' (they run head-parallel)")


@dataclass(frozen=True)
class _Region:
    mesh: object
    layout: str
    recurrence: str                 # "none", "head_parallel" or "state_passing"
    cu: Optional[tuple] = None      # global document boundaries of this call (packed documents)


class _Active(threading.local):
    region: Optional[_Region] = None      # while a covered layer runs


_ACTIVE = _Active()


def _enter(module, args, kwargs):
    mesh, layout, recurrence = module.__dict__[_WIRED]
    if mesh.sp_size == 1:       # nothing is sharded: the layer runs as in one process
        _ACTIVE.region = None
        return
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        from usp_hal.sequence.positions import as_cu_seqlens
        cu = as_cu_seqlens(cu)
    _ACTIVE.region = _Region(mesh, layout, recurrence, cu)


def _leave(module, args, kwargs, output):
    _ACTIVE.region = None


def wire(model: nn.Module, mesh, layout: str, recurrence: str = "auto") -> List[str]:
    """Mark the covered layers of ``model`` and route their per-head operators through the
    head-parallel region, or their recurrences through state passing (``recurrence``, see
    :data:`RECURRENCES`), on ``mesh`` in ``layout`` (once per layer; the mesh, layout and
    recurrence are updated when they change).  Returns the paths wired."""
    check_recurrence(recurrence)
    if model_type(model) not in COVERED_MODEL_TYPES:
        return []
    done = []
    for path, module in model.named_modules():
        entry = COVERED_LAYERS.get(type(module).__name__)
        if type(module).__name__ in ATTENTION_LAYERS:
            mark_covered(module)
        if entry is None:
            continue
        modname, names = entry
        _route(modname, names)      # in place already when enable() ran (it routes every covered module)
        if _WIRED not in module.__dict__:
            module.register_forward_pre_hook(_enter, with_kwargs=True)
            module.register_forward_hook(_leave, with_kwargs=True, always_call=True)
        module.__dict__[_WIRED] = (mesh, layout, layer_recurrence(type(module).__name__, recurrence, mesh, layout))
        mark_covered(module)
        done.append(path)
    if done:
        setattr(model, _COVERED_MODEL, True)
    return done


#: how a covered layer's depthwise causal convolution crosses the shards: "halo" (each rank
#: receives the kernel_size - 1 tokens before each of its runs: a few tokens, whatever S, in
#: the basic and zigzag layouts), "head_parallel" (all-to-all of every channel's sequence), or
#: "auto" (halo unless the layout is stripe, whose runs are single tokens)
CONV_EXCHANGE = "auto"

_PACKING_KWARGS = ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _per_document(run, tensors, cu):
    """``run(*tensors)`` on each document's stretch of dim 1 (``cu``: boundaries in that
    sequence), concatenated; ``run(*tensors)`` when there are no documents."""
    if cu is None:
        return run(*tensors)
    return torch.cat([run(*(t[:, a:e] for t in tensors)) for a, e in zip(cu[:-1], cu[1:]) if e > a], dim=1)


def _conv_route(original):
    import functools

    @functools.wraps(original)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        region = _ACTIVE.region
        if region is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        from usp_hal.mixers.head_parallel import halo_causal_conv, head_parallel
        mesh, layout, cu = region.mesh, region.layout, region.cu
        mode = CONV_EXCHANGE if CONV_EXCHANGE != "auto" else ("head_parallel" if layout == "stripe" else "halo")
        if mode == "halo":
            from transformers.activations import ACT2FN
            x = hidden_states.transpose(1, 2).to(weight.dtype)          # [B, C, S_local] -> [B, S_local, C]
            out = halo_causal_conv(x, weight, bias, mesh=mesh, layout=layout, cu_seqlens=cu)
            if activation is not None:
                out = ACT2FN[activation](out)
            return out.transpose(1, 2).to(hidden_states.dtype)

        def per_channel(x, heads, cu_seqlens=None):    # x [B, S, c, 1]: this rank's channels, the whole sequence
            sl = slice(heads.start, heads.stop)

            def run(xs):
                out = original(xs.squeeze(-1).transpose(1, 2), weight[sl], None if bias is None else bias[sl],
                               activation=activation)
                return out.transpose(1, 2).unsqueeze(-1)
            return _per_document(run, [x], cu_seqlens)

        x = hidden_states.transpose(1, 2).unsqueeze(-1)            # [B, C, S_local] -> [B, S_local, C, 1]
        out = head_parallel(per_channel, x, mesh=mesh, layout=layout, with_heads=True, cu_seqlens=cu)
        return out.squeeze(-1).transpose(1, 2)
    return causal_conv1d_fn


def _gdn_route(original):
    """The gated delta rule (qwen3_next's ``torch_chunk_gated_delta_rule``) or KDA (kimi_linear's
    ``chunk_kimi_delta_attention``: the same signature, ``g`` per key channel)."""
    import functools
    import inspect

    sig = inspect.signature(original)
    own = ("query", "key", "value", "g", "beta", "initial_state", "output_final_state", "kwargs")

    @functools.wraps(original)
    def chunk_gated_delta_rule(*args, **kwargs):
        region = _ACTIVE.region
        if region is None:          # outside a wired layer: the original, however it is called
            return original(*args, **kwargs)
        from usp_hal.mixers.head_parallel import head_parallel
        bound = sig.bind(*args, **kwargs)
        got = bound.arguments
        extra = dict(got.get("kwargs", {}))
        cu = region.cu
        if cu is None and extra.get("cu_seqlens") is not None:
            from usp_hal.sequence.positions import as_cu_seqlens
            cu = as_cu_seqlens(extra["cu_seqlens"])
        if got.get("initial_state") is not None or got.get("output_final_state"):
            # the model-level check refuses caches first, on every rank
            raise NotImplementedError("usp_hal: a cached gated delta rule under sequence parallelism")
        rest = {name: value for name, value in got.items() if name not in own}
        rest.update({k: v for k, v in extra.items() if k not in _PACKING_KWARGS})
        mesh, layout = region.mesh, region.layout
        q, k, v, g, beta = (got[n] for n in ("query", "key", "value", "g", "beta"))
        if region.recurrence == "state_passing":
            from usp_hal.mixers.state_passing import gated_delta_rule

            def kernel(q, k, v, g, beta, initial_state=None, output_final_state=True):
                return original(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
                                **rest)
            return gated_delta_rule(q, k, v, g, beta, mesh=mesh, layout=layout, cu_seqlens=cu, kernel=kernel), None

        def per_head(q, k, v, gg, bb, cu_seqlens=None):
            return _per_document(lambda *xs: original(*xs[:3], g=xs[3], beta=xs[4], **rest)[0],
                                 [q, k, v, gg, bb], cu_seqlens)

        return head_parallel(per_head, q, k, v, g, beta, grouped=(0, 1), mesh=mesh, layout=layout,
                             cu_seqlens=cu), None
    return chunk_gated_delta_rule


def _fused_route(original):
    import functools

    @functools.wraps(original)
    def mamba2_split_conv1d_scan_combined(*args, **kwargs):
        if _ACTIVE.region is not None:
            return None        # the layer then runs its conv and scan apart, each through the region
        return original(*args, **kwargs)
    return mamba2_split_conv1d_scan_combined


def _ssd_route(original):
    import functools

    @functools.wraps(original)
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                          return_final_states=False, **kwargs):
        region = _ACTIVE.region
        if region is None:
            return original(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, initial_states=initial_states,
                            return_final_states=return_final_states, **kwargs)
        from usp_hal.mixers.head_parallel import head_parallel
        mesh, layout, cu = region.mesh, region.layout, region.cu
        if initial_states is not None or return_final_states:
            raise NotImplementedError("usp_hal: a cached Mamba2 scan under sequence parallelism")
        if kwargs.get("z") is not None:
            raise NotImplementedError("usp_hal: a Mamba2 scan gated by z inside the scan under sequence parallelism")
        kwargs = {k: v for k, v in kwargs.items() if k in ("dt_softplus", "dt_limit")}
        if region.recurrence == "state_passing":
            from usp_hal.mixers.state_passing import ssd

            def kernel(x, d_t, A, b, c, initial_state=None):     # states [B, H, N, P] here, [B, H, P, N] there
                init = None if initial_state is None else initial_state.transpose(-1, -2)
                y, final = original(x, d_t, A, b, c, chunk_size, D=None, dt_bias=dt_bias, initial_states=init,
                                    return_final_states=True, **kwargs)
                return y, final.transpose(-1, -2)
            y = ssd(hidden_states, dt, A, B, C, mesh=mesh, layout=layout, cu_seqlens=cu, kernel=kernel)
            return y if D is None else y + D[..., None] * hidden_states.float()     # the per-token skip, as there

        def per_head(x, d_t, b, c, heads, cu_seqlens=None):     # A, D and dt_bias are per head: this rank's slice
            sl = slice(heads.start, heads.stop)

            def run(x, d_t, b, c):
                return original(x, d_t, A[sl], b, c, chunk_size, D=None if D is None else D[sl],
                                dt_bias=None if dt_bias is None else dt_bias[sl], **kwargs)
            return _per_document(run, [x, d_t, b, c], cu_seqlens)

        return head_parallel(per_head, hidden_states, dt, B, C, grouped=(2, 3), mesh=mesh, layout=layout,
                             with_heads=True, cu_seqlens=cu)
    return mamba2_chunk_scan


_ROUTES = {"causal_conv1d_fn": _conv_route, "torch_chunk_gated_delta_rule": _gdn_route,
           "chunk_kimi_delta_attention": _gdn_route,
           "mamba2_split_conv1d_scan_combined": _fused_route, "mamba2_chunk_scan": _ssd_route}


def call_problem(model: nn.Module, kwargs: dict) -> Optional[str]:
    """Why this forward of a model with covered layers cannot run (None when it can); sets
    ``use_cache=False`` when the caller left it unset (a sharded recurrent state is no cache)."""
    if not getattr(model, _COVERED_MODEL, False):
        return None
    packed = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None
    if packed and model_type(model) not in PACKED_MODEL_TYPES:
        return (f"packed documents (cu_seq_lens_q/k) with the recurrent layers of model type {model_type(model)!r}: "
                f"not tested for this type (tested: {sorted(PACKED_MODEL_TYPES)}); pass one document per row")
    if kwargs.get("use_cache"):
        return (f"use_cache=True with the recurrent layers of model type {model_type(model)!r} (their state is "
                "split over the ranks' heads); pass use_cache=False")
    if kwargs.get("past_key_values") is not None:
        return f"past_key_values with the recurrent layers of model type {model_type(model)!r}"
    kwargs["use_cache"] = False
    return None
