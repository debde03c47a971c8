"""Rank functions for usp-hal on accelerate's ParallelismConfig (tests/test_engines_accelerate.py).

4 ranks.  The sequence-parallel group is the config's ``cp`` or ``sp`` dim, taken by
:func:`usp_hal.integrations.training.engines.parallelism_mesh` (1 line of glue) and split into Ulysses x
Ring; data parallel runs on the same DeviceMesh's ``dp_replicate``/``dp_shard`` dims.  On this
machine accelerate refuses every ``ParallelismConfig`` (``DistributedType.MULTI_CPU``), so the
Accelerator is built without one and usp-hal builds the DeviceMesh from the config.

:func:`accelerate_loop` is a custom loop: ``Accelerator(cpu=True)`` prepares the optimizer (and,
for ``wrap="accelerate"``, the model: DDP over the world), FSDP2's ``fully_shard`` goes on
``dm["dp_shard"]`` for ``wrap="fsdp"``; ``accelerator.backward``, then usp-hal's
``engines.reduce_gradients`` (2nd glue line) and ``engines.step``.  The reference, on rank 0, is one
process on every replica's rows.  :func:`trainer_run` is USPTrainer with
``parallelism_config=ParallelismConfig(...)`` in its arguments."""
from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist

from tests.dist_engines_deepspeed import LR, MAX_NORM, _params, one_process
from tests.integration_cases import _batches, _max_diff, tiny_llama

_MESHES: dict = {}


def _config(kw: dict):
    from accelerate import ParallelismConfig
    return ParallelismConfig(**kw)


def _mesh(pc_kw: dict, U, R, accelerate_mesh: bool = False):
    """(DeviceMesh, sp mesh) of a config, built once per pool and config.  ``accelerate_mesh``: the
    DeviceMesh from accelerate's own helper (``ParallelismConfig.build_device_mesh``, what
    ``accelerator.torch_device_mesh`` holds where accelerate takes the config), handed over."""
    key = (tuple(sorted(pc_kw.items())), U, R, accelerate_mesh)
    if key not in _MESHES:
        from usp_hal.integrations.training import engines
        config = _config(pc_kw)
        given = config.build_device_mesh("cpu") if accelerate_mesh else None
        _MESHES[key] = engines.parallelism_mesh(config, ulysses_degree=U, ring_degree=R, device_type="cpu",
                                                device_mesh=given)
    return _MESHES[key]


def _replica(dm) -> int:
    """This rank's replica: its coordinate on the flattened data-parallel dim ("dp"), 0 without one."""
    if not any(n.startswith("dp_") for n in dm.mesh_dim_names):
        return 0
    return dm["dp"].get_local_rank()


def accelerate_loop(pc: dict, U=None, R=None, wrap: str = "fsdp", steps: int = 3, B: int = 2, S: int = 24,
                    seed: int = 0, layers: int = 2, bypass: bool = False, accelerate_mesh: bool = False):
    """``steps`` AdamW steps; ``wrap``: "fsdp" (FSDP2 on dm["dp_shard"]), "fsdp_dp_shard_cp" (on
    accelerate's flattened dp_shard x cp dim, as its FSDP2 plugin shards: the whole sp group inside),
    "hsdp" (FSDP2 replicated over dp_replicate, sharded over dp_shard), "accelerate" (accelerate's
    DDP over the world); ``bypass``: usp-hal's gradient reduction
    skipped (check off)."""
    from accelerate import Accelerator

    from usp_hal.integrations import set_sync_check
    from usp_hal.integrations import transformers as usp
    from usp_hal.integrations.training import engines

    from .dist_trainer import _reset_accelerate

    dm, mesh = _mesh(pc, U, R, accelerate_mesh)
    replicas = mesh.dp_degree
    name = usp.register("usp_hal_test_engines_acc", mesh=mesh, layout="zigzag", attn_type="sdpa", enable=True)
    model = tiny_llama(seed, num_hidden_layers=layers)
    model.set_attn_implementation(name)
    accelerator = Accelerator(cpu=True)
    if wrap in ("fsdp", "fsdp_dp_shard_cp", "hsdp"):
        from torch.distributed.fsdp import fully_shard
        sub = {"fsdp": lambda: dm["dp_shard"], "fsdp_dp_shard_cp": lambda: dm["dp_shard_cp"],
               "hsdp": lambda: dm["dp_replicate", "dp_shard"]}[wrap]()
        for layer in model.model.layers:
            fully_shard(layer, mesh=sub)
        fully_shard(model, mesh=sub)
        opt = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=LR))
        wrapped = model
    else:       # accelerate's own wrapping on this machine: DDP over the world
        wrapped, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    data = [_batches(1, B, S, seed + i)[0] for i in range(replicas)]
    losses, norms = [], []
    old = set_sync_check("off" if bypass else "raise")
    try:
        for _ in range(steps):
            ids = data[_replica(dm)]
            out = wrapped(**usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, "zigzag"))
            accelerator.backward(out.loss)
            if bypass:
                loss = out.loss.detach().clone()
                dist.all_reduce(loss, group=mesh.sp_group)
                if replicas > 1:
                    dist.all_reduce(loss, group=mesh.dp_group)
                    loss /= replicas
            else:
                loss = engines.reduce_gradients(wrapped, mesh, out.loss)
            norms.append(engines.step(wrapped, opt, MAX_NORM))
            losses.append(float(loss))
    finally:
        set_sync_check(old)
        _reset_accelerate()
    params = _params(wrapped)
    res = {"losses": losses, "norms": norms, "kind": type(wrapped).__name__, "dims": list(dm.mesh_dim_names),
           "split": (mesh.ulysses_degree, mesh.ring_degree), "sp_ranks": list(mesh.sp_ranks)}
    if dist.get_rank() == 0:
        ref_losses, ref_norms, ref_params = one_process(seed, torch.cat(data), steps, layers)
        res.update(ref_losses=ref_losses, ref_norms=ref_norms, param_diff=_max_diff(params, ref_params))
    return res


def refused_everywhere(pc: dict):
    """Every rank's refusal of a config usp-hal cannot take (None where it went through)."""
    from usp_hal.integrations.training import engines
    try:
        engines.parallelism_mesh(_config(pc), device_type="cpu")
    except ValueError as exc:
        return str(exc)
    return None


def trainer_run(pc: dict, U: int = 1, R: int = 1, steps: int = 4, ga: int = 1, bs: int = 2, S: int = 24,
                seed: int = 0, lr: float = 3e-3):
    """USPTrainer with ``parallelism_config=ParallelismConfig(**pc)`` (the degrees split its cp/sp
    dim; 1 x 1: all Ulysses), as tests/dist_trainer.py's ``trainer_run``."""
    from usp_hal.integrations.training.trainer import USPTrainer, USPTrainingArguments

    from .dist_trainer import MODEL, RaggedRows, _common, _flat, _Losses, _reset_accelerate

    config = _config(pc)
    dp = config.dp_replicate_size * config.dp_shard_size
    model = tiny_llama(seed, **MODEL)
    data = RaggedRows(steps * ga * bs * dp, S, seed)
    keep = _Losses.make()
    threads = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = USPTrainingArguments(usp_ulysses_degree=U, usp_ring_degree=R, usp_attn_type="sdpa",
                                        per_device_train_batch_size=bs, parallelism_config=config,
                                        **_common(tmp, steps, ga, lr, seed))
            trainer = USPTrainer(model=model, args=args, train_dataset=data, callbacks=[keep])
            trainer.train()
            kept = args.parallelism_config is config           # the user's arguments are left as given
            accel_pc = trainer.accelerator.parallelism_config
    finally:
        _reset_accelerate()
        torch.set_num_threads(threads)
    mesh = trainer.usp_mesh
    res = {"losses": keep.losses, "grad_norms": keep.grad_norms, "dp": trainer.dp_size, "kept": kept,
           "accelerate_pc": accel_pc is not None, "split": (mesh.ulysses_degree, mesh.ring_degree),
           "sp_ranks": list(mesh.sp_ranks), "dims": list(trainer.usp_device_mesh.mesh_dim_names),
           "attn_after": model.config._attn_implementation}
    if dist.get_rank() == 0:
        res["params"] = _flat(model)
    return res
