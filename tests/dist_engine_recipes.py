"""The recipes of examples/engines/ run on a WorkerPool's ranks, and each one's single-process
reference: the same model, data and settings (read from the recipe module itself) trained by the
engine without usp-hal in one process (tests/test_engine_recipes.py).

A recipe is a script with ``main(**degrees) -> dict`` (losses, gradient norms and, on every rank,
the parameters; or for the yunchang alias the output and gradients) and module-level builders
(``build_model``, ``dataset``/``batches``, its constants) that the reference reuses."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

from tests.dist_trl import OFFLINE

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "engines"


def load(name: str) -> ModuleType:
    """examples/engines/<name>.py as a fresh module (its top level runs)."""
    spec = importlib.util.spec_from_file_location(f"engine_recipe_{name}", RECIPES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _restore_env(saved: dict) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def yunchang_set_aside():
    """Any yunchang modules of this process set aside (the alias refuses to install over them),
    the alias removed and they put back after."""
    from usp_hal.compat import alias
    saved = {n: m for n, m in sys.modules.items() if n == "yunchang" or n.startswith("yunchang.")}
    for n in saved:
        del sys.modules[n]
    try:
        yield
    finally:
        alias.remove_yunchang_alias()
        sys.modules.update(saved)


def run(name: str, **kwargs) -> dict:
    """The recipe's ``main(**kwargs)`` on this rank, leaving the pool's worker as it found it
    (accelerate's singletons, the environment, torch's thread count, the yunchang modules)."""
    from tests.dist_trainer import _reset_accelerate
    saved = {k: os.environ.get(k) for k in ("ACCELERATE_USE_DEEPSPEED", "LOCAL_RANK", *OFFLINE)}
    os.environ.update(OFFLINE)
    threads = torch.get_num_threads()
    try:
        with yunchang_set_aside():
            res = load(name).main(**kwargs)
    finally:
        _reset_accelerate()
        torch.set_num_threads(threads)
        _restore_env(saved)
    res = dict(res)
    if dist.get_rank() != 0:            # the parameters travel back from rank 0 only
        res.pop("params", None)
    return res


# ----------------------------------------------------------------------------- references (one process)
def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])


def loop_reference(name: str, dp: int) -> dict:
    """accelerate_loop / deepspeed_loop: the plain model, AdamW, the gradient norm clipped at
    MAX_NORM, on each step's global batch (every replica's rows: DistributedSampler without
    shuffling gives step i the rows [i*B*dp, (i+1)*B*dp))."""
    r = load(name)
    model = r.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=r.LR)
    data = r.dataset(r.STEPS * r.BATCH * dp)
    losses, norms = [], []
    for i in range(r.STEPS):
        rows = data[i * r.BATCH * dp:(i + 1) * r.BATCH * dp]
        ids = torch.stack([row["input_ids"] for row in rows])
        out = model(input_ids=ids, labels=torch.stack([row["labels"] for row in rows]))
        out.loss.backward()
        losses.append(float(out.loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), r.MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grad_norms": norms, "params": _flat(model), "initial": _flat(r.build_model())}


def trainer_reference(name: str, dp: int) -> dict:
    """accelerate_trainer / deepspeed_trainer: transformers' plain Trainer with the recipe's
    arguments (without DeepSpeed and the ParallelismConfig) on ``BATCH * dp`` rows a step."""
    from transformers import Trainer, TrainingArguments

    from tests.dist_trainer import _reset_accelerate
    r = load(name)
    model, logged = r.build_model(), r.Logged()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(**{"use_cpu": True, **r.config(tmp, per_device_train_batch_size=r.BATCH * dp)})
            Trainer(model=model, args=args, train_dataset=r.dataset(r.ROWS), callbacks=[logged]).train()
    finally:
        _reset_accelerate()
    return {"losses": logged.losses, "grad_norms": logged.grad_norms, "params": _flat(model),
            "initial": _flat(r.build_model())}


def trl_reference(name: str, dp: int) -> dict:
    """trl_sft / trl_dpo: TRL's plain trainer with the recipe's arguments on ``BATCH * dp`` rows a
    step (DPO: the same reference model, which plain TRL would also copy from the policy)."""
    import trl

    from tests.dist_trainer import _reset_accelerate
    os.environ.update(OFFLINE)
    r = load(name)
    kind = "SFT" if name == "trl_sft" else "DPO"
    trainer_cls, config_cls = getattr(trl, f"{kind}Trainer"), getattr(trl, f"{kind}Config")
    model, logged = r.build_model(), r.Logged()
    extra = {"ref_model": r.build_model()} if kind == "DPO" else {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = config_cls(**r.config(tmp, per_device_train_batch_size=r.BATCH * dp))
            trainer_cls(model=model, args=args, train_dataset=r.dataset(r.ROWS), processing_class=r.tokenizer(),
                        callbacks=[logged], **extra).train()
    finally:
        _reset_accelerate()
    return {"losses": logged.losses, "grad_norms": logged.grad_norms, "params": _flat(model),
            "initial": _flat(r.build_model())}


def torchtitan_reference(name: str, dp: int) -> dict:
    """torchtitan_llama: the same model unmodified in one process, every document of every row
    of every replica run alone (what torchtitan's document masks compute; checked in
    tests/test_engines_torchtitan.py), the loss over the global tokens, AdamW, clipping."""
    from tests.dist_torchtitan import _clip, documents_of
    r = load(name)
    model = r.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=r.LR)
    data = r.batches(dp)
    tokens = sum(int((labels != -100).sum()) for _, labels, _ in data)
    losses, norms = [], []
    for _ in range(r.STEPS):
        loss = torch.zeros(())
        for ids, labels, positions in data:
            for b in range(ids.shape[0]):
                for start, end in documents_of(positions[b]):
                    logits = model(ids[b:b + 1, start:end])
                    loss = loss + torch.nn.functional.cross_entropy(logits[0], labels[b, start:end],
                                                                    ignore_index=-100, reduction="sum")
        loss = loss / tokens
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(_clip(list(model.parameters()), r.MAX_NORM))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grad_norms": norms, "params": _flat(model), "initial": _flat(r.build_model())}


def fla_reference(name: str, dp: int) -> dict:
    """fla_gdn: the same model with fla's kernel over the whole sequence, in one process."""
    r = load(name)
    model = r.build_model()
    ids, labels = r.batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=r.LR)
    losses, norms = [], []
    for _ in range(r.STEPS):
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), r.MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grad_norms": norms, "params": _flat(model), "initial": _flat(r.build_model())}


def yunchang_reference(name: str, dp: int) -> dict:
    """yunchang_alias: the same block in one process, torch's SDPA over the whole joint sequence
    (no yunchang, no usp-hal), in float64."""
    with yunchang_set_aside():
        r = load(name)                      # its top level installs the alias; the block is built without it

    def sdpa(q, k, v):
        t = lambda x: x.transpose(1, 2)     # noqa: E731
        return t(torch.nn.functional.scaled_dot_product_attention(t(q), t(k), t(v)))
    model = r.build_model(sdpa).double()
    x = r.latents().double().requires_grad_()
    out = model(x)
    out.backward(torch.ones_like(out))
    return {"output": out.detach(), "input_grad": x.grad,
            "weight_grads": torch.cat([p.grad.reshape(-1) for p in model.parameters()])}


REFERENCES = {"trl_sft": trl_reference, "trl_dpo": trl_reference, "accelerate_loop": loop_reference,
              "deepspeed_loop": loop_reference, "accelerate_trainer": trainer_reference,
              "deepspeed_trainer": trainer_reference, "torchtitan_llama": torchtitan_reference,
              "fla_gdn": fla_reference, "yunchang_alias": yunchang_reference}
