"""Rank functions for usp-hal sequence parallelism under DeepSpeed ZeRO (tests/test_engines_deepspeed.py).

4 ranks = dp 2 x sp 2 (Ulysses 2) from one ``init_device_mesh("cpu", (2, 2), ("dp", "sp"))``.
:func:`engine_loop` trains a tiny Llama with one loop whose only switch is how the model was
wrapped: a DeepSpeed engine of ZeRO stage 1, 2 or 3 (``deepspeed.initialize`` with torch AdamW as
the client optimizer, DeepSpeed's CPU accelerator, gloo), or FSDP2's ``fully_shard`` on the dp dim.
The loop's glue for usp-hal is 3 lines (``engines.backward``, ``engines.reduce_gradients``,
``engines.step``) beside ``shard_batch``.  The reference, on rank 0, trains the same model in one
process on both replicas' batches (loss, gradient norm before clipping at 1.0, parameters).

:func:`trainer_run` is USPTrainer with ``args.deepspeed`` a ZeRO config dict (and
``use_cpu=False``: with ``use_cpu=True`` accelerate 1.15.0 runs MULTI_CPU and never builds the
engine)."""
from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch.distributed as dist

import usp_hal
from tests.dist_dp_sp import _meshes
from tests.integration_cases import _batches, _max_diff, tiny_llama

_DM: dict = {}
LR = 2e-3
MAX_NORM = 1.0


def ds_config(stage: int, micro: int = 1, ga: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": ga,
            "gradient_clipping": MAX_NORM, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}


def _wrap(model, engine: str, dm):
    """(model or engine, optimizer): 'zero1'..'zero3' a DeepSpeed engine, 'fsdp' FSDP2 on dm['dp']."""
    if engine.startswith("zero"):
        import deepspeed
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        eng, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(int(engine[-1])))
        return eng, ds_opt
    from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer, mesh=dm["dp"])
    fully_shard(model, mesh=dm["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _params(model) -> torch.Tensor:
    """Every parameter whole, flattened, in float64 (a ZeRO-3 engine gathers its partitions)."""
    if hasattr(model, "module") and any(hasattr(p, "ds_id") for p in model.module.parameters()):
        import deepspeed
        params = list(model.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            return torch.cat([p.detach().double().reshape(-1).clone() for p in params])
    inner = getattr(model, "module", model)
    return torch.cat([_full(p).detach().double().reshape(-1) for p in inner.parameters()])


def one_process(seed: int, ids: torch.Tensor, steps: int, layers: int):
    """The reference: ``steps`` AdamW steps of the plain model on ``ids`` (every replica's rows),
    clipped at MAX_NORM; (losses, gradient norms before clipping, final parameters)."""
    ref = tiny_llama(seed, num_hidden_layers=layers)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses, norms = [], []
    for _ in range(steps):
        out = ref(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return losses, norms, torch.cat([p.detach().double().reshape(-1) for p in ref.parameters()])


def engine_loop(engine: str = "zero1", steps: int = 3, B: int = 2, S: int = 24, seed: int = 0, layers: int = 2,
                bypass: bool = False):
    """``steps`` steps of dp 2 x Ulysses 2 under ``engine``; ``bypass``: the engine gets each
    rank's loss share as it is (no sum over the sp group), the check turned off."""
    from usp_hal.integrations import set_sync_check
    from usp_hal.integrations import transformers as usp
    from usp_hal.integrations.training import engines

    dm, mesh = _meshes()
    replica = dm.get_coordinate()[0]
    name = usp.register("usp_hal_test_engines_ds", mesh=mesh, layout="zigzag", attn_type="sdpa", enable=True)
    model = tiny_llama(seed, num_hidden_layers=layers)
    model.set_attn_implementation(name)
    wrapped, opt = _wrap(model, engine, dm)
    data = [_batches(1, B, S, seed + i)[0] for i in range(2)]
    losses, norms = [], []
    old = set_sync_check("off" if bypass else "raise")
    try:
        for _ in range(steps):
            ids = data[replica]
            out = wrapped(**usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, "zigzag"))
            if bypass and engines.is_deepspeed_engine(wrapped):
                wrapped.backward(out.loss)              # what the engine would do without usp-hal's factor
            elif bypass:
                out.loss.backward()
            else:
                engines.backward(wrapped, out.loss, mesh)                      # glue 1
            if bypass:
                loss = engines.reduce_gradients(wrapped, mesh, out.loss) if engines.is_deepspeed_engine(wrapped) \
                    else out.loss.detach()
            else:
                loss = engines.reduce_gradients(wrapped, mesh, out.loss)      # glue 2
            norms.append(engines.step(wrapped, opt, MAX_NORM))                 # glue 3
            losses.append(float(loss))
    finally:
        set_sync_check(old)
    params = _params(wrapped)
    res = {"losses": losses, "norms": norms, "kind": type(wrapped).__name__,
           "optimizer": type(getattr(wrapped, "optimizer", opt)).__name__}
    if dist.get_rank() == 0:
        ref_losses, ref_norms, ref_params = one_process(seed, torch.cat(data), steps, layers)
        res.update(ref_losses=ref_losses, ref_norms=ref_norms, param_diff=_max_diff(params, ref_params),
                   moved=_max_diff(ref_params, _params(tiny_llama(seed, num_hidden_layers=layers))))
    _release(wrapped)
    return res


def _release(wrapped) -> None:
    """Free a DeepSpeed engine's hooks and its process-group state so the next case starts clean."""
    destroy = getattr(wrapped, "destroy", None)
    if callable(destroy):
        destroy()


def engine_refusals(seed: int = 0):
    """The refusals of engines whose own reduction cannot give the exact gradient, on every rank
    (faked on a real engine: the attributes DeepSpeed's groups set, without building them):
    DeepSpeed's own sequence parallelism (ALST), and an mpu whose data-parallel group holds one
    rank of each sp group (ZeRO would never sum over the sp group)."""
    from usp_hal.integrations.training import engines
    dm, mesh = _meshes()
    model = tiny_llama(seed, num_hidden_layers=1)
    wrapped, _ = _wrap(model, "zero1", dm)
    out = {}
    try:
        for what, attr, value in (("alst", "sequence_parallel_size", 2), ("mpu", "seq_data_parallel_group",
                                                                           mesh.dp_group)):
            old = getattr(wrapped, attr)
            setattr(wrapped, attr, value)
            try:
                engines.loss_factor(wrapped, mesh)
                out[what] = None
            except ValueError as exc:
                out[what] = str(exc)
            finally:
                setattr(wrapped, attr, old)
        out["plain"] = engines.loss_factor(wrapped, mesh)
    finally:
        _release(wrapped)
    return out


# ----------------------------------------------------------------------------- USPTrainer
def trainer_run(stage: int = 2, U: int = 2, R: int = 1, steps: int = 4, ga: int = 1, bs: int = 2, S: int = 24,
                seed: int = 0, lr: float = 3e-3, premade_state: bool = True):
    """USPTrainer with ``args.deepspeed`` a ZeRO-``stage`` config: as tests/dist_trainer.py's
    ``trainer_run`` (its reference is ``dist_trainer.reference_run``).  ``premade_state=False``:
    without the gloo PartialState made beforehand (the refusal's message is returned)."""
    from tests.dist_trainer import MODEL, RaggedRows, _common, _Losses, _reset_accelerate
    from usp_hal.integrations.training.trainer import USPTrainer, USPTrainingArguments

    world = dist.get_world_size()
    dp = world // (U * R)
    model = tiny_llama(seed, **MODEL)
    data = RaggedRows(steps * ga * bs * dp, S, seed)
    keep = _Losses.make()
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10 ** 9}
    threads = torch.get_num_threads()
    env = {k: os.environ.get(k) for k in ("LOCAL_RANK", "ACCELERATE_USE_DEEPSPEED")}
    # a machine without accelerators: accelerate's device probe finds no backend for DeepSpeed
    # (PartialState falls back to one process), so the state is made beforehand with gloo
    # (accelerate 1.15.0 state.py: ACCELERATE_USE_DEEPSPEED, LOCAL_RANK set and cpu=False give
    # DistributedType.DEEPSPEED) and the arguments reuse it
    os.environ.update(LOCAL_RANK="0", ACCELERATE_USE_DEEPSPEED="true")
    try:
        from accelerate import PartialState
        if premade_state:
            PartialState(cpu=False, backend="gloo")
        with tempfile.TemporaryDirectory() as tmp:
            common = _common(tmp, steps, ga, lr, seed)
            common.update(use_cpu=False, accelerator_config={"use_configured_state": premade_state})
            args = USPTrainingArguments(usp_ulysses_degree=U, usp_ring_degree=R, usp_attn_type="sdpa",
                                        per_device_train_batch_size=bs, deepspeed=copy.deepcopy(cfg), **common)
            try:
                trainer = USPTrainer(model=model, args=args, train_dataset=data, callbacks=[keep])
            except ValueError as exc:
                if premade_state:
                    raise
                return {"refused": str(exc)}
            trainer.train()
            wrapped = trainer.model_wrapped
            params = _params(wrapped)
            kind = type(wrapped).__name__
            _release(wrapped)
    finally:
        _reset_accelerate()
        torch.set_num_threads(threads)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    res = {"losses": keep.losses, "grad_norms": keep.grad_norms, "dp": trainer.dp_size, "kind": kind,
           "attn_after": model.config._attn_implementation}
    if dist.get_rank() == 0:
        res["params"] = params
    return res


# ----------------------------------------------------------------------------- ALST's 2x
def alst_grad_norm_ratio(B: int = 2, S: int = 24, seed: int = 0, layers: int = 2):
    """The first gradient's norm over one process's, for DeepSpeed ALST's loss with ZeRO's
    reduction under ``sequence_parallel_size`` and for usp-hal's, with sp = the world (Ulysses)
    and the same usp-hal attention (only the loss and the gradient reduction differ).  sp is the
    world because on gloo the backward of ``torch.distributed.nn.functional.all_gather`` over a
    group that does not start at rank 0 fails (``ValueError: Global rank 0 is not part of group``:
    its gloo reduce-scatter fallback passes group ranks as global ones), so ALST's loss cannot run
    on the second replica of a dp 2 x sp 2 mesh here.

    ALST's loss: transformers 5.23.0 ``integrations.deepspeed.deepspeed_sp_compute_loss`` itself
    (each rank's mean token loss, combined over the sp group through the differentiable
    ``all_gather``; reached through its torch-DeviceMesh branch, given the ``sp`` dim).  ZeRO's
    reduction with ``sequence_parallel_size = sp``: an all-reduce over the sp x dp group divided
    by dp (deepspeed 0.19.8 ``runtime/zero/stage_1_and_2.py``: ``div_(world / sequence_parallel_size)``).
    usp-hal's: each rank's exact share (``num_items_in_batch``), ``sync_gradients``."""
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

    from usp_hal.integrations import mark_synced, sync_gradients
    from usp_hal.integrations import transformers as usp

    if "alst" not in _DM:
        from torch.distributed.device_mesh import init_device_mesh
        dm = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("sp",))
        _DM["alst"] = dm, usp_hal.init_sequence_parallel(device_mesh=dm["sp"], set_default=False)
    dm, mesh = _DM["alst"]
    replica = 0
    name = usp.register("usp_hal_test_engines_alst", mesh=mesh, layout="zigzag", attn_type="sdpa", enable=True)
    data = [_batches(1, B, S, seed)[0]]
    norms = {}
    for kind in ("alst", "usp"):
        model = tiny_llama(seed, num_hidden_layers=layers)
        model.set_attn_implementation(name)
        batch = usp.shard_batch({"input_ids": data[replica], "labels": data[replica]}, mesh, "zigzag")
        if kind == "alst":
            batch.pop("num_items_in_batch")          # ALST: each rank's own mean, weighted afterwards
            pc = SimpleNamespace(sp_backend="torch", sp_size=mesh.sp_size)
            loss = deepspeed_sp_compute_loss(SimpleNamespace(torch_device_mesh=dm), model, batch, False, pc)
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)                               # the sp x dp group (the world here)
                p.grad /= dist.get_world_size() / mesh.sp_size        # ... divided by dp
            mark_synced(mesh)
        else:
            model(**batch).loss.backward()
            sync_gradients(model, mesh)
        norms[kind] = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
    ref = tiny_llama(seed, num_hidden_layers=layers)
    ids = torch.cat(data)
    ref(input_ids=ids, labels=ids).loss.backward()
    ref_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()])))
    return {k: v / ref_norm for k, v in norms.items()}
