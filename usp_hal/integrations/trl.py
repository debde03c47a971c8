"""TRL's trainers (``trl==1.16.0``) with usp-hal sequence parallelism, dp x sp from the config.

::

    from trl import SFTConfig, SFTTrainer
    from usp_hal.integrations.trl import usp_config, usp_trainer

    args = usp_config(SFTConfig)(output_dir="out", usp_ulysses_degree=2, usp_ring_degree=2, packing=True, ...)
    usp_trainer(SFTTrainer)(model=model, args=args, train_dataset=ds, processing_class=tok).train()

or with the ready-made pairs ``USPSFTTrainer``/``USPSFTConfig``, ``USPDPOTrainer``/``USPDPOConfig``
and ``USPGRPOTrainer``/``USPGRPOConfig`` (``from usp_hal.integrations.trl import USPSFTTrainer``).
Each trainer is TRL's over :class:`usp_hal.integrations.trainer.USPTrainer`, each config TRL's
plus the ``usp_*`` fields of :class:`~usp_hal.integrations.trainer.USPTrainingArguments`; the
world is cut into replicas of ``sp = ulysses x ring`` ranks as there (see that module for what
the Trainer, accelerate and usp-hal each do, and what is refused).  Importing this module
imports TRL lazily and patches nothing; the classes are made on first use.

How each trainer's loss stays exact:

* **SFT** (packed, padding-free or padded rows): its loss is a token mean, so every batch is
  sharded before the model as with ``USPTrainer`` (:func:`~usp_hal.integrations.transformers.shard_batch`:
  labels shifted over the whole sequence, the step's exact token count; TRL's fused LM head
  scores the pre-shifted ``shift_labels`` as they are).  TRL's padding-free collator adds
  ``seq_idx`` (the document of every token), which is sharded like the tokens.
* **DPO** and **GRPO**: the loss is a non-linear function of each sequence's summed
  log-probabilities (DPO: chosen and rejected of one pair, in one concatenated forward), so
  batches reach TRL's ``compute_loss`` whole; every model call inside it is sharded along the
  sequence (the padding as a key mask) and the per-token outputs of TRL's fused LM head
  (log-probabilities, entropies, ...) are gathered back to the whole sequence (``[B, S-1]``,
  a few floats per token).  Every rank of a replica then computes the replica's loss, as one
  process would; the gather's backward sums the sp ranks' (equal) gradients of the gathered
  log-probabilities and hands each rank its slice (``usp_hal.unshard(..., reduce_grad=True)``),
  so after DDP's mean over the world each parameter's gradient is the mean over the replicas
  of each replica's loss gradient, as under plain data parallel with ``dp`` processes.

GRPO's loss types: ``grpo`` and ``dapo`` are tested.  The token-count normaliser of ``dapo``,
``cispo`` and ``vespo`` (``inputs["num_items_in_batch"] / num_processes``) stays right when the
count is made as TRL's ``_generate_and_score_completions`` makes it, gathered over every process
(so each replica's count ``sp`` times, over ``dp * sp`` processes).

Refused, each with its reason and what to do instead (``ValueError``, ``TypeError``,
``NotImplementedError``; from the arguments, before TRL's set-up, on every rank alike): what
``USPTrainer`` refuses (DeepSpeed, FSDP, an accelerate ``ParallelismConfig`` - TRL's
``cp_size``/``sp_size`` route -, label smoothing, ...); a mixture-of-experts load-balancing loss
(``router_aux_loss_coef`` not 0: a product of per-expert means over every token); for DPO and
GRPO, positional arguments (their trainers take other arguments second), PEFT models, model calls
other than TRL's fused log-probability call on ``input_ids``/``attention_mask`` (vision inputs)
and ``return_outputs=True``; DPO without ``ref_model=``, with ``precompute_ref_log_probs`` or
``sync_ref_model``; GRPO with ``use_vllm`` or ``beta != 0`` (the reference log-probabilities
come from the generation step), and GRPO's own generation (``train()`` raises at once unless the
completions step is overridden: each rank would sample its own completions for the batch its
replica shares) - its training step runs on completions given to it (override
``_generate_and_score_completions`` or ``_prepare_inputs``); DPO's and GRPO's ``evaluate()``.
DPO's and GRPO's logged ``num_tokens`` counts each replica's tokens ``sp`` times (every rank of a
replica holds its whole batch); their ratios (entropy, accuracies, rewards) are unaffected.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Dict, Optional

import torch

# also USPSFTTrainer, USPSFTConfig, USPDPOTrainer, USPDPOConfig, USPGRPOTrainer, USPGRPOConfig: made on
# first use (module __getattr__), so that importing this module does not import TRL
__all__ = ["usp_trainer", "usp_config", "TESTED_VERSIONS"]

TESTED_VERSIONS = ("1.16.0",)

# per-token fields of trl.trainer.utils.FusedCausalLMOutput (trl 1.16.0); the first two carry gradients
_FUSED_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
_DIFFERENTIABLE = ("log_probs", "entropy")
_CALL_KEYS = ("input_ids", "attention_mask", "labels", "fused_lm_head", "use_cache")


def _refuse(what: str, why: str, instead: str) -> ValueError:
    return ValueError(f"usp_hal.integrations.trl does not support {what}: {why}. {instead}")


class _WholeSequenceCalls:
    """A stand-in for the model inside DPO's and GRPO's ``compute_loss``: each call with TRL's
    fused LM head (``model(input_ids=, attention_mask=, labels=, fused_lm_head=True)``, whole
    sequences) is sharded along the sequence, run, and its per-token outputs gathered back to
    ``[B, S-1]`` (TRL's shape without ``shift_labels``)."""

    def __init__(self, model, trainer):
        self.model, self.trainer = model, trainer

    def __call__(self, *args, **kwargs):
        from trl.trainer.utils import FusedCausalLMOutput

        import usp_hal

        from . import transformers as usp
        other = sorted(set(kwargs) - set(_CALL_KEYS))
        if args or other or not kwargs.get("fused_lm_head") or kwargs.get("labels") is None:
            raise _refuse(f"a model call with {sorted(kwargs) if not args else 'positional arguments'} inside "
                          f"{type(self.trainer).__name__}.compute_loss", "only TRL's fused log-probability call on "
                          "input_ids/attention_mask is sharded and gathered (vision inputs, MoE router logits and "
                          "logits calls are not)", "Use a text-only causal LM without router logits")
        mesh, layout = self.trainer.usp_mesh, self.trainer.usp_layout
        batch = {"input_ids": kwargs["input_ids"], "labels": kwargs["labels"]}
        if kwargs.get("attention_mask") is not None:
            batch["attention_mask"] = kwargs["attention_mask"]
        local = usp.shard_batch(batch, mesh, layout)
        local.pop("num_items_in_batch", None)
        local.pop("labels", None)             # the fused head scores shift_labels as they are
        out = self.model(**local, fused_lm_head=True, use_cache=False)
        fields: Dict[str, Any] = {}
        for name in _FUSED_FIELDS:
            x = getattr(out, name, None)
            if x is None:
                fields[name] = None
                continue
            flag = x.dtype == torch.bool
            x = x.to(torch.uint8) if flag else x
            whole = usp_hal.unshard(x, layout, mesh, seq_dim=1,
                                    reduce_grad=name in _DIFFERENTIABLE and x.requires_grad)
            whole = whole[:, :-1]             # position t scores token t+1; the last scores nothing
            fields[name] = whole.bool() if flag else whole
        return FusedCausalLMOutput(loss=None, aux_loss=None, **fields)


_Mixin: Any = object      # the trainer classes it goes before (USPTrainer, TRL's), for the type checker


def _router_loss_problem(model, args) -> Optional[ValueError]:
    """TRL's MoE load-balancing loss (``aux_loss_enabled``, the same rule as TRL 1.16's trainers)."""
    cfg = model.config.get_text_config()
    coef = getattr(args, "router_aux_loss_coef", None)
    coef = getattr(cfg, "router_aux_loss_coef", 0.0) if coef is None else coef
    if hasattr(cfg, "output_router_logits") and coef != 0.0:
        return _refuse(f"a mixture-of-experts load-balancing loss (router_aux_loss_coef={coef})", "it is a "
                       "product of per-expert token means over the whole batch, and each rank routes only its "
                       "shard of the tokens", "Pass router_aux_loss_coef=0.0 in the config")
    return None


class _TRL(_Mixin):
    """Checks common to the TRL trainers, before TRL's set-up (on every rank alike)."""

    def __init__(self, *args, **kwargs):
        problem = self._usp_arguments_problem(args, kwargs)
        if problem is not None:       # before TRL's set-up and any collective, on every rank alike
            raise problem
        super().__init__(*args, **kwargs)

    def _usp_arguments_problem(self, args: tuple, kwargs: dict) -> Optional[BaseException]:
        model: Any = kwargs.get("model", args[0] if args else None)
        if hasattr(getattr(model, "config", None), "get_text_config"):
            return _router_loss_problem(model, kwargs.get("args"))
        return None

    def _refuse_after_init(self) -> None:
        if getattr(self, "aux_loss_enabled", False):       # a model TRL loaded by name
            raise _router_loss_problem(self.model, self.args) or _refuse(
                "a mixture-of-experts load-balancing loss", "each rank routes only its shard of the tokens",
                "Pass router_aux_loss_coef=0.0 in the config")
        super()._refuse_after_init()


class _SFT(_TRL):
    pass


class _WholeSequenceLoss(_TRL):
    """What DPO and GRPO add over ``USPTrainer``: batches stay whole until the model call (see
    :class:`_WholeSequenceCalls`); the reference model (DPO) gets usp-hal attention too."""

    _usp_model_loss = False        # TRL computes these losses from the gathered log-probabilities
    usp_mesh: Any
    usp_layout: str
    _attn_name: str

    def _usp_arguments_problem(self, args: tuple, kwargs: dict) -> Optional[BaseException]:
        if args:
            return TypeError(f"{type(self).__name__}: pass the arguments by name (model=, args=, ...): TRL's "
                             "trainer takes other arguments second than USPTrainer")
        return super()._usp_arguments_problem(args, kwargs) or self._usp_config_problem(kwargs.get("args"), kwargs)

    def _usp_config_problem(self, args, kwargs: dict) -> Optional[BaseException]:
        """What this trainer's configuration asks that the sequence-parallel step cannot honour."""
        return None

    def _refuse_after_init(self) -> None:
        from accelerate.utils import is_peft_model
        if is_peft_model(self.model):
            raise _refuse("a PEFT model", "its reference (adapters off) and the sharded calls are not verified "
                          "together", "Train the full model")
        super()._refuse_after_init()

    def evaluate(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}.evaluate() is not sequence-parallel yet (USPTrainer's "
                                  "evaluation shards a language-modelling batch, not preference or completion "
                                  "batches); evaluate with TRL's trainer in one process")

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's batches, whole (every rank of a replica the same); no token count (these
        losses do not divide by one, as in TRL's own step)."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        return batches, None

    @contextlib.contextmanager
    def usp_attention(self):
        """The model and DPO's reference model with usp-hal attention for the duration (restored
        afterwards), as ``train()`` has them: for calling ``compute_loss``/``training_step``
        yourself."""
        models = [m for m in (self.model, getattr(self, "ref_model", None)) if m is not None]
        old = [m.config._attn_implementation for m in models]
        try:
            for m in models:
                m.set_attn_implementation(self._attn_name)
            yield
        finally:
            for m, name in zip(models, old):
                m.set_attn_implementation(name)

    def train(self, *args, **kwargs):
        ref = getattr(self, "ref_model", None)
        if ref is None:
            return super().train(*args, **kwargs)
        old = ref.config._attn_implementation
        ref.set_attn_implementation(self._attn_name)
        try:
            return super().train(*args, **kwargs)
        finally:
            ref.set_attn_implementation(old)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise _refuse("return_outputs=True", "the sharded calls return gathered log-probabilities, not logits",
                          "Evaluate the loss only (prediction_loss_only=True)")
        calls = _WholeSequenceCalls(model, self)
        ref = getattr(self, "ref_model", None)
        try:
            if ref is not None:
                self.ref_model = _WholeSequenceCalls(ref, self)
            return super().compute_loss(calls, inputs, return_outputs=False, num_items_in_batch=num_items_in_batch)
        finally:
            if ref is not None:
                self.ref_model = ref


class _DPO(_WholeSequenceLoss):
    def _usp_config_problem(self, args, kwargs: dict) -> Optional[BaseException]:
        if args is not None and getattr(args, "precompute_ref_log_probs", False):
            return _refuse("precompute_ref_log_probs=True", "the reference log-probabilities would be computed "
                           "before training, per process, outside the sequence-parallel step", "Leave it False "
                           "(the reference model runs sequence-parallel inside each step)")
        if args is not None and getattr(args, "sync_ref_model", False):
            return _refuse("sync_ref_model=True", "it is not verified with the sequence-parallel reference model",
                           "Leave it False")
        if kwargs.get("ref_model") is None:
            return _refuse("DPO without ref_model=", "TRL would load the reference model by name (or use the "
                           "adapter-free PEFT model)", "Pass ref_model= (a copy of the model)")
        return None


class _GRPO(_WholeSequenceLoss):
    def _usp_config_problem(self, args, kwargs: dict) -> Optional[BaseException]:
        if args is not None and getattr(args, "use_vllm", False):
            return _refuse("use_vllm=True", "vLLM's completions are handed out per process, and the ranks of one "
                           "sequence-parallel replica must share theirs", "Generate outside and give the trainer "
                           "the completions (override _generate_and_score_completions)")
        if args is not None and getattr(args, "beta", 0.0) != 0.0:
            return _refuse(f"beta={args.beta}", "the reference log-probabilities come from TRL's generation step, "
                           "which is not sequence-parallel", "Set beta=0.0, or give the completions with "
                           "ref_per_token_logps")
        return None

    def train(self, *args, **kwargs):
        from trl import GRPOTrainer
        cls = type(self)
        if cls._prepare_inputs is GRPOTrainer._prepare_inputs and \
                cls._generate_and_score_completions is GRPOTrainer._generate_and_score_completions and \
                cls._generate is _GRPO._generate:       # refused here, on every rank, before any collective
            self._generate([])
        return super().train(*args, **kwargs)

    def _generate(self, prompts):
        raise NotImplementedError(
            f"{type(self).__name__} does not generate: TRL's generate() runs each rank on its own copy of the "
            "prompts, so the ranks of one sequence-parallel replica would sample different completions for the "
            "batch they share (and usp-hal attention serves sharded batches only). Generate the completions "
            "elsewhere (one process, or a vLLM server outside the trainer) and give them to the training step: "
            "override _generate_and_score_completions (or _prepare_inputs) to return the prepared batch "
            "(prompt_ids, prompt_mask, completion_ids, completion_mask, advantages, ...)")


_EXTRA = {"SFTTrainer": (_SFT,), "DPOTrainer": (_DPO,), "GRPOTrainer": (_GRPO,)}


@functools.lru_cache(maxsize=None)
def usp_trainer(trainer_cls: type) -> type:
    """``trainer_cls`` (``trl.SFTTrainer``, ``trl.DPOTrainer`` or ``trl.GRPOTrainer``) with usp-hal
    sequence parallelism: a subclass over :class:`~usp_hal.integrations.trainer.USPTrainer`,
    taking the ``mesh=`` keyword and ``args`` made by :func:`usp_config`.  Other trainers are
    refused (their losses are not verified)."""
    from .trainer import USPTrainer
    _check_version()
    extra = _EXTRA.get(getattr(trainer_cls, "__name__", ""))
    if extra is None or not getattr(trainer_cls, "__module__", "").startswith("trl."):
        raise _refuse(f"the trainer {trainer_cls!r}", "only the losses of TRL's SFTTrainer, DPOTrainer and "
                      "GRPOTrainer are verified sequence-parallel", "Use one of those, or "
                      "usp_hal.integrations.trainer.USPTrainer for a transformers Trainer")
    name = f"USP{trainer_cls.__name__}"
    return type(name, extra + (USPTrainer, trainer_cls), {"__module__": __name__, "__doc__": (
        f"trl.{trainer_cls.__name__} with usp-hal sequence parallelism (usp_hal.integrations.trl).")})


@functools.lru_cache(maxsize=None)
def usp_config(config_cls: type) -> type:
    """``config_cls`` (``trl.SFTConfig``, ``DPOConfig``, ``GRPOConfig``) plus the ``usp_*`` fields of
    :class:`~usp_hal.integrations.trainer.USPTrainingArguments` (degrees, layout, backend)."""
    from .trainer import USPTrainingArguments
    name = f"USP{config_cls.__name__}"
    # TRL's config first: its defaults (bf16, logging_steps, learning_rate, ...) win over TrainingArguments'
    # (dataclass fields are collected along the reversed MRO), and its __post_init__ runs USPTrainingArguments'
    cls = type(name, (config_cls, USPTrainingArguments), {"__module__": __name__, "__doc__": (
        f"trl.{config_cls.__name__} plus the usp_* fields of USPTrainingArguments.")})
    return dataclasses.dataclass(cls)


def _check_version() -> None:
    import trl
    from packaging.version import Version
    if Version(trl.__version__) < Version("1.16.0"):
        raise ImportError(f"usp_hal.integrations.trl needs trl >= 1.16.0 (its fused LM head and padding-free "
                          f"collator); found {trl.__version__}; tested with {', '.join(TESTED_VERSIONS)}")


_NAMED = {"USPSFTTrainer": ("SFTTrainer", usp_trainer), "USPDPOTrainer": ("DPOTrainer", usp_trainer),
          "USPGRPOTrainer": ("GRPOTrainer", usp_trainer), "USPSFTConfig": ("SFTConfig", usp_config),
          "USPDPOConfig": ("DPOConfig", usp_config), "USPGRPOConfig": ("GRPOConfig", usp_config)}


def __getattr__(name: str):
    if name in _NAMED:
        import trl
        base, make = _NAMED[name]
        return make(getattr(trl, base))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
