"""The Hugging Face Trainer with usp-hal sequence parallelism, dp x sp from the training arguments.

::

    from usp_hal.integrations.training.trainer import USPTrainer, USPTrainingArguments

    args = USPTrainingArguments(output_dir="out", usp_ulysses_degree=2, usp_ring_degree=1,
                                per_device_train_batch_size=4, max_steps=1000, ...)
    USPTrainer(model=model, args=args, train_dataset=ds).train()
    # torchrun --nproc-per-node 8 train.py: sp = 2 x 1 = 2 ranks per sequence, dp = 8 / 2 = 4 replicas

Every rank runs the same script.  The world is cut into ``world / sp`` data-parallel replicas of
``sp = usp_ulysses_degree * usp_ring_degree`` consecutive ranks; the ranks of one replica share
each row of a batch along the sequence.  ``per_device_train_batch_size`` counts rows per replica
and micro-batch, as the Trainer counts them per dp rank for DeepSpeed's sequence parallelism.

Who does what:

* **the Trainer and accelerate, unchanged**: the optimizer, scheduler, gradient accumulation,
  clipping, logging, checkpoints; DDP over the whole world (accelerate's ``prepare_model``); the
  token count of the loss over every rank (``average_tokens_across_devices``); the final
  ``loss * num_processes`` that undoes DDP's mean (``Trainer.compute_loss``).
* **this class**: the mesh; the data loader giving one batch per replica (the same on its sp
  ranks); each batch sharded along the sequence by
  :func:`usp_hal.integrations.transformers.shard_batch` (global position ids, labels shifted over
  the whole sequence *before* sharding, so no label is lost at a shard boundary); the exact
  token count of the global batch; usp-hal attention on the model during ``train()``.

Why no :func:`~usp_hal.integrations.sync_gradients` call: rank ``r``'s loss is
``num_processes * S_r / N`` (``S_r`` the summed token losses of its shard, ``N`` the non-ignored
tokens of every replica's micro-batches of the step), and DDP averages over all
``num_processes`` ranks, so every rank ends with ``sum_r dS_r / N``: the gradient of the mean
token loss of the whole global batch, which is what one process computes.  The sum over the sp
ranks is already inside DDP's all-reduce; another one would double it.  The step checks once
that the model is in fact DDP over the whole world and then clears usp-hal's partial-gradient
mark (:func:`~usp_hal.integrations.mark_synced`).

``usp_dynamic_degree=True`` (with ``usp_budget_tokens``) instead chooses a Ulysses x Ring split per
global batch (docs/dynamic-degree.md): every rank loads its own rows as in plain data parallel, the
step's rows of every rank are gathered and scheduled on groups of ranks sized for each, this rank
runs its jobs one per round of the schedule (a stand-in call where it has none), and only the
last backward lets DDP all-reduce; each call's loss is ``num_processes`` times its share of the
global batch's mean token loss, as above.

Two engine choices beside DDP (usp_hal.integrations.training.engines, docs/engines.md):
``args.deepspeed`` (a ZeRO 1-3 config; the engine averages over the world as DDP does, so the
same loss scaling is exact; DeepSpeed's own ``sequence_parallel_size`` is refused), and
``args.parallelism_config`` with a ``cp_size`` or ``sp_size`` dim: that dim becomes usp-hal's
sequence-parallel group (split by ``usp_ulysses_degree``/``usp_ring_degree``, default all
Ulysses) and ``dp_replicate`` x ``dp_shard`` the replicas.  The config is kept from accelerate
(whose ``cp`` would run torch's context parallel and ``sp`` DeepSpeed's ALST, and which refuses any
``ParallelismConfig`` on CPU), so the replicas train under DDP (or DeepSpeed) over the world.

Refused (``ValueError`` naming the reason and what to use instead): FSDP, a ``ParallelismConfig``
with ``tp_size > 1`` or without a ``cp``/``sp`` dim, DeepSpeed's ``sequence_parallel_size``,
DeepSpeed with ``use_cpu=True`` or ``usp_dynamic_degree``, tensor-parallel models, evaluation
during training (``evaluate()`` after ``train()`` gives the evaluation loss of one process;
``compute_metrics`` is refused) and prediction, label smoothing, ``compute_loss_func``, NEFTune,
Liger kernels, ``model_init``, ``average_tokens_across_devices=False``, the ``batch_rebalance``
sampling strategy, ``dispatch_batches``/``split_batches`` loaders and ``DataParallel`` (several GPUs in one
process).  A batch's ``attention_mask`` with padding goes through ``shard_batch`` as a key
mask (see its doc; tested there, not with the Trainer).
"""
from __future__ import annotations

import copy
import functools
import itertools
import warnings
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

import usp_hal
from usp_hal.integrations import transformers as usp
from usp_hal.integrations.sequence_mixers import RECURRENCES, check_recurrence

from .grads import mark_synced, set_sync_check
from .tiled_loss import check_chunk_tokens, disable_tiled_loss, enable_tiled_loss

__all__ = ["USPTrainer", "USPTrainingArguments"]

_NAMES = itertools.count()


@dataclass
class USPTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus the sequence-parallel degrees (also on the command line through
    ``HfArgumentParser``: ``--usp_ulysses_degree 2``).  The data-parallel size is what is left:
    ``world_size / (usp_ulysses_degree * usp_ring_degree)``."""

    usp_ulysses_degree: int = field(default=1, metadata={"help": "Ulysses (all-to-all) ranks per sequence"})
    usp_ring_degree: int = field(default=1, metadata={"help": "Ring ranks per sequence"})
    usp_layout: str = field(default=usp.DEFAULT_LAYOUT, metadata={
        "help": "how the sequence is sharded: 'zigzag' (balances causal work over a ring), 'basic', or "
                "'varlen_zigzag' for packed batches"})
    usp_attn_type: str = field(default="auto", metadata={"help": "usp-hal kernel backend (usp-hal probe lists them)"})
    usp_low_memory: bool = field(default=False, metadata={
        "help": "LongContextAttention(low_memory=True): attention heads in groups one after another, a smaller "
                "peak per rank for some more time"})
    usp_tiled_loss: int = field(default=0, metadata={
        "help": "compute the loss in tiles of this many tokens, the logits of one tile at a time "
                "(usp_hal.integrations.training.tiled_loss); 0: the model's own loss"})
    usp_recurrence: str = field(default="auto", metadata={
        "help": "how the recurrences of covered hybrid layers (gated DeltaNet, KDA, Mamba2) cross the shards: "
                "'auto', 'head_parallel' or 'state_passing' (register(..., recurrence=), docs/hybrid.md)",
        "choices": list(RECURRENCES)})

    usp_dynamic_degree: bool = field(default=False, metadata={
        "help": "a Ulysses x Ring split per global batch (usp_hal.planning.dynamic, docs/dynamic-degree.md): every "
                "rank loads its own rows, the step's rows of every rank are placed on groups of ranks sized "
                "for each; needs usp_budget_tokens, and the degrees left at 1"})
    usp_budget_tokens: int = field(default=0, metadata={
        "help": "with usp_dynamic_degree: the most tokens one rank holds in one model call"})
    usp_profile: str = field(default="h100-nvlink", metadata={
        "help": "with usp_dynamic_degree: the planner profile that prices the groups (usp-hal plan lists them)"})
    usp_dynamic_trial_steps: int = field(default=0, metadata={
        "help": "with usp_dynamic_degree: when not 0, the first steps run the per-batch split and one fixed split "
                "in turn, this many timed steps of each after a warm-up, and the run keeps the one measured "
                "faster (DynamicDegree(trial_steps=), docs/dynamic-degree.md)"})
    usp_dynamic_refit_steps: int = field(default=0, metadata={
        "help": "with usp_dynamic_degree: when not 0, the price's whole-step factors are refitted after every "
                "step to this many last measured steps, so it follows the machine's speed through the run "
                "(DynamicDegree(refit_steps=), docs/dynamic-degree.md)"})

    def __post_init__(self):
        check_recurrence(self.usp_recurrence)       # a bad value fails here, before any set-up
        if self.usp_dynamic_degree:
            if self.usp_ulysses_degree != 1 or self.usp_ring_degree != 1:
                raise ValueError("USPTrainingArguments: usp_dynamic_degree chooses the degrees per global batch; "
                                 "leave usp_ulysses_degree and usp_ring_degree at 1")
            if isinstance(self.usp_budget_tokens, bool) or int(self.usp_budget_tokens) < 1:
                raise ValueError("USPTrainingArguments: usp_dynamic_degree needs usp_budget_tokens >= 1 (the most "
                                 f"tokens one rank holds in one model call), got {self.usp_budget_tokens!r}")
            if self.usp_tiled_loss or self.usp_low_memory:
                raise ValueError("USPTrainingArguments: usp_dynamic_degree is not verified with usp_tiled_loss or "
                                 "usp_low_memory yet; leave them off")
            if self.usp_layout not in (usp.DEFAULT_LAYOUT, usp.DYNAMIC_LAYOUT):
                raise ValueError(f"USPTrainingArguments: usp_dynamic_degree chooses each job's layout (zigzag on a "
                                 f"ring, per document when packed); leave usp_layout at {usp.DEFAULT_LAYOUT!r}, got "
                                 f"{self.usp_layout!r}")
            _check_profile(self)
        if isinstance(self.usp_tiled_loss, bool) or self.usp_tiled_loss != 0:      # 0: off
            check_chunk_tokens(self.usp_tiled_loss, "usp_tiled_loss (0: off)")
        super().__post_init__()


def _check_profile(args) -> None:
    """usp_profile must price this run's steps: an attention kernel rate and a linear-layer rate
    in the dtype the Trainer trains in (bf16 / fp16 / fp32 from its own flags)."""
    from usp_hal.planning.planner import PlanError, load_profile
    dtype = _dtype_of(args)
    try:
        prof = load_profile(args.usp_profile)
    except PlanError as exc:
        raise ValueError(f"USPTrainingArguments: usp_profile={args.usp_profile!r}: {exc}") from None
    missing = [what for what, table in (("attention kernel", "kernel"), ("linear-layer", "linear"))
               if dtype not in (prof.get(table) or {})]
    if missing:
        have = sorted(k for k in (prof.get("kernel") or {}) if not k.startswith("_"))
        raise ValueError(f"USPTrainingArguments: usp_dynamic_degree prices each step on usp_profile="
                         f"{args.usp_profile!r}, which has no {' or '.join(missing)} rate for {dtype} (the dtype "
                         f"these arguments train in; it has {', '.join(have)}). Set bf16=True (or fp16=True) to "
                         f"train in what it has, or set usp_profile= to the path of a profile of this machine "
                         f"with {dtype} rates (the usp-hal calibrate command writes one)")


def _refuse(what: str, why: str, instead: str) -> ValueError:
    return ValueError(f"USPTrainer does not support {what}: {why}. {instead}")


def _args_problems(args: TrainingArguments) -> List[ValueError]:
    """The training arguments this path cannot honour (each: what, why, what to do instead)."""
    out = []
    if args.label_smoothing_factor:
        # Trainer.compute_loss pops the labels and calls its LabelSmoother with shift_labels=True:
        # it would shift the already shifted labels of each shard once more
        out.append(_refuse("label_smoothing_factor", "the Trainer's label smoother shifts the labels again inside "
                           "each shard, after shard_batch has shifted them over the whole sequence",
                           "Train without label smoothing, or subclass compute_loss with a loss on "
                           "inputs['shift_labels']"))
    if not args.average_tokens_across_devices:
        # Trainer.compute_loss multiplies the loss by num_processes (undoing DDP's mean) only when
        # average_tokens_across_devices is set; without it each rank's loss is its shard alone
        out.append(_refuse("average_tokens_across_devices=False", "the exact loss divides every rank's token losses "
                           "by the token count of the whole global batch, and the Trainer scales the loss back from "
                           "DDP's mean only with average_tokens_across_devices=True", "Leave it at its default (True)"))
    if str(getattr(args, "eval_strategy", "no")) not in ("no", "IntervalStrategy.NO") or args.eval_on_start:
        out.append(_refuse("evaluation during training", "it is not verified inside train() yet", "Set "
                           "eval_strategy='no' and call trainer.evaluate() after train() (sequence-parallel, the "
                           "loss of one process)"))
    if args.neftune_noise_alpha is not None:
        out.append(_refuse("neftune_noise_alpha", "NEFTune scales its noise by the sequence length, which each rank "
                           "sees only a shard of", "Leave neftune_noise_alpha unset"))
    if args.use_liger_kernel:
        out.append(_refuse("use_liger_kernel", "Liger's fused losses are not verified with sharded, pre-shifted "
                           "labels", "Leave use_liger_kernel=False"))
    if args.deepspeed:
        # the engine averages over its data-parallel group, the world (no mpu): as DDP does, so the
        # Trainer's loss * num_processes gives the exact gradient (usp_hal.integrations.training.engines)
        ds = args.deepspeed if isinstance(args.deepspeed, dict) else {}
        if int(ds.get("sequence_parallel_size", 1) or 1) > 1:
            out.append(_refuse("a DeepSpeed config with sequence_parallel_size", "that is DeepSpeed's own sequence "
                               "parallelism (ALST), which would shard the sequence a second time", "Drop "
                               "sequence_parallel_size and set usp_ulysses_degree/usp_ring_degree"))
        if getattr(args, "usp_dynamic_degree", False):
            out.append(_refuse("deepspeed with usp_dynamic_degree", "it is verified under DDP only", "Leave "
                               "usp_dynamic_degree off under DeepSpeed"))
        if args.use_cpu:
            out.append(_refuse("deepspeed with use_cpu=True", "accelerate then runs MULTI_CPU (DDP) and never builds "
                               "the DeepSpeed engine", "Pass use_cpu=False (DeepSpeed's CPU accelerator runs on "
                               "gloo on a machine without accelerators)"))
    if args.fsdp:
        out.append(_refuse("fsdp", "FSDP under this Trainer path is not verified yet", "Use DDP (the default), or "
                           "FSDP2 on the dp dim of a DeviceMesh in your own loop with sync_gradients "
                           "(docs/quickstart.md, 'Data parallel x sequence parallel')"))
    if args.parallelism_config is not None:
        # its cp/sp dim becomes usp-hal's sequence-parallel group (USPTrainer.__init__ keeps the
        # config from accelerate, whose cp would run torch's context parallel and sp DeepSpeed's ALST)
        from .engines import parallelism_problem
        why = parallelism_problem(args.parallelism_config)
        if why:
            out.append(_refuse("this ParallelismConfig", why, "Or drop it and set usp_ulysses_degree/usp_ring_degree"))
        if getattr(args, "usp_dynamic_degree", False):
            out.append(_refuse("a ParallelismConfig with usp_dynamic_degree", "the dynamic split builds its own "
                               "groups per global batch", "Use one or the other"))
    if args.train_sampling_strategy == "batch_rebalance":
        # Trainer._get_dataloader makes accelerate's BatchSamplerShard a passthrough for it: each
        # rank would draw its own batches, and the ranks of one sequence must share them
        out.append(_refuse("train_sampling_strategy='batch_rebalance'", "its sampler picks batches per rank, and the "
                           "ranks of one sequence must load the same batch", "Use 'random', 'sequential' or "
                           "'group_by_length'"))
    acc = args.accelerator_config
    for name in ("dispatch_batches", "split_batches"):
        if getattr(acc, name, None):
            out.append(_refuse(f"accelerator_config {name}=True", "the loader is re-sharded over the data-parallel "
                               "replicas, which these modes would split over every rank",
                               f"Leave {name} unset"))
    return out


class _NoCall(dict):
    """A micro-batch with nothing to run (its rows ride on the step's last one)."""


_NO_CALL = _NoCall()


class _DynamicStep(dict):
    """One optimizer step under usp_dynamic_degree: this rank's model calls, one per round."""

    def __init__(self, calls: list, n_items: int, sizes: list):
        super().__init__()
        self.calls, self.n_items, self.sizes = calls, n_items, sizes


def _dtype_of(args) -> str:
    """The dtype a step runs its attention and linear layers in, as the schedule prices it."""
    return "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"


def _dynamic_degree(model, args):
    """The per-batch degree for the model: its whole-step shape from the config, packing as its
    layers allow (usp_hal.integrations.transformers.dynamic_degree)."""
    return usp.dynamic_degree(model, budget_tokens=int(args.usp_budget_tokens), profile=args.usp_profile,
                              dtype=_dtype_of(args), trial_steps=int(getattr(args, "usp_dynamic_trial_steps", 0)),
                              refit_steps=int(getattr(args, "usp_dynamic_refit_steps", 0)))


def _gather_rows(rows: list, lengths: List[int], owner: List[int], world: int) -> list:
    """Every rank's ``(ids, labels)`` rows in rank order: one all-gather of an int64 tensor per
    rank (its rows' ids then labels, padded to the longest rank's), the lengths known to all."""
    per_rank = [0] * world
    for n, r in zip(lengths, owner):
        per_rank[r] += n
    width = 2 * max(per_rank)
    mine = torch.zeros(width, dtype=torch.long)
    if rows:
        flat = torch.cat([ids.reshape(-1) for ids, _ in rows] + [lab.reshape(-1) for _, lab in rows])
        mine[:flat.numel()] = flat.to(torch.long)
    out = torch.empty(width * world, dtype=torch.long)
    dist.all_gather_into_tensor(out, mine)
    seqs, start = [], [0] * world
    for n, r in zip(lengths, owner):
        part = out[r * width:(r + 1) * width]
        a = start[r]
        seqs.append((part[a:a + n].clone(), part[per_rank[r] + a:per_rank[r] + a + n].clone()))
        start[r] += n
    return seqs


def _sequence(batch, i: int):
    """Row ``i`` of a loaded batch as one sequence ``(ids, labels)``, its right padding dropped:
    the positions an ``attention_mask`` masks (right padding only), else the trailing positions
    whose labels are all ignored (no loss reads them, and causality keeps them from the others).
    None for a row with no label."""
    other = sorted(set(batch) - {"input_ids", "labels", "attention_mask"})
    if other or "labels" not in batch:
        raise ValueError(f"USPTrainer (usp_dynamic_degree): a batch of input_ids, labels and attention_mask only "
                         f"(each row one sequence), got {sorted(batch)}; pack documents as separate rows")
    ids, labels = batch["input_ids"][i], batch["labels"][i]
    mask = batch.get("attention_mask")
    if mask is not None:
        m = mask[i].bool()
        n = int(m.sum())
        if not bool(m[:n].all()):
            raise ValueError("USPTrainer (usp_dynamic_degree): rows must be right-padded (padding_side='right')")
    else:
        kept = (labels != usp.IGNORE_INDEX).nonzero()
        n = int(kept.max()) + 1 if kept.numel() else 0
    if n < 2 or not bool((labels[1:n] != usp.IGNORE_INDEX).any()):
        return None
    return ids[:n].cpu(), labels[:n].cpu()


def _whole_batches_off(part) -> None:
    """One replica: the last batch of an epoch as the plain Trainer in one process loads it (short),
    not filled up with rows from the start as accelerate does to give several processes the same
    number of whole batches (it shards over every rank, so it would here although nothing is
    split between replicas)."""
    from accelerate.data_loader import BatchSamplerShard
    if isinstance(part, BatchSamplerShard):
        part.even_batches = False
    else:                         # IterableDatasetShard: every element once, in order
        part.__class__ = _one_replica_stream_class()


def _one_replica_stream_iter(self):
    gen = getattr(self.dataset, "generator", None)
    if not hasattr(self.dataset, "set_epoch") and isinstance(gen, torch.Generator):
        gen.manual_seed(self.epoch)      # the reshuffle per epoch the shard would do
    yield from self.dataset


@functools.lru_cache(maxsize=None)
def _one_replica_stream_class():
    from accelerate.data_loader import IterableDatasetShard
    return type("_OneReplicaStream", (IterableDatasetShard,), {"__iter__": _one_replica_stream_iter,
                                                               "__module__": __name__})


class USPTrainer(Trainer):
    """``transformers.Trainer`` training with usp-hal sequence parallelism (module docstring).

    ``args``: :class:`USPTrainingArguments` (the degrees, layout and kernel backend).  ``mesh``:
    a :class:`usp_hal.SequenceParallelMesh` built beforehand instead (for example from a torch
    DeviceMesh slice, ``usp_hal.init_sequence_parallel(device_mesh=dm["sp"])``); its degrees win
    over the arguments' (which must then be left at 1 or match).  Every other argument is the
    Trainer's.
    """

    _usp_model_loss = True      # each rank's loss is the model's own on its shard (see _refuse_after_init)

    def __init__(self, model=None, args=None, *trainer_args, mesh=None, **trainer_kwargs):
        problems = _args_problems(args) if args is not None else []
        if problems:
            raise problems[0]
        self.usp_parallelism_config = getattr(args, "parallelism_config", None)
        if self.usp_parallelism_config is not None:     # usp-hal's, not accelerate's (see _build_mesh)
            args = copy.copy(args)
            args.parallelism_config = None
        if trainer_args:
            super().__init__(model, args, *trainer_args, **trainer_kwargs)
        else:       # by name: trainers over this one (TRL's) take other arguments second
            super().__init__(model=model, args=args, **trainer_kwargs)
        self._refuse_after_init()
        self.usp_dynamic = None
        if getattr(self.args, "usp_dynamic_degree", False):
            if mesh is not None:
                raise ValueError("USPTrainer: usp_dynamic_degree builds its own groups; drop mesh=")
            self.usp_dynamic = _dynamic_degree(self.model, self.args)
            mesh = self.usp_dynamic.meshes[(1, 1, 1)]       # each rank its own rows, as data parallel over all
        self.usp_mesh = self._build_mesh(mesh)
        self._drop_uneven_last_batch()
        layout = getattr(self.args, "usp_layout", usp.DEFAULT_LAYOUT)
        if self.usp_dynamic is not None:     # one registration serves every job of a schedule
            layout = usp.DYNAMIC_LAYOUT
        self.usp_layout = layout
        self._attn_name = usp.register(f"usp_hal_trainer_{next(_NAMES)}",
                                       mesh=None if self.usp_dynamic is not None else self.usp_mesh, layout=layout,
                                       attn_type=getattr(self.args, "usp_attn_type", "auto"),
                                       low_memory=bool(getattr(self.args, "usp_low_memory", False)),
                                       recurrence=getattr(self.args, "usp_recurrence", "auto"), enable=True)
        self._reduction_checked = False

    # ------------------------------------------------------------------------- set-up
    def _refuse_after_init(self) -> None:
        if self.model_init is not None:
            raise _refuse("model_init", "the model is re-created inside train() (hyperparameter search), after the "
                          "sequence-parallel attention was set on it", "Pass model=")
        if self.compute_loss_func is not None:
            # Trainer.compute_loss hands it the popped labels: here this rank's shard of the
            # already shifted labels, which a causal-LM loss function would shift again
            raise _refuse("compute_loss_func", "it would receive this rank's shard of labels that are already "
                          "shifted over the whole sequence", "Subclass USPTrainer.compute_loss and use "
                          "inputs['shift_labels'] (no further shift), dividing by num_items_in_batch")
        if self.is_fsdp_enabled:
            raise _refuse("an accelerate FSDP launch configuration", "only DDP and DeepSpeed are verified on this "
                          "path", "Launch with torchrun (or an accelerate config without FSDP)")
        if self.args.n_gpu > 1:
            raise _refuse("DataParallel (several GPUs in one process)", "each sequence-parallel rank is one "
                          "process", "Launch one process per device with torchrun")
        model = self.model
        if (getattr(model, "_tp_size", None) or 1) > 1:
            raise _refuse("a tensor-parallel model", "its shards and usp-hal's sequence shards are not composed here",
                          "Load the model without tp_plan")
        if not hasattr(model, "set_attn_implementation"):
            raise _refuse(f"the model {type(model).__name__}", "it is not a transformers PreTrainedModel (no "
                          "set_attn_implementation)", "Pass a transformers model whose attention goes through "
                          "AttentionInterface")
        # Trainer.__init__ (model introspection) reads accepts_loss_kwargs or a **kwargs forward: only
        # then does compute_loss pass num_items_in_batch on to the model's loss (not asked where the
        # loss is computed from gathered outputs: usp_hal.integrations.trl's DPO and GRPO)
        if self._usp_model_loss and not self.model_accepts_loss_kwargs:
            raise _refuse(f"the model {type(model).__name__}", "its forward does not take the loss keyword "
                          "arguments (num_items_in_batch, shift_labels) that make each rank's loss its exact share",
                          "Use a model whose forward takes **kwargs (transformers' causal LMs do)")

    def _build_mesh(self, mesh):
        u = int(getattr(self.args, "usp_ulysses_degree", 1))
        r = int(getattr(self.args, "usp_ring_degree", 1))
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if self.accelerator.num_processes != world and self.is_deepspeed_enabled:
            # PartialState finds no backend for DeepSpeed without an accelerator (state.py's
            # _prepare_backend) and counts one process; a state made beforehand with gloo is reused
            raise ValueError(f"USPTrainer: accelerate sees {self.accelerator.num_processes} process(es) under "
                             f"DeepSpeed but the process group has {world} ranks (no accelerator backend was "
                             "found). On a machine without accelerators set ACCELERATE_USE_DEEPSPEED=true and "
                             "LOCAL_RANK, create "
                             "accelerate.PartialState(cpu=False, backend='gloo') before the arguments and pass "
                             "accelerator_config={'use_configured_state': True}")
        if self.accelerator.num_processes != world:
            # accelerate.state.PartialState._prepare_backend picks MULTI_CPU only with cpu=True: a
            # CPU-only torchrun without use_cpu runs as DistributedType.NO, one process per rank
            raise ValueError(f"USPTrainer: accelerate sees {self.accelerator.num_processes} process(es) "
                             f"({self.accelerator.distributed_type}) but the process group has {world} ranks, so the "
                             "Trainer would neither shard the data nor wrap the model in DDP. On a machine without "
                             "accelerators pass use_cpu=True in the training arguments (accelerate runs gloo ranks "
                             "as MULTI_CPU only then)")
        pc = self.usp_parallelism_config
        if pc is not None:
            if mesh is not None:
                raise ValueError("USPTrainer: pass either mesh= or a ParallelismConfig in the arguments, not both")
            from .engines import parallelism_mesh
            split = (None, None) if (u, r) == (1, 1) else (u, r)       # default: all Ulysses
            self.usp_device_mesh, mesh = parallelism_mesh(pc, ulysses_degree=split[0], ring_degree=split[1],
                                                          device_type=self.args.device.type)
            return mesh
        if mesh is not None:
            if (u, r) not in ((1, 1), (mesh.ulysses_degree, mesh.ring_degree)):
                raise ValueError(f"USPTrainer: mesh= is {mesh.ulysses_degree} x {mesh.ring_degree} (ulysses x ring) "
                                 f"but the arguments say usp_ulysses_degree={u}, usp_ring_degree={r}; leave them at 1 "
                                 "or make them match")
            if mesh.world_size != world:
                raise ValueError(f"USPTrainer: mesh= spans {mesh.world_size} ranks, the process group {world}")
            return mesh
        if not isinstance(self.args, USPTrainingArguments):
            raise ValueError("USPTrainer: pass args=USPTrainingArguments(..., usp_ulysses_degree=, usp_ring_degree=) "
                             "(or mesh=usp_hal.init_sequence_parallel(...)); with plain TrainingArguments there is no "
                             "sequence-parallel degree")
        if world % (u * r):
            raise ValueError(f"USPTrainer: usp_ulysses_degree x usp_ring_degree = {u} x {r} does not divide the "
                             f"{world} ranks (the data-parallel size is world / sp)")
        # the process group exists by now: TrainingArguments' device set-up (accelerate's
        # PartialState) started it under torchrun.  Replicas are runs of u*r consecutive ranks.
        # a second trainer (a sweep in one process) shares this one's process groups
        return usp_hal.init_sequence_parallel(u, r, set_default=False, reuse_groups=True)

    def _drop_uneven_last_batch(self) -> None:
        """Several replicas: accelerate fills an epoch's last, partial batch with rows from the
        start so that every process gets whole batches, which one process would not train on.
        That batch is dropped instead (``dataloader_drop_last``), with a warning that says so."""
        data, dp = self.train_dataset, self.dp_size
        if dp == 1 or self.args.dataloader_drop_last or data is None:
            return
        per_step = self.args.per_device_train_batch_size * dp
        if hasattr(data, "__len__"):
            if len(data) % per_step == 0:
                return
            what = f"the dataset's {len(data)} rows leave a last batch of {len(data) % per_step}"
        else:
            what = "an iterable dataset may leave a last partial batch"
        warnings.warn(f"USPTrainer: {what} for {dp} replicas of {self.args.per_device_train_batch_size} rows; "
                      "accelerate would fill it with repeated rows, which one process would not train on, so it is "
                      f"dropped (dataloader_drop_last=True). Give a multiple of {per_step} rows to train on every "
                      "row.", UserWarning, stacklevel=3)
        self.args.dataloader_drop_last = True

    @property
    def dp_size(self) -> int:
        return self.usp_mesh.dp_degree

    def _dp_index(self) -> int:
        mesh = self.usp_mesh
        if mesh.dp_degree == 1:
            return 0
        return list(dist.get_process_group_ranks(mesh.dp_group)).index(mesh.rank)

    # ------------------------------------------------------------------------- data
    def get_train_dataloader(self):
        """The Trainer's loader, sharded over the data-parallel replicas instead of every rank.

        accelerate's ``prepare_data_loader`` shards over ``num_processes`` (the world) with a
        ``BatchSamplerShard`` (map-style data) or an ``IterableDatasetShard`` (iterable data);
        both read ``num_processes``/``process_index`` at iteration time, so setting them to the
        replica count and index makes every rank of a replica load the same batches.  The Trainer
        does the same to that wrapper for its ``batch_rebalance`` sampler (``Trainer._get_dataloader``).
        """
        return self._per_replica(super().get_train_dataloader())

    def _per_replica(self, loader):
        """``loader`` (accelerate-prepared, sharded over every rank) sharded over the replicas."""
        world = self.accelerator.num_processes
        if world == self.dp_size:           # sp == 1: the Trainer's sharding is already per replica
            return loader
        from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard
        if isinstance(loader, DataLoaderDispatcher):
            raise _refuse("a dispatching data loader (accelerate dispatch_batches, the default for iterable "
                          "datasets)", "rank 0 reads and slices every batch over all ranks", "Pass "
                          "accelerator_config={'dispatch_batches': False} in the training arguments")
        found = []
        for part in (getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None)):
            if isinstance(part, (BatchSamplerShard, IterableDatasetShard)):
                if part.num_processes != world:
                    raise _refuse("this data loader", f"it is sharded over {part.num_processes} processes, not the "
                                  f"{world} ranks accelerate shards over", "Use a map-style dataset or a plain "
                                  "torch IterableDataset")
                part.num_processes, part.process_index = self.dp_size, self._dp_index()
                if self.dp_size == 1:
                    _whole_batches_off(part)
                found.append(part)
        if not found:
            raise _refuse(f"the data loader {type(loader).__name__}", "accelerate did not shard it with a "
                          "BatchSamplerShard or IterableDatasetShard, so its per-replica batches cannot be set (a "
                          "datasets.IterableDataset with several shards is split by the datasets library itself)",
                          "Use a map-style dataset, or one stream that accelerate shards")
        return loader

    def get_total_train_batch_size(self, args) -> int:
        """Rows per optimizer step over all replicas (the Trainer's version divides the world by
        DeepSpeed's ``sp_size``, which is 1 here)."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.dp_size

    def get_batch_samples(self, epoch_iterator, num_batches, device) -> Tuple[list, Optional[Any]]:
        """The step's micro-batches, each sharded along the sequence, and the exact token count.

        ``Trainer._get_num_items_in_batch`` would count ``labels[..., 1:]`` of the loaded batches,
        gather over every rank and divide by DeepSpeed's ``sp_size`` (1 here), so it would count
        each replica sp times and miss the labels that packed boundaries drop.  Here the count is
        what the loss divides by: the non-ignored labels ``shard_batch`` produced (shifted over the
        whole sequence), summed over the micro-batches and the replicas.  The Trainer passes it to
        every micro-batch's ``compute_loss`` as ``num_items_in_batch``.
        """
        loaded = []
        for _ in range(num_batches):
            try:
                loaded.append(next(epoch_iterator))
            except StopIteration:
                break
        if self.usp_dynamic is not None:
            return self._dynamic_samples(loaded, device)
        sharded, count, missing = [], 0, False
        for batch in loaded:
            local = usp.shard_batch(batch, self.usp_mesh, self.usp_layout)
            n = local.pop("num_items_in_batch", None)
            missing = missing or n is None
            count += int(n or 0)
            sharded.append(local)
        if missing and sharded:
            raise ValueError("USPTrainer: a training batch has no labels; each rank's loss is its share of the "
                             "whole sequence's token loss, which needs labels (-100 where nothing is predicted)")
        if not sharded:
            return sharded, None
        total = torch.tensor(count, dtype=torch.int64, device=device)
        if self.usp_mesh.dp_degree > 1:
            dist.all_reduce(total, group=self.usp_mesh.dp_group)
        return sharded, total

    # ------------------------------------------------------------------------- steps
    def _prepare_inputs(self, inputs):
        """The Trainer's device placement, keeping shard_batch's mark on the position ids (a
        moved tensor is a new one; the mark is what makes a model call sequence-parallel)."""
        out = super()._prepare_inputs(inputs)
        pos = inputs.get("position_ids") if hasattr(inputs, "get") else None
        moved = out.get("position_ids") if hasattr(out, "get") else None
        if moved is not pos and getattr(pos, usp.SHARDED_ATTR, False) and isinstance(moved, torch.Tensor):
            setattr(moved, usp.SHARDED_ATTR, True)
            if getattr(pos, usp.PADDING_ATTR, None) is not None:     # a padded batch's global padding
                setattr(moved, usp.PADDING_ATTR, getattr(pos, usp.PADDING_ATTR))
        return out

    def _dynamic_samples(self, loaded: list, device) -> Tuple[list, Optional[Any]]:
        """The step's rows of every rank, scheduled; this rank's model calls, one per round of
        the schedule, prepared (sharded on each job's mesh, in the job's layout).  The rows'
        lengths travel in the schedule's gather (int64, a bad row on any rank refused on every
        rank), their tokens and labels in one all-gather of an int64 tensor.  The Trainer gets
        the calls as its last micro-batch (the others empty), so it syncs once."""
        problem, rows = None, []
        try:
            rows = [r for b in loaded for i in range(int(b["input_ids"].shape[0])) for r in [_sequence(b, i)]
                    if r is not None]
        except ValueError as exc:     # told to every rank with the lengths, so none waits on the others
            problem = str(exc)
        dd = self.usp_dynamic
        assert dd is not None
        lengths, owner = dd.gather_lengths([int(ids.numel()) for ids, _ in rows], problem=problem)
        if not lengths:
            return [], None
        seqs = _gather_rows(rows, lengths, owner, dd.world)
        sched = dd.plan(lengths)
        items = sum(int((labels[1:] != usp.IGNORE_INDEX).sum()) for _, labels in seqs)
        calls: List[Tuple[Any, Any]] = []
        for row in sched.slots():
            job = row[dd.rank]
            if job is None:
                calls.append((None, None))
                continue
            ids = torch.cat([seqs[i][0] for i in job.seqs]).unsqueeze(0)
            labels = torch.cat([seqs[i][1] for i in job.seqs]).unsqueeze(0)
            with dd.on(job) as mesh:
                cu = list(job.cu_seqlens) if job.cu_seqlens else None
                batch = usp.shard_batch({"input_ids": ids, "labels": labels}, mesh, job.cost.layout, cu_seqlens=cu)
            batch.pop("num_items_in_batch", None)
            calls.append((job, batch))
        step = _DynamicStep(calls=calls, n_items=items, sizes=sorted({j.size for j in sched.jobs}))
        samples: List[Any] = [_NO_CALL] * (len(loaded) - 1) + [step]
        return samples, torch.tensor(items, dtype=torch.int64, device=device)

    def _dynamic_step(self, model, step: "_DynamicStep") -> torch.Tensor:
        """Every round's model call on this rank (a two-token stand-in where it has no job, its
        loss times zero, so every rank makes DDP's and the groups' collectives alike); only the
        last backward syncs (DDP's mean over the world, undone by the world-size factor)."""
        import contextlib
        dd = self.usp_dynamic
        assert dd is not None
        model.train()
        world = self.accelerator.num_processes
        total = torch.zeros((), device=self.args.device)
        self.usp_last_sizes = step.sizes
        for k, (job, batch) in enumerate(step.calls):
            sync = contextlib.nullcontext() if k == len(step.calls) - 1 else self.accelerator.no_sync(model)
            with sync:
                with dd.on(job):
                    if job is None:
                        two = torch.zeros(1, 2, dtype=torch.long, device=self.args.device)
                        out = model(input_ids=two, labels=two, num_items_in_batch=step.n_items)
                        loss = out.loss * 0
                    else:
                        out = model(**self._prepare_inputs(batch), num_items_in_batch=step.n_items)
                        loss = out.loss * world
                self.accelerator.backward(loss)
            total = total + loss.detach()
        return total

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.usp_dynamic is not None:
            if inputs is _NO_CALL:             # the step's rows all ride on its last micro-batch
                return torch.zeros((), device=self.args.device)
            loss = self._dynamic_step(model, inputs)
            if self.accelerator.gradient_state.sync_gradients:
                if not self._reduction_checked:
                    self._check_reduction(model)
                    self._reduction_checked = True
                for mesh in self.usp_dynamic.meshes.values():
                    mark_synced(mesh)
            return loss
        if self.is_deepspeed_enabled:
            # accelerate's DeepSpeed backward runs the engine's step too; the engine averages over
            # the world (checked here, before the first one), so the partial-gradient check is off
            # for the call and the mesh marked synced
            if not self._reduction_checked:
                self._check_reduction(model)
                self._reduction_checked = True
            old = set_sync_check("off")
            try:
                loss = super().training_step(model, inputs, num_items_in_batch)
            finally:
                set_sync_check(old)
            mark_synced(self.usp_mesh)
            return loss
        loss = super().training_step(model, inputs, num_items_in_batch)
        # Trainer._run_epoch sets gradient_state's sync flag before the step of each micro-batch:
        # on the last one DDP has just all-reduced the accumulated gradients
        if self.accelerator.gradient_state.sync_gradients:
            if not self._reduction_checked:
                self._check_reduction(model)
                self._reduction_checked = True
            mark_synced(self.usp_mesh)
        return loss

    def _check_reduction(self, model) -> None:
        world = self.accelerator.num_processes
        if world == 1:
            return
        ranks = None
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            ranks = sorted(int(x) for x in dist.get_process_group_ranks(model.process_group))
        from .engines import _group_ranks, engine_problem, is_deepspeed_engine
        if is_deepspeed_engine(model):      # averages over its data-parallel group, as DDP does
            why = engine_problem(model, self.usp_mesh)
            if why:
                raise _refuse("this DeepSpeed engine", why, "Let the Trainer build the engine from args.deepspeed")
            ranks = sorted(_group_ranks(getattr(model, "seq_data_parallel_group", None)))
        if ranks != list(range(world)):
            raise _refuse(f"a model prepared as {type(model).__name__}" + (f" over ranks {ranks}" if ranks else ""),
                          "the exact gradient needs DDP's mean over every rank of the world (each rank's loss is "
                          "scaled by the world size)", "Let the Trainer wrap the model (accelerate's DDP, the "
                          "default)")

    def train(self, *args, **kwargs):
        """``Trainer.train`` with the model's attention set to usp-hal (and, with ``usp_tiled_loss``,
        its loss tiled) for its duration: restored afterwards, so the trained model runs as before
        on one process."""
        model = self.model
        old = model.config._attn_implementation
        tiles = int(getattr(self.args, "usp_tiled_loss", 0) or 0)
        if tiles:       # refused here, before any step, for a model the tiled loss cannot serve
            enable_tiled_loss(model, tiles)
        model.set_attn_implementation(self._attn_name)
        try:
            return super().train(*args, **kwargs)
        finally:
            model.set_attn_implementation(old)
            if tiles:
                disable_tiled_loss(model)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """The evaluation loss, sequence-parallel: ``{f"{metric_key_prefix}_loss": ...}``, equal to
        the plain Trainer's ``evaluate()`` in one process with ``per_device_eval_batch_size`` times
        the replicas rows per batch (the mean over batches, weighted by their rows, of each batch's
        mean token loss).  Each batch is sharded like a training batch; its loss is the sum over
        the sequence-parallel ranks of their share (labels counted over the replicas' batches
        together) and the mean over the replicas.  Logged and passed to the callbacks as the
        Trainer does.  ``compute_metrics`` is refused (it needs every token's logits on one rank),
        and with several replicas the dataset must fill whole global batches (accelerate would
        otherwise repeat samples to even out the last one)."""
        if self.compute_metrics is not None:
            raise _refuse("compute_metrics in evaluate()", "it needs the logits of every token on one rank, and each "
                          "rank holds its shard", "Evaluate the loss here, and metrics with a plain Trainer on one "
                          "process")
        data: Any = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(data, dict):
            return {k: v for name, ds in data.items()
                    for k, v in self.evaluate(ds, ignore_keys, f"{metric_key_prefix}_{name}").items()}
        rows_per_step = self.args.per_device_eval_batch_size * self.dp_size
        if self.dp_size > 1 and hasattr(data, "__len__") and len(data) % rows_per_step:
            raise _refuse(f"evaluate() on {len(data)} samples with {self.dp_size} replicas", "the last global "
                          f"batch of {rows_per_step} rows would be filled with repeated samples",
                          f"Pass a dataset whose size is a multiple of {rows_per_step}")
        loader = self._per_replica(self.get_eval_dataloader(data))
        mesh = self.usp_mesh
        model: Any = self.model
        old, was_training = model.config._attn_implementation, model.training
        model.set_attn_implementation(self._attn_name)
        model.eval()
        total, rows = None, 0
        try:
            with torch.no_grad():
                for batch in loader:
                    local = usp.shard_batch(batch, mesh, self.usp_layout,
                                            dp_group=mesh.dp_group if mesh.dp_degree > 1 else None)
                    n = local.pop("num_items_in_batch", None)
                    if n is None:
                        raise ValueError("USPTrainer.evaluate: an evaluation batch has no labels (the loss needs them)")
                    local = self._prepare_inputs(local)
                    loss = model(**local, num_items_in_batch=n).loss.detach().to(torch.float64).reshape(1)
                    dist.all_reduce(loss, group=mesh.sp_group)
                    if mesh.dp_degree > 1:
                        dist.all_reduce(loss, group=mesh.dp_group)
                        loss /= mesh.dp_degree
                    size = int(batch["input_ids" if "input_ids" in batch else "inputs_embeds"].shape[0]) * self.dp_size
                    total = loss * size if total is None else total + loss * size
                    rows += size
        finally:
            model.set_attn_implementation(old)
            model.train(was_training)
        metrics = {f"{metric_key_prefix}_loss": float(total.item() / rows) if total is not None else float("nan")}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(self, *args, **kwargs):
        raise NotImplementedError("USPTrainer does not predict yet: prediction batches are not sharded along the "
                                  "sequence; predict with a plain Trainer (or the model) on one process")
