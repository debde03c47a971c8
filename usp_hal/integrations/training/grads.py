"""Gradients under sequence parallelism: :func:`sync_gradients` and the check that it ran.

Each rank of a sequence-parallel group runs the model on its own tokens.  Attention sends
every cross-rank contribution back to the rank that owns the token, so after ``backward()``
each rank holds, for every parameter, the gradient of *its tokens' share of the loss*; the
gradient of the whole sequence is the sum of these over the group.  What else has already
been reduced depends on the wrapper, and :func:`sync_gradients` decides it per parameter:

==========================================  =====================================================
gradient                                    what ``sync_gradients`` does
==========================================  =====================================================
plain tensor, plain module                  sum over the sequence-parallel group, then the mean
                                            over the mesh's data-parallel group (when dp > 1)
plain tensor, ``model`` is a DDP wrapper    DDP already averaged over its group.  Group
whose group holds one rank of this          orthogonal to sp (the usual dp group): sum over sp
sp group (the dp group)                     only
DTensor (FSDP2 ``fully_shard``) on a mesh   FSDP reduce-scattered (mean) over its mesh already;
holding one rank of this sp group           sum this rank's shard (``to_local()``) over sp only:
(``fully_shard(m, mesh=dm["dp"])``)         the sp peers hold the same shard index
DDP group or DTensor mesh that contains     the wrapper averaged over the sp ranks as if they
the whole sp group (FSDP/DDP over the       were replicas; the exact gradient is that mean times
world, HSDP)                                the sp size: multiply by sp (no collective)
anything else (a group that holds some,     refused, on every rank, naming the parameter
not all, of the sp ranks; Partial)
==========================================  =====================================================

These rules are exact when every rank's loss is its share of the replica's loss (what
``shard_batch``'s ``num_items_in_batch`` gives, or a loss on ``unshard``-ed outputs with no
further division) and the wrapper averages with its default divide factor (its group size).
An FSDP2 module with another divide factor (``set_gradient_divide_factor``) is refused, on
every rank, naming it: its gradients follow a loss normalisation these rules cannot see.
A plain module whose gradients were already averaged over the dp group by hand is safe too:
the mean over dp of equal values is that value.

Forgetting the call trains silently wrong (every rank steps with the gradient of its own
tokens only).  So the integrations watch for it: every sequence-parallel attention call of
``integrations.transformers`` and ``integrations.diffusers`` marks, during backward, that
its mesh holds partial gradients; :func:`sync_gradients` clears the mark, and a
``torch.optim`` step taken while a mark is set raises :class:`UnsyncedGradientsError` (or
warns, see :func:`set_sync_check`).  Why a check at the step and not an automatic sync in
backward: the step is the one point where partial gradients do harm, whatever the loop
(gradient accumulation over micro-batches, DDP's or FSDP's own backward hooks, a
``no_sync`` context); a sync inside backward would run once per micro-batch, before FSDP's
reduce-scatter (on whole, unsharded gradients), and could not return the loss.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from usp_hal.integrations import patching
from usp_hal.parallel.partial_grads import is_partial, mark_partial, mark_synced, partial_sources

__all__ = ["sync_gradients", "set_sync_check", "mark_synced", "UnsyncedGradientsError"]

# reduction modes, in the order their collectives run (the same on every rank)
SUM_SP, SUM_SP_MEAN_DP, SCALE_SP = 1, 2, 3
_MODE_NAMES = {SUM_SP: "sum over sp", SUM_SP_MEAN_DP: "sum over sp, mean over dp", SCALE_SP: "times sp"}


class UnsyncedGradientsError(RuntimeError):
    """An optimizer step after a sequence-parallel backward without :func:`sync_gradients`."""


# ----------------------------------------------------------------------------- the check
_CHECK = "raise"
# the partial-gradient mark of each mesh lives in usp_hal.parallel.partial_grads (DynamicDegree
# clears it too); the step check is a process-wide optimizer hook, recorded in the patch registry
STEP_HOOK = ("torch.optim.optimizer.register_optimizer_step_pre_hook"
             "(usp_hal.integrations.training.grads.check_step)")


def set_sync_check(mode: str) -> str:
    """``"raise"`` (default), ``"warn"`` or ``"off"``: what an optimizer step does after a
    sequence-parallel backward that :func:`sync_gradients` did not follow.  Returns the old
    mode.  Turn it off only when the gradients are reduced some other way (or call
    :func:`mark_synced` after doing so)."""
    global _CHECK
    if mode not in ("raise", "warn", "off"):
        raise ValueError(f"set_sync_check: mode must be 'raise', 'warn' or 'off', got {mode!r}")
    old, _CHECK = _CHECK, mode
    return old


# id(mesh) -> {id(local gradient): (weak reference, its version right after the last sync)}
_SYNCED: Dict[int, Dict[int, Tuple[Any, int]]] = {}


def _already_synced(mesh, locals_: List[torch.Tensor]) -> Optional[str]:
    """Why these gradients must not be synced (again), or None.

    After a sync each gradient tensor's version is recorded.  Zeroing a gradient in place
    (``zero_grad(set_to_none=False)``) and accumulating into it (``backward()``) each bump the
    version by one; ``zero_grad()``'s default replaces it by None (a new tensor next time).  So
    a gradient still at its synced version was synced already, and one exactly one bump further
    while a sequence-parallel backward ran in between received a backward on top of its synced
    value without being zeroed (a sync per micro-batch): summing it over the group again would
    count the synced part several times."""
    seen = _SYNCED.get(id(mesh))
    if not seen:
        return None
    deltas = []
    for g in locals_:
        got = seen.get(id(g))
        if got is not None and got[0]() is g:
            deltas.append(g._version - got[1])
    if not deltas or max(deltas) > 1:
        return None
    if max(deltas) == 0:
        return ("sync_gradients was called twice on the same gradients (nothing changed them since the last "
                "sync); call it once per optimizer step, after the last backward()")
    if is_partial(mesh):
        return ("backward() added to gradients that sync_gradients had already synced (a sync per micro-batch "
                "would count the earlier micro-batches again); when accumulating, call sync_gradients once, after "
                "the last micro-batch's backward(), or zero the gradients after each sync")
    return None


def _record_synced(mesh, locals_: List[torch.Tensor]) -> None:
    import weakref
    _SYNCED[id(mesh)] = {id(g): (weakref.ref(g), g._version) for g in locals_}


def watch(out: torch.Tensor, mesh, where: str) -> torch.Tensor:
    """Mark ``mesh`` as holding partial gradients when backward passes through ``out`` (the
    output of a sequence-parallel attention call).  Called by the integrations."""
    if mesh.sp_size == 1 or _CHECK == "off" or not isinstance(out, torch.Tensor) or not out.requires_grad:
        return out
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and compiler.is_compiling():
        return out                      # a hook would break the graph; the check is eager-only

    def mark(grad):
        mark_partial(mesh, where)
        return None

    out.register_hook(mark)
    install_step_check()
    return out


def install_step_check() -> str:
    """Install the optimizer-step check (:func:`check_step`, a process-wide
    ``torch.optim`` step pre-hook) once, through the patch registry: ``patched()`` lists it and
    ``disable()`` removes it.  :func:`watch` calls it; returns its label."""
    if patching.is_applied(STEP_HOOK):
        return STEP_HOOK

    def install():
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        return register_optimizer_step_pre_hook(check_step)
    return patching.hook(STEP_HOOK, install)


def check_step(optimizer, args, kwargs) -> None:
    """The step pre-hook: raise (or warn) when a mesh holds partial gradients."""
    where = partial_sources()
    if not where or _CHECK == "off":
        return
    msg = (f"{type(optimizer).__name__}.step() after a sequence-parallel backward ({', '.join(where)}) without "
           "usp_hal.integrations.sync_gradients(model, mesh): each rank holds the gradients of its own tokens only, "
           "so this step would train on partial gradients. Call sync_gradients(model, mesh, loss) after backward() "
           "(after the last micro-batch when accumulating); if you reduce the gradients yourself, call "
           "usp_hal.integrations.mark_synced(mesh) or set_sync_check('off')")
    if _CHECK == "raise":
        raise UnsyncedGradientsError(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    mark_synced()


# ----------------------------------------------------------------------------- sync
def _group_ranks(group) -> Tuple[int, ...]:
    return tuple(int(r) for r in dist.get_process_group_ranks(group))


def _mode_for(ranks: Optional[Tuple[int, ...]], mesh, what: str) -> Tuple[int, Optional[str]]:
    """The reduction for a gradient that a wrapper already averaged over ``ranks`` (None: not
    reduced by anyone), or a refusal."""
    if ranks is None:
        return (SUM_SP_MEAN_DP if mesh.dp_degree > 1 else SUM_SP), None
    inside = set(ranks) & set(mesh.sp_ranks)
    if inside == {mesh.rank}:
        return SUM_SP, None
    if set(mesh.sp_ranks) <= set(ranks):
        return SCALE_SP, None
    return 0, (f"{what} was reduced over ranks {list(ranks)}, which hold some but not all of the sequence-parallel "
               f"ranks {list(mesh.sp_ranks)}; shard/replicate over a group orthogonal to the sequence-parallel one "
               "(DeviceMesh dim 'dp') or over the whole world")


def _classify(name: str, g: torch.Tensor, mesh, ddp_ranks, cache: dict) -> Tuple[int, Optional[str]]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:             # pragma: no cover - torch without DTensor
        DTensor = ()                # type: ignore[assignment,misc]
    if isinstance(g, DTensor):
        if any(p.is_partial() for p in g.placements):
            return 0, f"the gradient of {name} is a DTensor with a Partial placement (not reduced yet)"
        dm = g.device_mesh
        if id(dm) not in cache:
            cache[id(dm)] = tuple(int(r) for r in dm.mesh.flatten().tolist())
        return _mode_for(cache[id(dm)], mesh, f"the DTensor gradient of {name}")
    return _mode_for(ddp_ranks, mesh, f"the gradient of {name} (DDP)")


def _divide_factor_problem(model: torch.nn.Module) -> Optional[str]:
    """FSDP2 modules whose gradient divide factor is not the default (the mean over their mesh):
    the rules above assume that mean.  torchtitan, for one, sets 1.0 (a sum) and normalises its
    loss by the global token count, and a factor sp there doubled the gradient."""
    for name, m in model.named_modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:      # torch before 2.10: one group
            one = getattr(state, "_fsdp_param_group", None)
            groups = [one] if one is not None else []
        for group in groups:
            factor = getattr(group, "gradient_divide_factor", None)
            mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
            size = mesh.size() if mesh is not None else None
            if factor is not None and factor != size:
                return (f"FSDP's gradient divide factor of {name or 'the model'} is {factor:g}, not its mesh size "
                        f"{size} (the default mean), so sync_gradients cannot tell what is left to reduce. Where "
                        "FSDP's mesh holds the whole sequence-parallel group and the loss is normalised over the "
                        "global batch (torchtitan's set-up), the gradients are already whole: skip sync_gradients "
                        "and call usp_hal.integrations.mark_synced(mesh); otherwise leave the factor at its "
                        "default")
    return None


def _local(g: torch.Tensor) -> torch.Tensor:
    local = getattr(g, "_local_tensor", None)        # a DTensor's shard on this rank (no copy)
    return local if local is not None else g


def sync_gradients(model: Union[torch.nn.Module, Iterable[torch.nn.Parameter]], mesh=None,
                   loss: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Make every rank's gradients the gradients of the whole sequence (after ``backward()``).

    ``model``: the module (a DDP or FSDP2 one included) or its parameters.  Each gradient gets
    the reduction its wrapper leaves to do (module docstring): a sum over the sequence-parallel
    group, then for plain modules the mean over the mesh's data-parallel replicas; for DDP's and
    FSDP2's gradients, which those already averaged over data parallel, the sum over the
    sequence-parallel group only (or a factor sp when they averaged over the sp ranks too).
    ``loss`` (this rank's share, optional) is reduced like a plain gradient in the same
    collective: the return value is the loss of the whole sequence (the mean over replicas),
    detached.  Every rank must hold gradients for the same parameters; that is checked first,
    on every rank together.  Clears the partial-gradient mark that an optimizer step checks.
    """
    import usp_hal
    from usp_hal.parallel.comm import agree, digest_ints, dtype_code

    mesh = mesh if mesh is not None else usp_hal.get_default_mesh()
    problem: Optional[BaseException] = None
    named: List[Tuple[str, torch.nn.Parameter]] = []
    ddp_ranks = None
    try:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            ddp_ranks = _group_ranks(model.process_group)
        if isinstance(model, torch.nn.Module):
            named = list(model.named_parameters())
            why = _divide_factor_problem(model)
            if why:
                problem = ValueError(f"sync_gradients: {why}")
        else:
            named = [(f"parameter {i}", p) for i, p in enumerate(model)]
        if loss is not None and not isinstance(loss, torch.Tensor):
            raise TypeError(f"sync_gradients: loss must be a tensor, got {type(loss).__name__}")
    except TypeError as exc:
        problem = exc
    if mesh.sp_size == 1 and mesh.dp_degree == 1:
        mark_synced(mesh)
        if problem is not None:
            raise problem
        return None if loss is None else loss.detach()
    cache: dict = {}
    items: List[Tuple[int, torch.Tensor, torch.Tensor]] = []     # (mode, gradient, its local tensor)
    pattern, local_kinds, global_kinds = 0, [], []
    for i, (name, p) in enumerate(named):
        g = getattr(p, "grad", None)
        if g is None:
            continue
        pattern = (pattern * 1000003 + i + 1) % (2 ** 61 - 1)
        mode, why = _classify(name, g, mesh, ddp_ranks, cache)
        if why and problem is None:
            problem = ValueError(f"sync_gradients: {why}")
        local = _local(g)
        items.append((mode, g, local))
        global_kinds += [mode, dtype_code(g.dtype), g.numel()]
        local_kinds += [mode, dtype_code(local.dtype), local.numel()]
    if problem is None:
        why_not = _already_synced(mesh, [local for _, _, local in items])
        if why_not:
            problem = RuntimeError(f"sync_gradients: {why_not}")
    loss_code = -1 if loss is None or problem is not None else dtype_code(loss.dtype)
    labels = ("parameters", "parameters with a gradient", "gradient pattern (digest)",
              "gradient reductions, dtypes and sizes (digest)", "loss dtype (-1: no loss)")
    what = ("sync_gradients: the ranks hold gradients for different parameters or pass different losses; every "
            "rank must run the same model on its share of the same batch")
    if mesh.sp_size > 1:      # the sp peers reduce the same local buffers
        agree(problem, mesh.metadata_group, what=what, where=mesh.where("sequence-parallel"), same=labels,
              values=[len(named), len(items), pattern, digest_ints(local_kinds), loss_code], ranks=mesh.sp_ranks)
    dp_on = mesh.dp_degree > 1 and mesh.dp_group is not None
    if dp_on:
        # the replicas must agree on what goes through the dp all-reduce (global sizes: shards may differ)
        agree(problem, mesh.dp_group, what=what, where="data-parallel group", same=labels,
              values=[len(named), len(items), pattern, digest_ints(global_kinds), loss_code])
    elif problem is not None:
        raise problem
    buckets: Dict[tuple, List[torch.Tensor]] = {}
    for mode, _, local in items:
        buckets.setdefault((mode, dtype_code(local.dtype), str(local.device)), []).append(local)
    loss_key = None
    if loss is not None:
        loss_key = (SUM_SP_MEAN_DP, dtype_code(loss.dtype), str(loss.device))
        buckets.setdefault(loss_key, [])
    total = None
    with torch.no_grad():
        for key in sorted(buckets):
            mode = key[0]
            gs = buckets[key]
            if mode == SCALE_SP:
                for g in gs:
                    g.mul_(mesh.sp_size)
                continue
            parts = [g.reshape(-1) for g in gs]
            if key == loss_key and loss is not None:
                parts.append(loss.detach().reshape(1))
            flat = torch.cat(parts)
            if mesh.sp_size > 1:
                dist.all_reduce(flat, group=mesh.sp_group)
            if mode == SUM_SP_MEAN_DP and dp_on:
                dist.all_reduce(flat, group=mesh.dp_group)
                flat /= mesh.dp_degree
            offset = 0
            for g in gs:
                n = g.numel()
                g.copy_(flat[offset:offset + n].view_as(g))
                offset += n
            if key == loss_key:
                total = flat[offset].clone()
    mark_synced(mesh)
    _record_synced(mesh, [local for _, _, local in items])
    return total
