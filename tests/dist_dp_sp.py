"""Rank functions for data parallel x sequence parallel training (tests/test_dp_sp.py).

4 ranks = dp 2 x sp 2 from one ``init_device_mesh("cpu", (2, 2), ("dp", "sp"))``: the
sequence-parallel mesh comes from ``dm["sp"]``, the data-parallel wrapper (FSDP2's
``fully_shard`` or DDP) works on ``dm["dp"]``.  Each replica trains a tiny Llama on its own
batch; the reference, on rank 0, trains the same model in one process on both batches at
once (equal token counts: the mean loss is the same)."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import usp_hal
from tests.integration_cases import _batches, _max_diff, tiny_llama

_DM = {}


def _meshes():
    """The (2, 2) DeviceMesh and the sequence-parallel mesh of its "sp" dim (built once per pool)."""
    if "dm" not in _DM:
        from torch.distributed.device_mesh import init_device_mesh
        dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
        _DM["dm"] = dm
        _DM["mesh"] = usp_hal.init_sequence_parallel(device_mesh=dm["sp"], set_default=False)
    return _DM["dm"], _DM["mesh"]


def _world_mesh():
    if "world" not in _DM:
        from torch.distributed.device_mesh import init_device_mesh
        _DM["world"] = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("all",))
    return _DM["world"]


def _wrap(model, wrapper: str, dm):
    """fsdp/ddp: over the dp dim (orthogonal to sp); fsdp_world/ddp_world: over all 4 ranks, so
    the wrapper also averages over the sp ranks (sync_gradients then multiplies by sp)."""
    if wrapper in ("fsdp", "fsdp_world"):
        from torch.distributed.fsdp import fully_shard
        sub = dm["dp"] if wrapper == "fsdp" else _world_mesh()
        for layer in model.model.layers:
            fully_shard(layer, mesh=sub)
        fully_shard(model, mesh=sub)
        return model
    if wrapper in ("ddp", "ddp_world"):
        group = dm.get_group("dp") if wrapper == "ddp" else None
        return torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    return model


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def one_process_steps(ref, ids, steps: int, lr: float):
    """``steps`` AdamW steps of ``ref`` on ``ids`` (every replica's batch together) in one
    process: ``(losses, the first step's gradients)``."""
    opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    losses, grads = [], []
    for _ in range(steps):
        out = ref(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.item())
        if not grads:
            grads = [p.grad.detach().clone() for p in ref.parameters()]
        opt.step()
        opt.zero_grad()
    return losses, grads


def dp_sp_training(wrapper: str = "fsdp", steps: int = 4, B: int = 2, S: int = 24, seed: int = 0, lr: float = 2e-3,
                   sync: bool = True, layers: int = 2, tiled_loss: int = 0):
    """``steps`` AdamW steps of dp 2 x sp 2 (Ulysses 2) under ``wrapper`` (fsdp, ddp, plain).
    ``sync=False``: the negative control, sync_gradients skipped (the check turned off).
    ``tiled_loss``: the loss in tiles of that many tokens (the reference's is untiled)."""
    from usp_hal.integrations import set_sync_check, sync_gradients
    from usp_hal.integrations import transformers as usp

    dm, mesh = _meshes()
    replica = dm.get_coordinate()[0]
    name = usp.register("usp_hal_test_dp_sp", mesh=mesh, layout="zigzag", attn_type="sdpa", enable=True)
    ref = tiny_llama(seed, num_hidden_layers=layers)
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    if tiled_loss:
        from usp_hal.integrations.training.tiled_loss import enable_tiled_loss
        enable_tiled_loss(model, tiled_loss)
    wrapped = _wrap(model, wrapper, dm)
    data = [_batches(1, B, S, seed + i)[0] for i in range(2)]
    opt = torch.optim.AdamW(wrapped.parameters(), lr=lr)
    losses, grads = [], []
    old = set_sync_check("raise" if sync else "off")
    try:
        for _ in range(steps):
            ids = data[replica]
            out = wrapped(**usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, "zigzag"))
            out.loss.backward()
            if sync:
                loss = sync_gradients(wrapped, mesh, out.loss)
            else:   # report the same quantity, but step on the partial gradients
                loss = out.loss.detach().clone()
                dist.all_reduce(loss, group=mesh.sp_group)
                dist.all_reduce(loss, group=mesh.dp_group)
                loss /= 2
            losses.append(float(loss))
            if not grads:       # the first step's gradients: AdamW hides a scale error, these do not
                grads = [_full(p.grad).detach().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
    finally:
        set_sync_check(old)
    params = [_full(p).detach() for p in model.parameters()]
    res = {"losses": losses, "grad_kinds": sorted({type(p).__name__ for p in model.parameters()}),
           "tiled_calls": model._usp_tiled_loss.calls if tiled_loss else 0}
    if dist.get_rank() != 0:
        return res
    ref_losses, ref_grads = one_process_steps(ref, torch.cat(data), steps, lr)
    res.update(ref_losses=ref_losses, loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)),
               loss_change=ref_losses[0] - ref_losses[-1],
               grad_diff=max(_max_diff(g, r) for g, r in zip(grads, ref_grads)),
               grad_scale=max(float(r.abs().max()) for r in ref_grads),
               param_diff=max(_max_diff(p, q) for p, q in zip(params, ref.parameters())))
    return res


def forgotten_sync(wrapper: str = "plain", B: int = 2, S: int = 24, seed: int = 0):
    """backward() then optimizer.step() without sync_gradients: the step must raise on every
    rank, the parameters must be untouched; after sync_gradients the step goes through."""
    from usp_hal.integrations import UnsyncedGradientsError, sync_gradients
    from usp_hal.integrations import transformers as usp

    dm, mesh = _meshes()
    name = usp.register("usp_hal_test_dp_sp", mesh=mesh, layout="zigzag", attn_type="sdpa", enable=True)
    model = tiny_llama(seed, num_hidden_layers=1)
    model.set_attn_implementation(name)
    wrapped = _wrap(model, wrapper, dm)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    ids = _batches(1, B, S, seed)[0]
    before = [_full(p).detach().clone() for p in model.parameters()]
    with torch.no_grad():      # a forward without backward leaves nothing to sync
        wrapped(**usp.shard_batch({"input_ids": ids}, mesh, "zigzag"))
    opt.step()
    out = wrapped(**usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, "zigzag"))
    out.loss.backward()
    res = {"error": None}
    try:
        opt.step()
    except UnsyncedGradientsError as exc:
        res["error"] = str(exc)
    res["untouched"] = all(bool(torch.equal(_full(p).detach(), b)) for p, b in zip(model.parameters(), before))
    sync_gradients(wrapped, mesh, out.loss)
    opt.step()                 # synced: no error
    res["stepped"] = not all(bool(torch.equal(_full(p).detach(), b)) for p, b in zip(model.parameters(), before))
    return res


def _head_unit_llama(seed: int, chunk: int = 0):
    """A one-layer tiny Llama under FSDP2 over every rank, its output head a unit of its own
    (each call of it gathers its weight); its loss in tiles of ``chunk`` tokens (0: untiled)."""
    from torch.distributed.fsdp import fully_shard

    from usp_hal.integrations.training.tiled_loss import enable_tiled_loss
    mesh = _world_mesh()
    model = tiny_llama(seed, num_hidden_layers=1)
    if chunk:
        enable_tiled_loss(model, chunk)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tiled_loss_refused_on_one_rank(chunk: int = 4, bad_rank: int = 1, seed: int = 0):
    """As :func:`tiled_loss_sharded_head`, but rank ``bad_rank`` passes labels one token short:
    every rank's error message (none may wait for the refusing one)."""
    rank = dist.get_rank()
    model = _head_unit_llama(seed, chunk)
    ids = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(seed))
    labels = ids[:, :-1] if rank == bad_rank else ids
    try:
        model(input_ids=ids, labels=labels)
    except ValueError as exc:
        return str(exc)
    return None


def tiled_loss_sharded_head(chunk: int = 4, lens=(12, 7), seed: int = 0):
    """FSDP2 over every rank with the output head a unit of its own (each call of it gathers
    its weight), every rank a batch of its own length (``lens[rank]`` tokens: 3 and 2 tiles
    of 4): the tiled loss and its gradients against the same model's untiled loss, per rank,
    and the number of head calls per rank (which must match across ranks)."""
    rank = dist.get_rank()
    models = [_head_unit_llama(seed), _head_unit_llama(seed, chunk)]
    calls = []
    models[1].lm_head.register_forward_hook(lambda *a: calls.append(1))
    ids = torch.randint(0, 100, (1, lens[rank]), generator=torch.Generator().manual_seed(seed + rank))
    losses, grads = [], []
    for model in models:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(float(out.loss.detach()))
        grads.append([_full(p.grad).detach().clone() for p in model.parameters()])
    return {"loss_diff": abs(losses[0] - losses[1]), "loss": losses[0], "head_calls": len(calls),
            "tiled_calls": models[1]._usp_tiled_loss.calls,
            "grad_diff": max(_max_diff(a, b) for a, b in zip(*grads)),
            "grad_scale": max(float(g.abs().max()) for g in grads[0])}


def custom_divide_factor(factor):
    """FSDP2 over all 4 ranks (it holds the whole sp group) with ``set_gradient_divide_factor(factor)``
    (None: left at its default): sync_gradients refuses a custom factor on every rank before any
    collective, naming it, and leaves the gradients as they were; the default one goes through."""
    from usp_hal.integrations import sync_gradients
    from usp_hal.integrations import transformers as usp

    dm, mesh = _meshes()
    name = usp.register("usp_hal_test_dp_sp", mesh=mesh, layout="zigzag", attn_type="sdpa", enable=True)
    model = tiny_llama(0, num_hidden_layers=1)
    model.set_attn_implementation(name)
    wrapped = _wrap(model, "fsdp_world", dm)
    if factor is not None:
        for m in wrapped.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(factor)
                m.set_force_sum_reduction_for_comms(True)     # gloo has no PREMUL_SUM
    ids = _batches(1, 2, 24, 0)[0]
    out = wrapped(**usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, "zigzag"))
    out.loss.backward()
    before = [_full(p.grad).detach().clone() for p in model.parameters() if p.grad is not None]
    res = {"error": None}
    try:
        sync_gradients(wrapped, mesh, out.loss)
    except ValueError as exc:
        res["error"] = str(exc)
    after = [_full(p.grad).detach() for p in model.parameters() if p.grad is not None]
    res["grads_unchanged"] = all(bool(torch.equal(a, b)) for a, b in zip(after, before))
    return res
