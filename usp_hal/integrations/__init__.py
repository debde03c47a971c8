"""Framework integrations: sequence parallelism for transformers and diffusers models.

``usp_hal.integrations.transformers``
    ``attn_implementation="usp_hal"`` for any model that goes through transformers'
    ``AttentionInterface``, plus :func:`~usp_hal.integrations.transformers.shard_batch`.
``usp_hal.integrations.diffusers``
    :func:`~usp_hal.integrations.diffusers.parallelize` for diffusers models that declare a
    context-parallel plan and call ``dispatch_attention_fn`` (Flux and others).

This package imports neither framework; each submodule imports its own on first use.  The
helpers here are shared by both:

* :func:`init_distributed`: the process group (from torchrun's environment) and the mesh;
* :func:`sync_gradients`: after ``backward()``, make every rank's gradients the gradients of
  the whole sequence (one all-reduce over the sequence-parallel group), and optionally return
  the loss of the whole sequence.
"""
from __future__ import annotations

import os
from typing import Iterable, List, Optional, Union

import torch
import torch.distributed as dist

__all__ = ["init_distributed", "sync_gradients"]


def init_distributed(ulysses_degree: Optional[int] = None, ring_degree: Optional[int] = None, *,
                     use_ulysses_low: bool = True):
    """Start the process group if needed and build the sequence-parallel mesh (made the default).

    Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) the process group is created with the
    device's backend (``gloo`` on CPU) and this process is bound to its ``LOCAL_RANK``
    device.  Without them, and without a process group, the result is the trivial 1 x 1 mesh:
    the same script then runs as a single process.  Every rank must pass the same degrees.
    """
    import usp_hal
    from usp_hal import platform as _platform

    if dist.is_available() and not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        device_type = _platform.default_device_type()
        _platform.set_device(device_type, int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(_platform.dist_backend_string(device_type))
    return usp_hal.init_sequence_parallel(ulysses_degree, ring_degree, use_ulysses_low=use_ulysses_low)


def sync_gradients(model: Union[torch.nn.Module, Iterable[torch.nn.Parameter]], mesh=None,
                   loss: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Sum the gradients over the sequence-parallel group (after ``loss.backward()``).

    With sequence parallelism each rank's backward produces the gradient contributions of its
    own tokens (attention already sends every cross-rank contribution back to the rank that
    owns the token), so the full gradient is their sum over the group.  The loss on each rank
    must be its share of the loss of the whole sequence (what ``shard_batch``'s
    ``num_items_in_batch`` gives for transformers, or a loss on ``unshard``-ed outputs).

    With data-parallel replicas (``mesh.dp_degree > 1``) the gradients are then averaged over
    the replicas, like DDP.  ``loss`` (this rank's share, optional) is reduced in the same
    collective: the return value is the loss of the whole sequence (averaged over replicas),
    detached.  Every rank must hold gradients for the same parameters; that is checked first.
    """
    import usp_hal
    from usp_hal.comm import agree, digest_ints, dtype_code

    mesh = mesh if mesh is not None else usp_hal.get_default_mesh()
    problem = None
    params: List[torch.nn.Parameter] = []
    try:
        params = list(model.parameters()) if isinstance(model, torch.nn.Module) else list(model)
        if loss is not None and not isinstance(loss, torch.Tensor):
            raise TypeError(f"sync_gradients: loss must be a tensor, got {type(loss).__name__}")
    except TypeError as exc:
        problem = exc
    grads: List[torch.Tensor] = [p.grad for p in params if p.grad is not None]
    if mesh.sp_size == 1 and mesh.dp_degree == 1:
        if problem is not None:
            raise problem
        return None if loss is None else loss.detach()
    # the same parameters must hold gradients on every rank (same dtypes, same sizes), and every
    # rank must pass a loss or none, or the flat buffers of the all-reduce differ
    pattern = 0
    for i, p in enumerate(params):
        if getattr(p, "grad", None) is not None:
            pattern = (pattern * 1000003 + i + 1) % (2 ** 61 - 1)
    kinds = digest_ints([x for g in grads for x in (dtype_code(g.dtype), g.numel())])
    values = [len(params), len(grads), sum(g.numel() for g in grads), pattern, kinds,
              -1 if loss is None or problem is not None else dtype_code(loss.dtype)]
    labels = ("parameters", "parameters with a gradient", "gradient elements", "gradient pattern (digest)",
              "gradient dtypes and sizes (digest)", "loss dtype (-1: no loss)")
    what = ("sync_gradients: the ranks hold gradients for different parameters or pass different losses; every "
            "rank must run the same model on its share of the same batch")
    for group, where, ranks, on in (
            (mesh.metadata_group, mesh.where("sequence-parallel"), mesh.sp_ranks, mesh.sp_size > 1),
            (mesh.dp_group, "data-parallel group", None, mesh.dp_degree > 1 and mesh.dp_group is not None)):
        if on:
            agree(problem, group, what=what, where=where, values=values, same=labels, ranks=ranks)
    groups: dict = {}
    for g in grads:
        groups.setdefault((g.dtype, g.device), []).append(g)
    total = None
    if loss is not None:
        key = (loss.dtype, loss.device)
        groups.setdefault(key, [])
    for (dtype, device), gs in groups.items():
        parts = [g.reshape(-1) for g in gs]
        carry_loss = loss is not None and (dtype, device) == (loss.dtype, loss.device)
        if loss is not None and carry_loss:
            parts.append(loss.detach().reshape(1))
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)
        dist.all_reduce(flat, group=mesh.sp_group)
        if mesh.dp_degree > 1 and mesh.dp_group is not None:
            dist.all_reduce(flat, group=mesh.dp_group)
            flat /= mesh.dp_degree
        offset = 0
        for g in gs:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
        if carry_loss:
            total = flat[offset].clone()
    return total
