"""TRL's trainers (``trl==1.16.0``) with usp-hal sequence parallelism, dp x sp from the config.

::

    from trl import SFTConfig, SFTTrainer
    from usp_hal.integrations.trl import usp_config, usp_trainer

    args = usp_config(SFTConfig)(output_dir="out", usp_ulysses_degree=2, usp_ring_degree=2, packing=True, ...)
    usp_trainer(SFTTrainer)(model=model, args=args, train_dataset=ds, processing_class=tok).train()

or with the ready-made pairs ``USPSFTTrainer``/``USPSFTConfig``, ``USPDPOTrainer``/``USPDPOConfig``
and ``USPGRPOTrainer``/``USPGRPOConfig`` (``from usp_hal.integrations.trl import USPSFTTrainer``).
Each trainer is TRL's over :class:`usp_hal.integrations.training.trainer.USPTrainer`, each config TRL's
plus the ``usp_*`` fields of :class:`~usp_hal.integrations.training.trainer.USPTrainingArguments`; the
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
  of each replica's loss gradient, as under plain data parallel with ``dp`` processes.  Inside
  ``compute_loss`` TRL's gathers and reductions (metrics, token counts) run over the replicas
  (:class:`_ReplicaView`): the logged metrics and ``num_tokens`` are those of a ``dp``-process run.
* **GRPO's whole loop** (``train()`` with TRL's transformers generation): each replica's ranks
  load the same prompts, start from the same seed and generate together, sequence-parallel
  (the sharded-KV ``generate()`` of :mod:`usp_hal.integrations.transformers`), so they train on
  the same completions; TRL's own code sees the replicas as its processes (the generation
  batch, the rewards grouped by prompt, each replica's slice, the token counts); the old
  policy's and the reference model's log-probabilities (``beta != 0``) are sharded calls too.
  See :class:`_GRPO`.

GRPO's loss types: ``grpo`` and ``dapo`` are tested.  The token-count normaliser of ``dapo``,
``cispo`` and ``vespo`` (``inputs["num_items_in_batch"] / num_processes``) is the global batch's
count over the replicas, as TRL's ``_generate_and_score_completions`` makes it here (a batch
given by an override of ``_generate_and_score_completions`` or ``_prepare_inputs`` must carry
that count).

Refused, each with its reason and what to do instead (``ValueError``, ``TypeError``,
``NotImplementedError``; from the arguments, before TRL's set-up, on every rank alike): what
``USPTrainer`` refuses (DeepSpeed, FSDP, an accelerate ``ParallelismConfig`` - TRL's
``cp_size``/``sp_size`` route -, label smoothing, ...); a mixture-of-experts load-balancing loss
(``router_aux_loss_coef`` not 0: a product of per-expert means over every token); for DPO and
GRPO, positional arguments (their trainers take other arguments second), PEFT models, model calls
other than TRL's fused log-probability call on ``input_ids``/``attention_mask`` (vision inputs)
and ``return_outputs=True``; DPO without ``ref_model=``, with ``precompute_ref_log_probs`` or
``sync_ref_model``; GRPO with ``use_vllm``, ``use_transformers_continuous_batching``,
``sync_ref_model``, ``usp_dynamic_degree``, ``tools=``, ``rollout_func=`` or
``environment_factory=`` (they would run once per rank, not once per replica), and images in
the prompts; DPO's and GRPO's ``evaluate()``.

Logged ``num_tokens`` is the real tokens of the global batches, as one process counts them:
SFT's per-rank count is corrected to each shard's real tokens (summed at each log, one
all-reduce of one integer), DPO's and GRPO's are made over the replicas.
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
    """SFT's logged ``num_tokens``: TRL counts each rank's ``position_ids.size(1)`` when the
    batch has no ``attention_mask`` (padding-free batches of one packed row), which after
    ``shard_batch`` (the mask travels with the position ids) is also what it counts for padded
    rows: each rank's shard length, once per batch.  Here each rank's count is corrected to the
    real tokens of its shard (the padding excluded, every row counted); the corrections of
    every rank are summed when the Trainer logs (one all-reduce of one integer per logging
    step), so ``num_tokens`` is the real tokens of the global batches, as one process counts
    them with the attention mask."""

    _usp_token_fix: Any = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)
        pos = inputs.get("position_ids")
        if self.model.training and "attention_mask" not in inputs and isinstance(pos, torch.Tensor):
            from . import transformers as usp
            padding = getattr(pos, usp.PADDING_ATTR, None)
            if padding is not None:     # this rank's real tokens: its shard of the global padding mask
                import usp_hal
                real: Any = usp_hal.shard(padding.keep, self.usp_layout, self.usp_mesh, seq_dim=1,
                                          cu_seqlens=None).sum()
            else:
                real = pos.numel()
            fix = real - int(pos.shape[1])          # what TRL counted for this rank
            self._usp_token_fix = fix if self._usp_token_fix is None else self._usp_token_fix + fix
        return out

    def log(self, logs, start_time=None):
        fix, self._usp_token_fix = self._usp_token_fix, None
        if fix is not None:          # every rank has one: each ran the same training steps
            import torch.distributed as dist
            total = torch.as_tensor(fix, dtype=torch.int64, device=self.args.device).reshape(1)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(total)
            self._total_train_tokens += int(total)
            if "num_tokens" in self._metrics["train"]:
                self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return super().log(logs, start_time)


class _ReplicaView:
    """The trainer's accelerate ``Accelerator`` as TRL's own code sees it inside the
    whole-sequence steps (DPO's ``compute_loss``; GRPO's completions step and ``compute_loss``):
    the data-parallel replicas are the processes.  Every rank of a replica holds the replica's
    whole batch, so TRL's gathers and reductions (rewards grouped by prompt, the token count of
    ``dapo``, the metrics, the logged ``num_tokens``) run over the data-parallel group (the
    ranks of the other replicas with this rank's place in its own), and ``process_index`` /
    ``num_processes`` are the replica's index and count: each replica computes what one process
    of a ``dp``-process TRL run computes.  Everything else is the accelerator's own."""

    def __init__(self, accelerator, mesh, index: int):
        self._acc, self._mesh = accelerator, mesh
        self.process_index, self.num_processes = index, mesh.dp_degree

    def __getattr__(self, name):
        return getattr(self._acc, name)

    def gather(self, tensor):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"usp_hal.integrations.trl: gather of a {type(tensor).__name__} inside the "
                            "sequence-parallel step (tensors only)")
        if self.num_processes == 1:         # as accelerate gives it with one process
            return tensor
        import torch.distributed as dist
        flag = tensor.dtype == torch.bool
        x = (tensor.to(torch.uint8) if flag else tensor).reshape(tensor.shape or (1,)).contiguous()
        parts = [torch.empty_like(x) for _ in range(self.num_processes)]
        dist.all_gather(parts, x, group=self._mesh.dp_group)
        out = torch.cat(parts)
        return out.bool() if flag else out

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        return self.gather(input_data)      # training only: no duplicated tail of an evaluation set

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        out = tensor.clone()
        if self.num_processes > 1:
            import torch.distributed as dist
            dist.all_reduce(out, group=self._mesh.dp_group)
            if reduction == "mean":
                out /= self.num_processes
        return out * scale if scale != 1.0 else out

    def pad_across_processes(self, tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
        if self.num_processes == 1:
            return tensor
        import torch.distributed as dist
        size = torch.tensor([tensor.shape[dim]], dtype=torch.int64, device=tensor.device)
        dist.all_reduce(size, op=dist.ReduceOp.MAX, group=self._mesh.dp_group)
        extra = int(size) - int(tensor.shape[dim])
        if extra == 0:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = extra
        pad = tensor.new_full(shape, pad_index)
        return torch.cat([pad, tensor] if pad_first else [tensor, pad], dim=dim)


def _replica_ranks(mesh) -> list:
    """The world ranks that hold each replica's data in the data-parallel group of this rank
    (replica order)."""
    import torch.distributed as dist
    if mesh.dp_degree == 1:
        return [mesh.rank]
    return list(dist.get_process_group_ranks(mesh.dp_group))


def _fewest_tokens(mesh, layout: str, seqlen: int) -> int:
    """The shortest length >= ``seqlen`` that leaves no rank of ``mesh`` without a token."""
    from usp_hal.sequence.positions import local_lengths
    n = max(int(seqlen), 1)
    while min(min(row) for row in local_lengths(layout, n, mesh.ring_degree, mesh.ulysses_degree)) == 0:
        n += 1
    return n


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
            with self._replica_view():
                return super().compute_loss(calls, inputs, return_outputs=False, num_items_in_batch=num_items_in_batch)
        finally:
            if ref is not None:
                self.ref_model = ref

    @contextlib.contextmanager
    def _replica_view(self):
        """TRL's own code in the block sees the replicas as its processes (:class:`_ReplicaView`)."""
        acc = self.accelerator
        if isinstance(acc, _ReplicaView):
            yield
            return
        self.accelerator = _ReplicaView(acc, self.usp_mesh, self._dp_index())
        try:
            yield
        finally:
            self.accelerator = acc

    def _replica_rows(self, rows, n: int):
        """Rows gathered over every rank (``n`` per rank, world order), once per replica."""
        ranks = _replica_ranks(self.usp_mesh)
        if isinstance(rows, torch.Tensor):
            return torch.cat([rows[r * n:(r + 1) * n] for r in ranks])
        return [x for r in ranks for x in rows[r * n:(r + 1) * n]]


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
    """GRPO's whole loop: generation, scoring and the loss, with the ranks of a replica as one.

    * **The same completions on every rank of a replica.**  Every rank of a replica loads the
      replica's prompts (the per-replica loader of ``USPTrainer``) and starts from the same
      random state: TRL seeds each process with ``seed + process_index`` at set-up, and here
      each replica's ranks get ``seed + replica index`` instead, as the processes of a
      ``dp``-process TRL run.  Generation is one collective call of the replica
      (``usp_hal.integrations.transformers``' sharded ``generate()``): the left-padded prompts
      are sharded along the sequence, the prefill is the USP call filling a
      :class:`~usp_hal.integrations.cache.ShardedCache` (each rank keeps its heads and tokens
      of the K/V), every rank decodes every new token through it, sampling from the group's
      first rank's random state, and at each step the ranks agree on the tokens they picked
      (a difference raises on every rank).  Broadcasting one rank's completions instead would
      leave the other ranks' random states behind (TRL shuffles each generation batch with the
      global generator) and hold the whole K/V of the generation on one rank.
    * **TRL's processes are the replicas.**  The sampler's generation batch counts the
      replicas (:func:`usp_config` sets ``generation_batch_size`` from ``dp``, not the world),
      and inside the completions step and the loss TRL's gathers run over the data-parallel
      group (:class:`_ReplicaView`): rewards are grouped and normalised over the replicas'
      completions, each replica keeps its slice, and the token counts are the global batch's.
      The rewards TRL gathers over every rank and the prompts/completions it logs are taken
      once per replica.
    * **Scoring.**  Every model call of TRL's (the loss's log-probabilities, the old policy's and
      the reference model's for ``beta != 0``) is sharded along the sequence and its per-token
      outputs gathered (:class:`_WholeSequenceCalls`).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from accelerate.utils import set_seed

        # TRL's set_seed(seed, device_specific=True) gave every rank seed + its world index; the
        # ranks of a replica sample together, as one process of a dp-process run: seed + replica
        set_seed(self.args.seed + self._dp_index())

    def _usp_config_problem(self, args, kwargs: dict) -> Optional[BaseException]:
        if args is not None and getattr(args, "use_vllm", False):
            return _refuse("use_vllm=True", "vLLM's completions are handed out per process, and the ranks of one "
                           "sequence-parallel replica must share theirs", "Leave use_vllm=False: generation runs "
                           "sequence-parallel through transformers' generate()")
        if args is not None and getattr(args, "use_transformers_continuous_batching", False):
            return _refuse("use_transformers_continuous_batching=True", "continuous batching does not go through "
                           "the sequence-parallel generate()", "Leave it False")
        if args is not None and getattr(args, "sync_ref_model", False):
            return _refuse("sync_ref_model=True", "it is not verified with the sequence-parallel reference model",
                           "Leave it False")
        if args is not None and getattr(args, "usp_dynamic_degree", False):
            return _refuse("usp_dynamic_degree", "its per-batch split is made for token-mean language-modelling "
                           "losses", "Set usp_ulysses_degree/usp_ring_degree")
        for name in ("tools", "rollout_func", "environment_factory"):
            if kwargs.get(name) is not None:
                return _refuse(f"{name}=", "tool calls, custom rollouts and environments would run once on every "
                               "rank of a replica, and they are not verified sequence-parallel", "Leave it unset")
        return None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL gathers the rewards with accelerate's gather over every rank: each replica's sp times
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._replica_rows(rewards, len(prompts))

    def _generate_and_score_completions(self, inputs):
        from collections import defaultdict
        logs = self._logs
        self._logs = {"images": [], "prompt": [], "completion": [], "advantages": [],
                      "rewards": defaultdict(list), "extra": defaultdict(list)}
        try:
            with self._replica_view():
                out = super()._generate_and_score_completions(inputs)
            staged = self._logs
        finally:
            self._logs = logs
        n = len(inputs)
        for key in ("images", "prompt", "completion"):       # gather_object over every rank
            logs[key].extend(self._replica_rows(staged[key], n))
        for column, values in staged["extra"].items():
            logs["extra"][column].extend(self._replica_rows(values, n))
        for name, values in staged["rewards"].items():     # from the rewards above: once per replica
            logs["rewards"][name].extend(values)
        logs["advantages"].extend(staged["advantages"])
        return out

    # ------------------------------------------------------------------ model calls
    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        if not isinstance(model, _WholeSequenceCalls):      # the old policy's and the reference's
            model = _WholeSequenceCalls(model, self)
        return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's transformers generation of the prompts' completions, as one sequence-parallel
        ``generate()`` of the replica (see the class doc); returns TRL's ``(completion_ids, None)``."""
        from trl.models import unwrap_model_for_generation

        from . import transformers as usp
        if images is not None or multimodal_fields:
            raise _refuse("images in GRPO prompts", "vision inputs are not sharded along the sequence",
                          "Use a text-only causal LM")
        device = self.accelerator.device
        pad = self._tokenizer.pad_token_id
        width = max(len(ids) for ids in prompt_ids)
        multiple = self.pad_to_multiple_of
        if multiple:
            width = -(-width // multiple) * multiple
        # every rank must hold a token of the prompt: short prompts get more left padding
        width = _fewest_tokens(self.usp_mesh, self.usp_layout, width)
        ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        mask = torch.zeros(len(prompt_ids), width, dtype=torch.long)
        for row, p in enumerate(prompt_ids):
            if len(p):
                ids[row, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
                mask[row, width - len(p):] = 1
        local = usp.shard_batch({"input_ids": ids.to(device), "attention_mask": mask.to(device)}, self.usp_mesh,
                                self.usp_layout)
        with unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                         gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                                         generation_kwargs=self.generation_kwargs,
                                         gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs
                                         ) as unwrapped, torch.no_grad():
            out = unwrapped.generate(**local, generation_config=self.generation_config)
        new = out[:, local["input_ids"].shape[1]:].cpu()     # this rank's prompt shard, then the new tokens
        # each completion ends at its first end-of-sequence token (kept), as in TRL's own path
        ends = torch.isin(new, torch.tensor(self.eos_token_ids, dtype=new.dtype))
        lengths = torch.where(ends.any(1), ends.int().argmax(1) + 1, torch.full_like(ends[:, 0], new.shape[1],
                                                                                     dtype=torch.long))
        return [new[row, :int(n)].tolist() for row, n in enumerate(lengths)], None


_EXTRA = {"SFTTrainer": (_SFT,), "DPOTrainer": (_DPO,), "GRPOTrainer": (_GRPO,)}


@functools.lru_cache(maxsize=None)
def usp_trainer(trainer_cls: type) -> type:
    """``trainer_cls`` (``trl.SFTTrainer``, ``trl.DPOTrainer`` or ``trl.GRPOTrainer``) with usp-hal
    sequence parallelism: a subclass over :class:`~usp_hal.integrations.training.trainer.USPTrainer`,
    taking the ``mesh=`` keyword and ``args`` made by :func:`usp_config`.  Other trainers are
    refused (their losses are not verified)."""
    from .training.trainer import USPTrainer
    _check_version()
    extra = _EXTRA.get(getattr(trainer_cls, "__name__", ""))
    if extra is None or not getattr(trainer_cls, "__module__", "").startswith("trl."):
        raise _refuse(f"the trainer {trainer_cls!r}", "only the losses of TRL's SFTTrainer, DPOTrainer and "
                      "GRPOTrainer are verified sequence-parallel", "Use one of those, or "
                      "usp_hal.integrations.training.trainer.USPTrainer for a transformers Trainer")
    name = f"USP{trainer_cls.__name__}"
    return type(name, extra + (USPTrainer, trainer_cls), {"__module__": __name__, "__doc__": (
        f"trl.{trainer_cls.__name__} with usp-hal sequence parallelism (usp_hal.integrations.trl).")})


@functools.lru_cache(maxsize=None)
def usp_config(config_cls: type) -> type:
    """``config_cls`` (``trl.SFTConfig``, ``DPOConfig``, ``GRPOConfig``) plus the ``usp_*`` fields of
    :class:`~usp_hal.integrations.training.trainer.USPTrainingArguments` (degrees, layout, backend)."""
    from .training.trainer import USPTrainingArguments
    name = f"USP{config_cls.__name__}"
    first = (_ReplicaGenerationBatch,) if config_cls.__name__ == "GRPOConfig" else ()
    # TRL's config first: its defaults (bf16, logging_steps, learning_rate, ...) win over TrainingArguments'
    # (dataclass fields are collected along the reversed MRO), and its __post_init__ runs USPTrainingArguments'
    cls = type(name, first + (config_cls, USPTrainingArguments), {"__module__": __name__, "__doc__": (
        f"trl.{config_cls.__name__} plus the usp_* fields of USPTrainingArguments.")})
    return dataclasses.dataclass(cls)


class _ReplicaGenerationBatch(_Mixin):
    """Goes before ``trl.GRPOConfig`` in :func:`usp_config`'s class (not a dataclass: its
    annotations are not fields)."""

    generation_batch_size: Optional[int]
    steps_per_generation: Optional[int]

    def __post_init__(self) -> None:
        """GRPO's ``generation_batch_size`` / ``steps_per_generation``, with the data-parallel
        replicas as the processes.  TRL's ``GRPOConfig.__post_init__`` counts ``world_size``
        processes (``per_device_train_batch_size * world_size * steps_per_generation``); the
        sampler would then draw ``sp`` times the prompts the replicas train on per step.  Here the
        same rules count ``dp = world_size / (usp_ulysses_degree * usp_ring_degree)``."""
        gbs, spg = self.generation_batch_size, self.steps_per_generation
        mine = gbs is None or spg is None        # both set: TRL's own error
        if mine:     # a stand-in TRL's checks over the world accept; set again below
            self.generation_batch_size, self.steps_per_generation = None, self.num_generations
        super().__post_init__()
        if not mine:
            return
        sp = int(self.usp_ulysses_degree) * int(self.usp_ring_degree)
        rows = self.per_device_train_batch_size * max(int(self.world_size) // sp, 1)    # per step, all replicas
        if gbs is None and spg is None:
            spg = self.gradient_accumulation_steps
        elif gbs is not None:
            if gbs % rows:
                raise ValueError(f"generation_batch_size ({gbs}) must be divisible by the global batch size ({rows}: "
                                 "per_device_train_batch_size x the data-parallel replicas)")
            spg = gbs // rows
        self.generation_batch_size, self.steps_per_generation = rows * spg, spg
        if self.generation_batch_size % self.num_generations:
            raise ValueError(f"generation_batch_size ({self.generation_batch_size}) must be divisible by "
                             f"num_generations ({self.num_generations})")


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
