"""Rank functions for the HF Trainer path (tests/test_trainer.py).

Every rank builds the same tiny Llama (from a config, no downloads) and the same small dataset of
right-padded rows (pads labelled -100, no attention mask) whose rows hold different numbers of
labels, so the replicas of one step hold different token counts and only an exactly normalised
loss matches one process.  ``trainer_run`` trains it with :class:`USPTrainer` on the workers;
``reference_run`` trains it with the plain Trainer in one process (the test's own), on batches of
``dp`` times the rows: the same global batch per optimizer step."""
from __future__ import annotations

import tempfile
import warnings
from typing import Any

import torch

from tests.integration_cases import VOCAB, tiny_llama

MODEL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2)


def _reset_accelerate():
    """Leave no accelerate singleton behind (the process group itself stays): the pool is shared."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class RaggedRows(torch.utils.data.Dataset):
    """``n`` rows of ``S`` tokens; row i has ``S - i % 7`` real tokens (then pads, labels -100),
    and every third row also has its first 3 labels -100 (a prompt).  ``packed``: the rows without
    their pads, for ``DataCollatorWithFlattening`` (one packed row per batch)."""

    def __init__(self, n: int, S: int, seed: int = 0, packed: bool = False, vocab: int = VOCAB):
        g = torch.Generator().manual_seed(seed + 500)
        self.rows = []
        for i in range(n):
            ids = torch.randint(1, vocab, (S,), generator=g)
            labels = ids.clone()
            real = S - i % 7
            ids[real:] = 0
            labels[real:] = -100
            if i % 3 == 0:
                labels[:3] = -100
            if packed:
                ids, labels = ids[:real], labels[:real]
            self.rows.append({"input_ids": ids, "labels": labels})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class _Stream(torch.utils.data.IterableDataset):
    """A map-style dataset's rows as a stream (no length)."""

    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data.rows)


class _Losses:
    """A TrainerCallback (built lazily: transformers is imported inside the functions) that keeps
    each logged loss."""

    @staticmethod
    def make():
        from transformers import TrainerCallback

        class Keep(TrainerCallback):
            def __init__(self):
                self.losses, self.grad_norms = [], []

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    self.losses.append(float(logs["loss"]))
                    self.grad_norms.append(float(logs.get("grad_norm", float("nan"))))
        return Keep()


def _collator(packed: bool):
    if not packed:
        return None
    from transformers import DataCollatorWithFlattening
    return DataCollatorWithFlattening()      # input_ids, labels, position_ids restarting per row


def _common(out_dir: str, steps: int, ga: int, lr: float, seed: int) -> dict:
    return dict(output_dir=out_dir, max_steps=steps, gradient_accumulation_steps=ga, learning_rate=lr, seed=seed,
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                dataloader_num_workers=0, max_grad_norm=1.0)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])


class _TiledCalls:
    """A callback that reads, at each step's end, how many losses the model computed in tiles."""

    @staticmethod
    def make(model):
        from transformers import TrainerCallback

        class Calls(TrainerCallback):
            calls = 0

            def on_step_end(self, args, state, control, **kw):
                t = getattr(model, "_usp_tiled_loss", None)
                self.calls = t.calls if t is not None else 0
        return Calls()


def trainer_run(U: int = 1, R: int = 2, steps: int = 4, ga: int = 1, bs: int = 2, S: int = 24, seed: int = 0,
                lr: float = 3e-3, layout: str = "zigzag", packed: bool = False, bf16: bool = False,
                low_memory: bool = False, tiled_loss: int = 0, rows: int = 0, iterable: bool = False):
    """``steps`` optimizer steps of USPTrainer with sp = U x R on every rank of the pool (dp = the
    rest).  Returns each rank's logged losses; rank 0 adds the final parameters.  ``rows``: the
    dataset's size (default: whole batches for every step); ``iterable``: as a torch
    IterableDataset."""
    import torch.distributed as dist

    from usp_hal.integrations.training.trainer import USPTrainer, USPTrainingArguments

    world = dist.get_world_size()
    dp = world // (U * R)
    model = tiny_llama(seed, **MODEL)
    data: Any = RaggedRows(rows or steps * ga * bs * dp, S, seed, packed)
    if iterable:
        data = _Stream(data)
    keep = _Losses.make()
    threads = torch.get_num_threads()      # accelerate's MULTI_CPU set-up may change it: the pool is shared
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = USPTrainingArguments(usp_ulysses_degree=U, usp_ring_degree=R, usp_layout=layout,
                                        usp_attn_type="sdpa", per_device_train_batch_size=bs, bf16=bf16,
                                        usp_low_memory=low_memory, usp_tiled_loss=tiled_loss,
                                        **_common(tmp, steps, ga, lr, seed),
                                        **({"accelerator_config": {"dispatch_batches": False}} if iterable else {}))
            tiled = _TiledCalls.make(model)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer = USPTrainer(model=model, args=args, train_dataset=data, callbacks=[keep, tiled],
                                     data_collator=_collator(packed))
            caught = [w for w in caught if "USPTrainer" in str(w.message)]
            out = trainer.train()
    finally:
        _reset_accelerate()
        torch.set_num_threads(threads)
    res = {"losses": keep.losses, "grad_norms": keep.grad_norms, "dp": trainer.dp_size,
           "drop_last": trainer.args.dataloader_drop_last, "warned": [str(w.message) for w in caught],
           "attn_after": model.config._attn_implementation, "train_loss": float(out.training_loss),
           "tiled_after": getattr(model, "_usp_tiled_loss", None) is not None, "tiled_calls": tiled.calls}
    from usp_hal.integrations import transformers as usp
    res["module_low_memory"] = usp._FUNCTIONS[trainer._attn_name]._module_for(trainer.usp_mesh).low_memory
    if dist.get_rank() == 0:
        res["params"] = _flat(model)
    return res


def reference_run(dp: int = 1, steps: int = 4, ga: int = 1, bs: int = 2, S: int = 24, seed: int = 0,
                  lr: float = 3e-3, packed: bool = False, bf16: bool = False, rows: int = 0,
                  iterable: bool = False, drop_last: bool = False):
    """The same training with the plain Trainer in this process (no process group): ``bs * dp``
    rows per micro-batch, the global batch of one optimizer step of ``trainer_run``."""
    from transformers import Trainer, TrainingArguments

    model = tiny_llama(seed, **MODEL)
    data: Any = RaggedRows(rows or steps * ga * bs * dp, S, seed, packed)
    if iterable:
        data = _Stream(data)
    keep = _Losses.make()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(per_device_train_batch_size=bs * dp, bf16=bf16, dataloader_drop_last=drop_last,
                                     **_common(tmp, steps, ga, lr, seed))
            Trainer(model=model, args=args, train_dataset=data, callbacks=[keep],
                    data_collator=_collator(packed)).train()
    finally:
        _reset_accelerate()
    return {"losses": keep.losses, "grad_norms": keep.grad_norms, "params": _flat(model)}


def initial_params(seed: int = 0) -> torch.Tensor:
    return _flat(tiny_llama(seed, **MODEL))


def evaluate_run(U: int = 1, R: int = 2, n: int = 8, bs: int = 2, S: int = 24, seed: int = 0):
    """USPTrainer.evaluate() on ``n`` ragged rows (different label counts per row) on every rank of
    the pool."""
    import torch.distributed as dist

    from usp_hal.integrations.training.trainer import USPTrainer, USPTrainingArguments

    world = dist.get_world_size()
    dp = world // (U * R)
    model = tiny_llama(seed, **MODEL)
    data = RaggedRows(n, S, seed + 1)
    threads = torch.get_num_threads()
    res = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = USPTrainingArguments(usp_ulysses_degree=U, usp_ring_degree=R, usp_attn_type="sdpa",
                                        per_device_eval_batch_size=bs, **_common(tmp, 1, 1, 1e-3, seed))
            trainer = USPTrainer(model=model, args=args)
            res["eval_loss"] = trainer.evaluate(data)["eval_loss"]
            res["odd"] = None
            if dp > 1:
                try:
                    trainer.evaluate(RaggedRows(n + 1, S, seed + 1))
                except ValueError as exc:
                    res["odd"] = str(exc)
    finally:
        _reset_accelerate()
        torch.set_num_threads(threads)
    res["attn_after"] = model.config._attn_implementation
    return res


def evaluate_reference(dp: int = 1, n: int = 8, bs: int = 2, S: int = 24, seed: int = 0):
    """The plain Trainer's evaluate() of ``evaluate_run``'s model and rows in this process (no
    process group), ``bs * dp`` rows per batch; and with the whole set in one batch."""
    from transformers import Trainer, TrainingArguments

    data = RaggedRows(n, S, seed + 1)
    res = {}
    ref = tiny_llama(seed, **MODEL)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(per_device_eval_batch_size=bs * dp, **_common(tmp, 1, 1, 1e-3, seed))
            res["ref_loss"] = Trainer(model=ref, args=args).evaluate(data)["eval_loss"]
            # the token-weighted mean over the whole set differs (a check that batches are kept apart)
            args = TrainingArguments(per_device_eval_batch_size=n, **_common(tmp, 1, 1, 1e-3, seed))
            res["one_batch_loss"] = Trainer(model=ref, args=args).evaluate(data)["eval_loss"]
    finally:
        _reset_accelerate()
    return res


class TailRows(torch.utils.data.Dataset):
    """Rows of long-tailed lengths (``LENGTHS``, in order), right-padded to ``S`` (pads labelled
    -100, no attention mask): with sequential sampling every optimizer step of 4 ranks x 3 rows
    holds all of them, so the per-batch split uses groups of 4, 2 and 1 rank in every step."""

    LENGTHS = (60, 30, 21, 15, 14, 13, 12, 11, 9, 7, 5, 4)

    def __init__(self, steps: int, S: int = 64, seed: int = 0, vocab: int = VOCAB, lengths=None):
        g = torch.Generator().manual_seed(seed + 700)
        self.rows = []
        for _ in range(steps):
            for n in lengths or self.LENGTHS:
                ids = torch.zeros(S, dtype=torch.long)
                ids[:n] = torch.randint(1, vocab, (n,), generator=g)
                labels = torch.full((S,), -100, dtype=torch.long)
                labels[:n] = ids[:n]
                self.rows.append({"input_ids": ids, "labels": labels})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def dynamic_trainer_run(steps: int = 3, bs: int = 3, seed: int = 0, lr: float = 3e-3, budget: int = 16,
                        lengths=None, trial_steps: int = 0, refit_steps: int = 0):
    """USPTrainer with usp_dynamic_degree on every rank of the pool (each rank loads its own rows);
    returns the logged losses and grad norms, the group sizes of the last step and, on rank 0,
    the final parameters."""
    import torch.distributed as dist

    from usp_hal.integrations.training.trainer import USPTrainer, USPTrainingArguments
    model = tiny_llama(seed, **MODEL)
    keep = _Losses.make()
    threads = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = USPTrainingArguments(usp_dynamic_degree=True, usp_budget_tokens=budget, usp_profile="cpu-4ranks",
                                        usp_dynamic_trial_steps=trial_steps, usp_dynamic_refit_steps=refit_steps,
                                        usp_attn_type="sdpa", per_device_train_batch_size=bs,
                                        train_sampling_strategy="sequential", **_common(tmp, steps, 1, lr, seed))
            trainer = USPTrainer(model=model, args=args, train_dataset=TailRows(steps, seed=seed, lengths=lengths),
                                 callbacks=[keep])
            trainer.train()
    finally:
        _reset_accelerate()
        torch.set_num_threads(threads)
    res = {"losses": keep.losses, "grad_norms": keep.grad_norms, "sizes": trainer.usp_last_sizes,
           "attn_after": model.config._attn_implementation}
    trial = trainer.usp_dynamic.trial
    if trial is not None:
        res["trial"] = {"samples": trial.samples, "split": trial.split, "decided": trial.decided}
    refit = trainer.usp_dynamic.refit
    if refit is not None:
        res["refit"] = {"window": list(refit.samples), "factors": dict(refit.model.part_scale)}
    if dist.get_rank() == 0:
        res["params"] = _flat(model)
    return res


def dynamic_reference_run(world: int = 4, steps: int = 3, bs: int = 3, seed: int = 0, lr: float = 3e-3, lengths=None):
    """The plain Trainer in this process on the same rows, ``world * bs`` rows per step."""
    from transformers import Trainer, TrainingArguments
    model = tiny_llama(seed, **MODEL)
    keep = _Losses.make()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(per_device_train_batch_size=bs * world, train_sampling_strategy="sequential",
                                     **_common(tmp, steps, 1, lr, seed))
            Trainer(model=model, args=args, train_dataset=TailRows(steps, seed=seed, lengths=lengths),
                    callbacks=[keep]).train()
    finally:
        _reset_accelerate()
    return {"losses": keep.losses, "grad_norms": keep.grad_norms, "params": _flat(model)}
