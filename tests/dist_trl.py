"""Rank functions for TRL's trainers with usp-hal (tests/test_trl.py).

Every rank builds the same tiny model (Llama or Qwen2, from a config), a local word-level
tokenizer (``t0`` .. ``t255``, no downloads) and the same small synthetic dataset
(``datasets.Dataset.from_dict``), then trains with the usp-hal trainer of
``usp_hal.integrations.trl``; ``*_reference`` trains TRL's plain trainer in the test's own
process on ``dp`` times the rows per batch: the same global batch per optimizer step.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from tests.dist_trainer import MODEL, _flat, _reset_accelerate
from tests.integration_cases import VOCAB, tiny_llama

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}


def offline() -> None:
    os.environ.update(OFFLINE)


def tiny_tokenizer():
    """A word-level tokenizer over ``t0`` .. ``t{VOCAB-1}`` (pad ``t0``, eos ``t1``), built here."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


def tiny_model(kind: str = "llama", seed: int = 0):
    if kind == "llama":
        return tiny_llama(seed, **MODEL)
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=256, attention_dropout=0.0)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.set_attn_implementation("sdpa")
    return model


def _words(g, n: int) -> str:
    return " ".join(f"t{int(x)}" for x in torch.randint(3, VOCAB, (n,), generator=g))


def sft_data(n: int, seed: int = 0):
    """``n`` pre-tokenized documents of 7 to 15 tokens (TRL takes an ``input_ids`` column as it is)."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed + 900)
    lengths = [7 + int(x) for x in torch.randint(0, 9, (n,), generator=g)]
    return Dataset.from_dict({"input_ids": [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lengths]})


def dpo_data(n: int, seed: int = 0):
    """``n`` text preference pairs (prompt 4 to 7 words, chosen and rejected 2 to 8 words)."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed + 950)
    size = lambda lo, hi: lo + int(torch.randint(0, hi - lo + 1, (1,), generator=g))   # noqa: E731
    rows: dict = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(n):
        rows["prompt"].append(_words(g, size(4, 7)))
        rows["chosen"].append(" " + _words(g, size(2, 8)))     # TRL joins prompt and completion as they are
        rows["rejected"].append(" " + _words(g, size(2, 8)))
    return Dataset.from_dict(rows)


def _common(out_dir: str, steps: int, lr: float, seed: int, checkpointing: bool = False) -> dict:
    """Common arguments; TRL's defaults of bf16=True and gradient_checkpointing=True are set off
    (fp32 comparisons), checkpointing back on where a case asks for it."""
    return dict(output_dir=out_dir, max_steps=steps, learning_rate=lr, seed=seed, logging_steps=1,
                save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                max_grad_norm=1.0, bf16=False, gradient_checkpointing=checkpointing)


class Logged:
    """A TrainerCallback (made lazily) keeping the logged loss, grad norm and num_tokens of each step."""

    @staticmethod
    def make():
        from transformers import TrainerCallback

        class Keep(TrainerCallback):
            def __init__(self):
                self.losses, self.grad_norms, self.num_tokens = [], [], []

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    self.losses.append(float(logs["loss"]))
                    self.grad_norms.append(float(logs.get("grad_norm", float("nan"))))
                    self.num_tokens.append(logs.get("num_tokens"))
        return Keep()


class Counts:
    """Calls of the model's attention layers and of usp-hal's attention module during training."""

    def __init__(self, model, trainer=None):
        self.layers = self.usp = 0
        self.handles = []
        for name, mod in model.named_modules():
            if name.endswith("self_attn"):
                self.handles.append(mod.register_forward_pre_hook(self._layer))
        if trainer is not None:
            from usp_hal.integrations import transformers as usp
            attn = usp._FUNCTIONS[trainer._attn_name]._module_for(trainer.usp_mesh)
            self.handles.append(attn.register_forward_pre_hook(self._usp))

    def _layer(self, *a):
        self.layers += 1

    def _usp(self, *a):
        self.usp += 1

    def close(self) -> dict:
        for h in self.handles:
            h.remove()
        return {"layer_calls": self.layers, "usp_calls": self.usp}


def _result(trainer, keep, model, counts, dist) -> dict:
    res = {"losses": keep.losses, "grad_norms": keep.grad_norms, "num_tokens": keep.num_tokens, "dp": trainer.dp_size,
           "attn_after": model.config._attn_implementation, **counts.close()}
    if dist.get_rank() == 0:
        res["params"] = _flat(model)
    return res


def _bypass(trainer) -> None:
    """The negative control: train() sets plain SDPA instead of usp-hal's attention, so each rank
    attends over its own shard only (shard_batch still shards the batch)."""
    trainer._attn_name = "sdpa"


# ----------------------------------------------------------------------------- SFT
def _sft_config(cls, tmp, steps, bs, lr, seed, packing, checkpointing=False, **extra):
    return cls(per_device_train_batch_size=bs, packing=packing, max_length=32, padding_free=packing,
               **_common(tmp, steps, lr, seed, checkpointing), **extra)


def sft_run(U: int = 1, R: int = 2, steps: int = 3, bs: int = 2, seed: int = 0, lr: float = 3e-3,
            packing: bool = True, layout: str = "", kind: str = "llama", bypass: bool = False,
            checkpointing: bool = False):
    """``steps`` optimizer steps of usp_trainer(SFTTrainer) with sp = U x R (dp = the rest).

    The glue in a TRL script (3 lines): the import, ``SFT, Config = usp_trainer(SFTTrainer),
    usp_config(SFTConfig)`` and the ``usp_*`` fields in the config."""
    offline()
    import torch.distributed as dist
    from trl import SFTConfig, SFTTrainer

    from usp_hal.integrations.trl import usp_config, usp_trainer
    SFT, Config = usp_trainer(SFTTrainer), usp_config(SFTConfig)
    dp = dist.get_world_size() // (U * R)
    model = tiny_model(kind, seed)
    keep = Logged.make()
    threads = torch.get_num_threads()
    layout = layout or ("varlen_zigzag" if packing else "zigzag")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = _sft_config(Config, tmp, steps, bs, lr, seed, packing, checkpointing, usp_ulysses_degree=U,
                               usp_ring_degree=R, usp_layout=layout, usp_attn_type="sdpa")
            trainer = SFT(model=model, args=args, train_dataset=sft_data(24 * dp, seed),
                          processing_class=tiny_tokenizer(), callbacks=[keep])
            counts = Counts(model, trainer)
            if bypass:
                _bypass(trainer)
            trainer.train()
    finally:
        _reset_accelerate()
        torch.set_num_threads(threads)
    return _result(trainer, keep, model, counts, dist)


def sft_reference(dp: int = 1, steps: int = 3, bs: int = 2, seed: int = 0, lr: float = 3e-3, packing: bool = True,
                  kind: str = "llama", checkpointing: bool = False):
    offline()
    from trl import SFTConfig, SFTTrainer
    model = tiny_model(kind, seed)
    keep = Logged.make()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = _sft_config(SFTConfig, tmp, steps, bs * dp, lr, seed, packing, checkpointing)
            SFTTrainer(model=model, args=args, train_dataset=sft_data(24 * dp, seed),
                       processing_class=tiny_tokenizer(), callbacks=[keep]).train()
    finally:
        _reset_accelerate()
    return {"losses": keep.losses, "grad_norms": keep.grad_norms, "num_tokens": keep.num_tokens,
            "params": _flat(model)}


def sft_batch(packing: bool = True, n: int = 4):
    """What TRL's collator gives SFTTrainer for ``n`` rows (the batch shard_batch sees)."""
    offline()
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    rows = [{"input_ids": r} for r in sft_data(n)["input_ids"]]
    return DataCollatorForLanguageModeling(pad_token_id=0, padding_free=packing)(rows)


# ----------------------------------------------------------------------------- DPO
def _dpo_config(cls, tmp, steps, bs, lr, seed, **extra):
    return cls(per_device_train_batch_size=bs, beta=0.5, max_length=None,
               **dict(_common(tmp, steps, lr, seed), **extra))


def _optim(name: str) -> dict:
    """The config's ``optim`` when one is named (else the Trainer's default, AdamW)."""
    return {"optim": name} if name else {}


class Trajectory:
    """A TrainerCallback (made lazily) that records the model's parameters at the start of each
    step, or, given ``forced`` (such a record), loads them instead."""

    @staticmethod
    def make(model, forced=None):
        from transformers import TrainerCallback

        class Steps(TrainerCallback):
            def __init__(self):
                self.params: list = []

            def on_step_begin(self, args, state, control, **kwargs):
                if forced is None:
                    self.params.append(_flat(model))
                    return
                with torch.no_grad():
                    torch.nn.utils.vector_to_parameters(forced[state.global_step].float(), model.parameters())
        return Steps()


def dpo_run(U: int = 1, R: int = 2, steps: int = 3, bs: int = 2, seed: int = 0, lr: float = 3e-3,
            kind: str = "llama", bypass: bool = False, optim: str = "",
            max_grad_norm: float = 1.0):
    """``steps`` optimizer steps of usp_trainer(DPOTrainer) with sp = U x R (dp = the rest).

    The glue in a TRL script (3 lines): the import, ``DPO, Config = usp_trainer(DPOTrainer),
    usp_config(DPOConfig)`` and the ``usp_*`` fields in the config (arguments by name)."""
    offline()
    import torch.distributed as dist
    from trl import DPOConfig, DPOTrainer

    from usp_hal.integrations.trl import usp_config, usp_trainer
    DPO, Config = usp_trainer(DPOTrainer), usp_config(DPOConfig)
    dp = dist.get_world_size() // (U * R)
    model, ref = tiny_model(kind, seed), tiny_model(kind, seed)
    keep = Logged.make()
    threads = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = _dpo_config(Config, tmp, steps, bs, lr, seed, usp_ulysses_degree=U, usp_ring_degree=R,
                               usp_attn_type="sdpa", max_grad_norm=max_grad_norm, **_optim(optim))
            path = Trajectory.make(model)
            trainer = DPO(model=model, ref_model=ref, args=args, train_dataset=dpo_data(steps * bs * dp, seed),
                          processing_class=tiny_tokenizer(), callbacks=[keep, path])
            counts = Counts(model, trainer)
            ref_counts = Counts(ref)
            if bypass:
                _bypass(trainer)
            trainer.train()
    finally:
        _reset_accelerate()
        torch.set_num_threads(threads)
    res = _result(trainer, keep, model, counts, dist)
    res["optimizer"] = type(trainer.optimizer.optimizer).__name__
    if dist.get_rank() == 0:
        res["trajectory"] = path.params
    res["ref_layer_calls"] = ref_counts.close()["layer_calls"]
    res["ref_attn_after"] = ref.config._attn_implementation
    return res


def dpo_reference(dp: int = 1, steps: int = 3, bs: int = 2, seed: int = 0, lr: float = 3e-3, kind: str = "llama",
                  optim: str = "", max_grad_norm: float = 1.0, forced: Any = None):
    """TRL's plain DPOTrainer in this process on ``dp`` times the rows per batch.  ``forced``:
    the policy's parameters at the start of each step (another run's trajectory, from
    :class:`Trajectory`), loaded before each step, so that each step's loss and gradient are
    one process's at that run's parameters (no error carried from step to step)."""
    offline()
    from trl import DPOConfig, DPOTrainer
    model, ref = tiny_model(kind, seed), tiny_model(kind, seed)
    keep = Logged.make()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = _dpo_config(DPOConfig, tmp, steps, bs * dp, lr, seed, max_grad_norm=max_grad_norm, **_optim(optim))
            callbacks = [keep] + ([Trajectory.make(model, forced)] if forced is not None else [])
            DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=dpo_data(steps * bs * dp, seed),
                       processing_class=tiny_tokenizer(), callbacks=callbacks).train()
    finally:
        _reset_accelerate()
    return {"losses": keep.losses, "grad_norms": keep.grad_norms, "num_tokens": keep.num_tokens,
            "params": _flat(model)}


# ----------------------------------------------------------------------------- GRPO
def grpo_batches(steps: int, rows: int, seed: int = 0, ranks_per_replica: int = 1) -> list:
    """``steps`` prepared GRPO batches of ``rows`` rows (what ``_generate_and_score_completions``
    returns): prompts of 6 tokens (some left-padded), completions of 3 to 10 tokens
    (right-padded), advantages and the sampling policy's per-token log-probs (off-policy).
    ``num_items_in_batch`` (the dapo/cispo/vespo normaliser) is the completion-token count as
    TRL 1.16's ``_generate_and_score_completions`` makes it (``accelerator.gather(loss_mask.sum()).sum()``),
    which under usp_trainer gathers over the replicas: the global batch's count."""
    g = torch.Generator().manual_seed(seed + 990)
    out = []
    for _ in range(steps):
        P, C = 6, 10
        prompt_ids = torch.randint(3, VOCAB, (rows, P), generator=g)
        prompt_mask = torch.ones(rows, P, dtype=torch.long)
        prompt_mask[::3, :2] = 0            # every third prompt has 2 left pads
        prompt_ids[prompt_mask == 0] = 0
        lens = torch.randint(3, C + 1, (rows,), generator=g)
        completion_mask = (torch.arange(C).view(1, -1) < lens.view(-1, 1)).long()
        completion_ids = torch.randint(3, VOCAB, (rows, C), generator=g) * completion_mask
        out.append({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                    "completion_mask": completion_mask, "advantages": torch.randn(rows, generator=g),
                    "old_per_token_logps": -5.5 + 0.3 * torch.randn(rows, C, generator=g),
                    "num_items_in_batch": completion_mask.sum()})
    return out


def _grpo_trainer(base, config_cls, tmp, model, bs, lr, seed, loss_type="grpo", **extra):
    class Given(base):
        """The training step on given completions: the batch handed to training_step is used as it is."""

        def _prepare_inputs(self, batch):
            return batch
    data = _prompts(8)
    args = config_cls(per_device_train_batch_size=bs, num_generations=2, loss_type=loss_type, beta=0.0,
                      **_common(tmp, 3, lr, seed), **extra)
    return Given(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                 train_dataset=data, processing_class=tiny_tokenizer())


def _prompts(n: int):
    from datasets import Dataset
    return Dataset.from_dict({"prompt": [f"t{3 + i} t{4 + i}" for i in range(n)]})


def _grpo_steps(trainer, model, batches, clip: float = 1.0) -> dict:
    """The Trainer's step by hand: training_step (compute_loss, backward through accelerate's DDP
    when there is one), clipping, AdamW."""
    acc = trainer.accelerator
    wrapped = acc.prepare_model(model) if acc.num_processes > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=trainer.args.learning_rate)
    trainer.current_gradient_accumulation_steps = 1      # what Trainer's loop sets
    losses, norms = [], []
    for batch in batches:
        loss = trainer.training_step(wrapped, batch, None)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        if acc.num_processes > 1:       # the logged loss: the mean over every rank, as Trainer logs it
            loss = acc.gather(loss.detach().reshape(1)).mean()
        losses.append(float(loss))
    return {"losses": losses, "grad_norms": norms}


def grpo_run(U: int = 1, R: int = 2, steps: int = 3, bs: int = 4, seed: int = 0, lr: float = 3e-3,
             kind: str = "llama", bypass: bool = False, loss_type: str = "grpo"):
    """usp_trainer(GRPOTrainer)'s training step on given completions, ``steps`` times, sp = U x R.

    The glue in a TRL script (3 lines, plus the completions it gives): the import,
    ``GRPO, Config = usp_trainer(GRPOTrainer), usp_config(GRPOConfig)`` and the ``usp_*`` fields."""
    offline()
    import torch.distributed as dist
    from trl import GRPOConfig, GRPOTrainer

    from usp_hal.integrations.trl import usp_config, usp_trainer
    world = dist.get_world_size()
    dp = world // (U * R)
    model = tiny_model(kind, seed)
    threads = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = _grpo_trainer(usp_trainer(GRPOTrainer), usp_config(GRPOConfig), tmp, model, bs, lr, seed,
                                    loss_type, usp_ulysses_degree=U, usp_ring_degree=R, usp_attn_type="sdpa")
            counts = Counts(model, trainer)
            if bypass:
                _bypass(trainer)
            replica = trainer._dp_index()
            mine = [{k: v[replica * bs:(replica + 1) * bs] if v.dim() else v for k, v in b.items()}
                    for b in grpo_batches(steps, bs * dp, seed)]
            with trainer.usp_attention():
                res = _grpo_steps(trainer, model, mine)
    finally:
        _reset_accelerate()
        torch.set_num_threads(threads)
    res.update(counts.close(), attn_after=model.config._attn_implementation, dp=dp)
    if dist.get_rank() == 0:
        res["params"] = _flat(model)
    return res


def grpo_reference(dp: int = 1, steps: int = 3, bs: int = 4, seed: int = 0, lr: float = 3e-3, kind: str = "llama",
                   loss_type: str = "grpo"):
    offline()
    from trl import GRPOConfig, GRPOTrainer
    model = tiny_model(kind, seed)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = _grpo_trainer(GRPOTrainer, GRPOConfig, tmp, model, bs * dp, lr, seed, loss_type)
            res = _grpo_steps(trainer, model, grpo_batches(steps, bs * dp, seed))
    finally:
        _reset_accelerate()
    res["params"] = _flat(model)
    return res


# ----------------------------------------------------------------------------- GRPO train()
def grpo_prompts(n: int = 16, seed: int = 0):
    """``n`` text prompts of 2 to 6 words (left-padded to different lengths in a batch)."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed + 970)
    return Dataset.from_dict({"prompt": [_words(g, 2 + int(torch.randint(0, 5, (1,), generator=g)))
                                         for _ in range(n)]})


class Rewards:
    """A reward function of the completion tokens alone (the share of tokens divisible by 3),
    which records the prompts and completions of every call (one per generation batch)."""

    __name__ = "share_of_threes"

    def __init__(self):
        self.calls: list = []

    def __call__(self, prompts, completions, completion_ids, **kw):
        self.calls.append({"prompts": list(prompts), "completion_ids": [list(c) for c in completion_ids]})
        return [sum(1 for t in c if t % 3 == 0) / max(len(c), 1) for c in completion_ids]


class Replayed:
    """Completions given to a one-process GRPOTrainer in place of its generation: the next
    recorded batch, after checking that its prompts are the ones recorded with it."""

    def __init__(self, calls: list):
        self.calls = list(calls)

    def __call__(self, prompt_ids) -> list:
        call = self.calls.pop(0)
        expect = tiny_tokenizer()(text=call["prompts"])["input_ids"]
        assert [list(p) for p in prompt_ids] == expect, (prompt_ids, expect)
        return call["completion_ids"]


def _grpo_config(cls, tmp, steps, bs, lr, seed, beta, loss_type, **extra):
    return cls(per_device_train_batch_size=bs, num_generations=2, max_completion_length=8, beta=beta,
               loss_type=loss_type, **_common(tmp, steps, lr, seed), **extra)


def _grpo_model(kind: str, seed: int, beta: float, tmp: str):
    """The tiny model; for ``beta != 0`` saved first, since TRL loads the reference model from
    the policy's name (``create_model_from_path(config._name_or_path)``): rank 0 saves it (as
    transformers' ``save_pretrained`` does under torch.distributed) in its ``tmp``, which every
    rank then reads.  Its generation config ends a completion at any of 26 tokens, so
    completions differ in length."""
    import torch.distributed as dist
    model = tiny_model(kind, seed)
    model.generation_config.eos_token_id = [1] + list(range(10, VOCAB, 10))
    if beta:
        shared = dist.is_initialized() and dist.get_world_size() > 1
        path = [os.path.join(tmp, "policy")]
        if shared:
            dist.broadcast_object_list(path, src=0)
        if not shared or dist.get_rank() == 0:
            model.save_pretrained(path[0])
        if shared:
            dist.barrier()
        model.config._name_or_path = path[0]
    return model


class ShardedDecodeCounts:
    """Calls of usp-hal's sharded KV cache (``ShardedKVCache.prefill`` / ``.decode``, one per
    attention layer) during the block: the attention calls of sequence-parallel generation
    (they reach the cache, not usp-hal's attention module).  The class methods are wrapped for
    the block and restored."""

    def __init__(self):
        self.prefill = self.decode = 0

    def __enter__(self):
        from usp_hal.serving import ShardedKVCache
        self.cls, self.saved = ShardedKVCache, (ShardedKVCache.prefill, ShardedKVCache.decode)
        prefill, decode = self.saved

        def counted_prefill(cache, *a, **k):
            self.prefill += 1
            return prefill(cache, *a, **k)

        def counted_decode(cache, *a, **k):
            self.decode += 1
            return decode(cache, *a, **k)
        ShardedKVCache.prefill, ShardedKVCache.decode = counted_prefill, counted_decode
        return self

    def __exit__(self, *exc):
        self.cls.prefill, self.cls.decode = self.saved


def grpo_train_run(U: int = 1, R: int = 2, steps: int = 3, bs: int = 4, seed: int = 0, lr: float = 3e-3,
                   kind: str = "llama", beta: float = 0.0, loss_type: str = "grpo", bypass: str = "",
                   steps_per_generation: int = 1) -> dict:
    """``steps`` optimizer steps of ``usp_trainer(GRPOTrainer).train()`` with TRL's own
    transformers generation, sp = U x R (dp = the rest).  ``bypass="training"``: the model
    attends with plain SDPA inside the loss (each rank over its own shard), generation staying
    sequence-parallel; ``bypass="generation"``: TRL's own generation on every rank, each from
    TRL's per-process seed (the ranks of a replica get different completions).

    The glue in a TRL script (3 lines): the import, ``GRPO, Config = usp_trainer(GRPOTrainer),
    usp_config(GRPOConfig)`` and the ``usp_*`` fields in the config."""
    offline()
    import torch.distributed as dist
    from trl import GRPOConfig, GRPOTrainer

    from usp_hal.integrations.trl import usp_config, usp_trainer
    GRPO, Config = usp_trainer(GRPOTrainer), usp_config(GRPOConfig)
    dp = dist.get_world_size() // (U * R)
    keep, rewards = Logged.make(), Rewards()
    threads = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = _grpo_model(kind, seed, beta, tmp)
            args = _grpo_config(Config, tmp, steps, bs, lr, seed, beta, loss_type, usp_ulysses_degree=U,
                                usp_ring_degree=R, usp_attn_type="sdpa", steps_per_generation=steps_per_generation)
            cls = GRPO
            if bypass == "training":
                class Bypassed(GRPO):
                    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                        with _attention(self.model, "sdpa"):
                            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                cls = Bypassed
            elif bypass == "generation":
                class PerRank(GRPO):
                    """TRL's own generation on each rank, from TRL's per-process seed."""

                    def _generate_single_turn(self, *a, **k):
                        from accelerate.utils import set_seed
                        set_seed(self.args.seed + dist.get_rank())
                        with _attention(self.model, "sdpa"):
                            return GRPOTrainer._generate_single_turn(self, *a, **k)
                cls = PerRank
            trainer = cls(model=model, reward_funcs=rewards, args=args, train_dataset=grpo_prompts(16, seed),
                          processing_class=tiny_tokenizer(), callbacks=[keep])
            seed_after_init = torch.initial_seed()
            counts = Counts(model, trainer)
            ref = getattr(trainer, "ref_model", None)
            ref_counts = Counts(ref) if ref is not None else None
            error = None
            with ShardedDecodeCounts() as cached:
                try:
                    trainer.train()
                except ValueError as exc:
                    if bypass != "generation":
                        raise
                    error = str(exc)
    finally:
        _reset_accelerate()
        torch.set_num_threads(threads)
    res = {"losses": keep.losses, "grad_norms": keep.grad_norms, "num_tokens": keep.num_tokens, "dp": dp,
           "replica": trainer._dp_index(), "initial_seed": seed_after_init, "calls": rewards.calls,
           "attn_after": model.config._attn_implementation,
           "generation_batch_size": args.generation_batch_size, "prefill_calls": cached.prefill,
           "decode_calls": cached.decode, "error": error, **counts.close()}
    if ref_counts is not None:
        res["ref_layer_calls"] = ref_counts.close()["layer_calls"]
        res["ref_attn_after"] = ref.config._attn_implementation
    if dist.get_rank() == 0:
        res["params"] = _flat(model)
    return res


class _attention:
    """A model's attention implementation set to ``name`` for the block."""

    def __init__(self, model, name):
        self.model, self.name = model, name

    def __enter__(self):
        self.old = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.name)

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.old)


def grpo_train_reference(dp: int = 1, steps: int = 3, bs: int = 4, seed: int = 0, lr: float = 3e-3,
                         kind: str = "llama", beta: float = 0.0, loss_type: str = "grpo",
                         completions: Any = None, steps_per_generation: int = 1) -> dict:
    """TRL's plain GRPOTrainer in this process on ``dp`` times the rows per step: its own
    generation, or with ``completions`` (the replicas' recorded calls, joined per step in
    replica order) given in its place."""
    offline()
    from trl import GRPOConfig, GRPOTrainer
    keep, rewards = Logged.make(), Rewards()
    replay = Replayed(completions) if completions is not None else None

    class Given(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            if replay is None:
                return super()._generate_single_turn(prompt_ids, *args, **kwargs)
            return replay(prompt_ids), None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = _grpo_model(kind, seed, beta, tmp)
            args = _grpo_config(GRPOConfig, tmp, steps, bs * dp, lr, seed, beta, loss_type,
                                steps_per_generation=steps_per_generation)
            Given(model=model, reward_funcs=rewards, args=args, train_dataset=grpo_prompts(16, seed),
                  processing_class=tiny_tokenizer(), callbacks=[keep]).train()
    finally:
        _reset_accelerate()
    return {"losses": keep.losses, "grad_norms": keep.grad_norms, "num_tokens": keep.num_tokens,
            "calls": rewards.calls, "params": _flat(model)}


def initial_params(kind: str = "llama", seed: int = 0) -> torch.Tensor:
    return _flat(tiny_model(kind, seed))


def refusal(what: str) -> Any:
    """The error a usp-hal TRL trainer gives for ``what`` on this rank (None if it gives none)."""
    offline()
    import torch.distributed as dist  # noqa: F401
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

    from usp_hal.integrations.trl import usp_config, usp_trainer
    try:
        with tempfile.TemporaryDirectory() as tmp:
            common = dict(_common(tmp, 1, 1e-3, 0), usp_ring_degree=2, usp_attn_type="sdpa")
            model = tiny_model()
            if what == "precompute_ref_log_probs":
                usp_trainer(DPOTrainer)(model=model, ref_model=tiny_model(), processing_class=tiny_tokenizer(),
                                        args=usp_config(DPOConfig)(precompute_ref_log_probs=True, **common),
                                        train_dataset=dpo_data(4))
            elif what == "no_ref_model":
                usp_trainer(DPOTrainer)(model=model, args=usp_config(DPOConfig)(**common),
                                        processing_class=tiny_tokenizer(), train_dataset=dpo_data(4))
            elif what == "use_vllm":
                usp_trainer(GRPOTrainer)(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                         args=usp_config(GRPOConfig)(use_vllm=True, **common),
                                         processing_class=tiny_tokenizer(), train_dataset=_prompts(4))
            elif what in ("continuous_batching", "tools"):
                extra = dict(tools=[len]) if what == "tools" else {}
                config = usp_config(GRPOConfig)(use_transformers_continuous_batching=what == "continuous_batching",
                                                **common)
                usp_trainer(GRPOTrainer)(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                         args=config, processing_class=tiny_tokenizer(), train_dataset=_prompts(4),
                                         **extra)
            elif what == "moe_router_loss":
                from transformers import MixtralConfig, MixtralForCausalLM
                from trl import SFTConfig, SFTTrainer
                moe = MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                       num_attention_heads=4, num_key_value_heads=2,
                                                       num_local_experts=2, num_experts_per_tok=1, vocab_size=VOCAB))
                usp_trainer(SFTTrainer)(model=moe, args=usp_config(SFTConfig)(**common),
                                        processing_class=tiny_tokenizer(), train_dataset=sft_data(4))
            elif what == "parallelism_config_cp":        # TRL's context-parallel route (accelerate's)
                from accelerate import ParallelismConfig
                from trl import SFTConfig, SFTTrainer
                args = usp_config(SFTConfig)(parallelism_config=ParallelismConfig(cp_size=2), **common)
                usp_trainer(SFTTrainer)(model=model, args=args, processing_class=tiny_tokenizer(),
                                        train_dataset=sft_data(4))
            elif what == "positional":
                usp_trainer(DPOTrainer)(model, tiny_model())
            else:
                raise KeyError(what)
    except (ValueError, TypeError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        _reset_accelerate()
    return None


def seq_idx_shards(layout: str = "varlen_zigzag", U: int = 1, R: int = 2) -> dict:
    """shard_batch on TRL's padding-free batch (with ``seq_idx``): this rank's seq_idx, and the
    documents its tokens' global positions fall in; then the error for a seq_idx that does not
    match the boundaries."""
    import usp_hal
    from usp_hal.integrations import transformers as usp
    mesh = usp_hal.init_sequence_parallel(U, R, set_default=False)
    batch = sft_batch(packing=True, n=4)
    cu = batch["cu_seq_lens_q"].tolist()
    local = usp.shard_batch(batch, mesh, layout)
    pos = usp_hal.shard(torch.arange(cu[-1]).view(1, -1), layout, mesh, cu_seqlens=cu)[0]
    docs = torch.bucketize(pos, torch.tensor(cu[1:]), right=True)
    res = {"seq_idx": local["seq_idx"][0].tolist(), "docs": docs.tolist(), "n_docs": len(cu) - 1,
           "dtype": str(local["seq_idx"].dtype)}
    bad = dict(batch, seq_idx=torch.zeros_like(batch["seq_idx"]))
    try:
        usp.shard_batch(bad, mesh, layout)
    except ValueError as exc:
        res["bad"] = str(exc)
    return res


def plain_sft_refused(U: int = 1, R: int = 2) -> dict:
    """A plain SFTTrainer on a model whose attention is usp-hal's: the error each rank gets."""
    offline()
    from trl import SFTConfig, SFTTrainer

    import usp_hal
    from usp_hal.integrations import transformers as usp
    mesh = usp_hal.init_sequence_parallel(U, R, set_default=False)
    name = usp.register("usp_hal_test_plain_sft", mesh=mesh, attn_type="sdpa", enable=True)
    model = tiny_model()
    model.set_attn_implementation(name)
    threads = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = _sft_config(SFTConfig, tmp, 1, 2, 1e-3, 0, True)
            SFTTrainer(model=model, args=args, train_dataset=sft_data(8), processing_class=tiny_tokenizer()).train()
    except ValueError as exc:
        return {"error": str(exc)}
    finally:
        _reset_accelerate()
        torch.set_num_threads(threads)
    return {"error": None}
