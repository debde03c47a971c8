"""usp-hal sequence parallelism on accelerate's ``ParallelismConfig`` and under DeepSpeed ZeRO.

Two pieces, both optional glue around :mod:`usp_hal.parallel.mesh` and :mod:`.grads`:

* :func:`parallelism_mesh`: the sequence-parallel group of a ``ParallelismConfig`` (its ``cp``
  or ``sp`` dim) as a usp-hal mesh, split into Ulysses x Ring, beside the torch ``DeviceMesh``
  whose ``dp_replicate``/``dp_shard`` dims carry data parallel (DDP, FSDP2's ``fully_shard``,
  HSDP).  It replaces accelerate's own use of those dims: ``cp_size`` would run torch's
  context parallel (``cp_backend="torch"``), ``sp_size`` DeepSpeed's ALST
  (``sp_backend="deepspeed"``, the only ``sp_backend`` accelerate 1.15.0 accepts).  The device
  mesh is the accelerator's where it has the dim, else built here in accelerate's dim order
  (``ParallelismConfig._get_mesh``: dp_replicate, dp_shard, cp, sp), so the configurations
  accelerate refuses on a machine without accelerators (any ``ParallelismConfig`` under
  ``DistributedType.MULTI_CPU``), or builds no mesh for (``sp_size > 1``: DeepSpeed makes its
  own groups), or refuses outright (``dp_replicate_size > 1`` with ``cp_size > 1`` and
  ``dp_shard_size == 1``; use ``sp_size`` for that one) still work.
* :func:`backward` / :func:`reduce_gradients` / :func:`step`: one training loop for a DeepSpeed
  engine (ZeRO stages 0-3) and a torch module (plain, DDP, FSDP2), switched by how the model
  was wrapped alone.  DeepSpeed reduces the gradients itself, averaging over its data-parallel
  group; initialised without an ``mpu`` that group is the whole world, which holds each
  sequence-parallel group whole, so the exact gradient is that average times the sp size
  (the ``SCALE_SP`` rule of :mod:`.grads`): :func:`backward` hands the engine ``loss * sp``.
  A torch module gets the plain ``backward()`` and :func:`~usp_hal.integrations.sync_gradients`.

Why DeepSpeed's own sequence parallelism (ALST) with the Trainer measured a gradient norm of
exactly 2x one process at sp = 2: transformers 5.23.0 ``integrations/deepspeed.py``
(``deepspeed_sp_compute_loss``) combines the sp ranks' losses through
``torch.distributed.nn.functional.all_gather``, whose backward sums over the sp group
(``_AllGather.backward``: a SUM reduce-scatter), so each rank's backward already yields sp
times its token share; ZeRO under ``sequence_parallel_size`` then all-reduces over the sp x dp
group and divides by dp only (deepspeed 0.19.8 ``runtime/zero/stage_1_and_2.py``,
``tensor.div_(world / sequence_parallel_size)``), a second sum over sp.  Here each rank's loss
is its exact share (``shard_batch``'s ``num_items_in_batch``) and the one sum over sp is the
factor above, so the norm is 1.00x (tests/test_engines_deepspeed.py).

Glue a user writes: 1 line for the mesh (``dm, mesh = parallelism_mesh(pc, ring_degree=2)``),
3 in the step (``backward``, ``reduce_gradients``, ``step``), beside ``shard_batch`` and
``register`` of :mod:`.transformers`.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .grads import mark_synced, sync_gradients

__all__ = ["parallelism_mesh", "parallelism_sizes", "parallelism_problem", "is_deepspeed_engine", "engine_problem",
           "loss_factor", "backward", "reduce_gradients", "step"]

_DIMS = ("dp_replicate", "dp_shard", "tp", "cp", "sp")


# ----------------------------------------------------------------------------- ParallelismConfig
def parallelism_sizes(config) -> Dict[str, int]:
    """The dims' sizes of an accelerate ``ParallelismConfig`` (None read as 1)."""
    return {d: int(getattr(config, f"{d}_size", None) or 1) for d in _DIMS}


def parallelism_problem(config, world_size: Optional[int] = None) -> Optional[str]:
    """Why usp-hal cannot take this ``ParallelismConfig``'s sequence-parallel group, with what to
    do instead, or None.  Reads the config only (the same answer on every rank, no collective)."""
    s = parallelism_sizes(config)
    if s["tp"] > 1:
        return (f"tp_size={s['tp']}: tensor parallel and usp-hal's sequence shards are not composed here; set "
                "tp_size=1")
    if s["cp"] > 1 and s["sp"] > 1:
        return f"cp_size={s['cp']} and sp_size={s['sp']} both name a sequence-parallel group; set one of them"
    if s["cp"] == 1 and s["sp"] == 1:
        return ("neither cp_size nor sp_size is above 1, so there is no sequence-parallel group; set cp_size (or "
                "sp_size) to the ranks that share one sequence")
    total = s["dp_replicate"] * s["dp_shard"] * s["cp"] * s["sp"]
    if world_size is not None and total != world_size:
        return (f"dp_replicate x dp_shard x cp x sp = {total} but the process group has {world_size} ranks; make "
                "the product the world size")
    return None


def parallelism_mesh(config, *, ulysses_degree: Optional[int] = None, ring_degree: Optional[int] = None,
                     use_ulysses_low: bool = True, device_type: Optional[str] = None, device_mesh=None):
    """``(device_mesh, sp_mesh)`` for an accelerate ``ParallelismConfig`` (or an ``Accelerator``
    holding one) with a ``cp`` or ``sp`` dim.

    ``sp_mesh``: the usp-hal :class:`~usp_hal.parallel.mesh.SequenceParallelMesh` of that dim, split into
    ``ulysses_degree`` x ``ring_degree`` (default: all Ulysses); its ``dp_group`` is the ranks at
    the same sequence position over ``dp_replicate`` x ``dp_shard``.  ``device_mesh``: the torch
    DeviceMesh, the accelerator's (``accelerator.torch_device_mesh``) or the one given when it has
    the dim, else one built here in accelerate's dim order with the data-parallel dims flattened
    into ``"dp"`` as accelerate does; wrap the model on ``device_mesh["dp_shard"]`` (FSDP2),
    ``device_mesh["dp_replicate", "dp_shard"]`` (HSDP) or ``device_mesh.get_group("dp_replicate")``
    (DDP), or over the whole world.  Every rank calls it with the same config; a config usp-hal
    cannot take raises the same ``ValueError`` on every rank before any collective.
    """
    import usp_hal

    accelerator = None
    if not hasattr(config, "cp_size") and hasattr(config, "parallelism_config"):
        accelerator, config = config, config.parallelism_config
        if device_mesh is None:
            device_mesh = getattr(accelerator, "torch_device_mesh", None)
    if config is None:
        raise ValueError("parallelism_mesh: no ParallelismConfig (the accelerator was built without one); pass "
                         "ParallelismConfig(cp_size=..., dp_shard_size=...)")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    problem = parallelism_problem(config, world)
    if problem:
        raise ValueError(f"parallelism_mesh: {problem}")
    s = parallelism_sizes(config)
    dim = "cp" if s["cp"] > 1 else "sp"
    names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
    if device_mesh is None or dim not in names:
        from torch.distributed.device_mesh import init_device_mesh
        if device_type is None:
            if accelerator is not None:
                device_type = accelerator.device.type
            else:
                from usp_hal.dispatch import platform as _platform
                device_type = _platform.default_device_type()
        dims = [d for d in ("dp_replicate", "dp_shard", dim) if s[d] > 1]
        device_mesh = init_device_mesh(device_type, tuple(s[d] for d in dims), mesh_dim_names=tuple(dims))
        dp_dims = [d for d in ("dp_replicate", "dp_shard") if s[d] > 1]
        if dp_dims:
            device_mesh[tuple(dp_dims)]._flatten("dp")       # accelerate's build_device_mesh does the same
    sp = usp_hal.init_sequence_parallel(ulysses_degree, ring_degree, use_ulysses_low=use_ulysses_low,
                                        device_mesh=device_mesh[dim], set_default=False)
    return device_mesh, sp


# ----------------------------------------------------------------------------- DeepSpeed
def is_deepspeed_engine(model) -> bool:
    """Whether ``model`` is a ``deepspeed.DeepSpeedEngine`` (without importing deepspeed)."""
    mod = sys.modules.get("deepspeed")
    engine = getattr(mod, "DeepSpeedEngine", None) if mod is not None else None
    return engine is not None and isinstance(model, engine)


def _group_ranks(group) -> Tuple[int, ...]:
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(int(r) for r in dist.get_process_group_ranks(group))


def engine_problem(engine, mesh) -> Optional[str]:
    """Why the exact gradient cannot come out of this DeepSpeed engine's own reduction, or None."""
    sp_size = int(getattr(engine, "sequence_parallel_size", 1) or 1)
    if sp_size > 1:
        return (f"the engine runs DeepSpeed's own sequence parallelism (ALST, sequence_parallel_size={sp_size}), "
                "which shards and reduces the sequence itself; drop it from the DeepSpeed config (and "
                "ParallelismConfig(sp_size=...)) and let usp-hal's mesh shard the sequence")
    group = getattr(engine, "seq_data_parallel_group", None) or getattr(engine, "data_parallel_group", None)
    ranks = set(_group_ranks(group))
    if mesh.sp_size > 1 and not set(mesh.sp_ranks) <= ranks:
        return (f"the engine averages gradients over ranks {sorted(ranks)}, which do not hold the whole "
                f"sequence-parallel group {list(mesh.sp_ranks)} (an mpu with a data-parallel group orthogonal to "
                "it), and ZeRO leaves no point to add the sum over that group; initialise DeepSpeed without "
                "an mpu, so that its data-parallel group is the world")
    return None


def loss_factor(model, mesh) -> int:
    """What each rank's loss share is multiplied by before the engine's backward: the sp size
    for a DeepSpeed engine (it averages over the sp ranks as if they were replicas), else 1."""
    if not is_deepspeed_engine(model):
        return 1
    problem = engine_problem(model, mesh)
    if problem:
        raise ValueError(f"usp_hal.integrations.training.engines: {problem}")
    return int(mesh.sp_size)


def backward(model, loss: torch.Tensor, mesh, **kwargs) -> None:
    """The backward of this rank's loss share: ``engine.backward(loss * sp, **kwargs)`` for a
    DeepSpeed engine (which reduces the gradients itself), else ``loss.backward()``."""
    if is_deepspeed_engine(model):
        model.backward(loss * loss_factor(model, mesh), **kwargs)
        mark_synced(mesh)
    else:
        loss.backward(**kwargs)


def reduce_gradients(model, mesh, loss: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """After the last micro-batch's :func:`backward`: :func:`~usp_hal.integrations.sync_gradients`
    for a torch module; for a DeepSpeed engine (whose gradients its backward reduced) the check
    that it could, and only the loss.  Returns the loss of the whole sequence (sum over sp, mean
    over the replicas), detached, when ``loss`` is given."""
    if not is_deepspeed_engine(model):
        return sync_gradients(model, mesh, loss)
    loss_factor(model, mesh)            # refuses an engine that cannot give the exact gradient
    mark_synced(mesh)
    if loss is None:
        return None
    total = loss.detach().clone().reshape(())
    if mesh.sp_size > 1:
        dist.all_reduce(total, group=mesh.sp_group)
    if mesh.dp_degree > 1 and mesh.dp_group is not None:
        dist.all_reduce(total, group=mesh.dp_group)
        total /= mesh.dp_degree
    return total


def step(model, optimizer: Any = None, max_grad_norm: Optional[float] = None) -> Optional[float]:
    """The optimizer step: ``engine.step()`` (clipping as its config says) for a DeepSpeed engine,
    else the gradient clipped to ``max_grad_norm`` (when given) and ``optimizer.step()``,
    ``zero_grad()``.  Returns the gradient norm before clipping (None when not measured)."""
    if is_deepspeed_engine(model):
        model.step()
        norm = model.get_global_grad_norm()
        return None if norm is None else float(norm)
    norm = None
    if max_grad_norm is not None:
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        full = getattr(got, "full_tensor", None)        # a DTensor norm under FSDP2
        norm = float(full() if full is not None else got)
    optimizer.step()
    optimizer.zero_grad()
    return norm
