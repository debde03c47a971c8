"""A causal LM's loss in sequence tiles: the vocabulary projection and the cross entropy run on
``chunk_tokens`` tokens at a time, and the backward computes each tile's logits again, so the
``[B, S, V]`` logits (and their float32 copy, and their gradient) never exist whole.  At long
sequences they are what a training step holds most of: with a 128k vocabulary each token's
float32 logits take 512 KiB.

    from usp_hal.integrations.training.tiled_loss import enable_tiled_loss
    enable_tiled_loss(model)                          # a transformers causal LM
    model(**usp.shard_batch(batch, mesh)).loss.backward()

What changes, and only in a call that computes a loss with gradients on (``labels`` given as a
keyword, grad mode on): the output head returns a stand-in instead of the logits, and the
model's ``loss_function`` (transformers' ``ForCausalLMLoss``, which every tile calls) computes
the loss from it tile by tile under activation checkpointing.  The loss and every gradient are
the untiled ones up to float summation order (the loss is a sum over tiles divided by the
number of counted labels, which is what the untiled mean or ``num_items_in_batch`` sum is).
Other calls (generation, evaluation under ``no_grad``) are untouched.

A model whose forward does anything with the logits besides handing them to ``loss_function``
(a final soft cap, a logit scale, a loss of its own) touches the stand-in, which raises a
:class:`TiledLossError` naming the model and what it did: such a model is refused, never
trained with a loss that skips its transformation.  The returned output's ``logits`` is the
stand-in too; read logits with the tiled loss off (:func:`disable_tiled_loss`).

A head whose calls are collectives (an FSDP2 unit of its own, a tensor-parallel head) is called
as often on every rank of its mesh: the ranks agree on the most tiles any of them has (one
all-reduce and one host read per loss) and the others add empty tiles, so no rank waits on a
call another never makes.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["enable_tiled_loss", "disable_tiled_loss", "TiledLossError", "TiledLogits"]


class TiledLossError(AttributeError):
    """A model used its logits in a way the tiled loss cannot serve (an AttributeError too, so
    that ``hasattr`` on the stand-in stays False instead of raising)."""


def _refuse(model_name: str, what: str) -> TiledLossError:
    return TiledLossError(
        f"usp_hal tiled loss: {model_name} uses its logits beyond handing them to loss_function ({what}); "
        "the tiled loss serves causal LMs whose forward passes the output head's result straight to "
        "loss_function. Train this model without it (disable_tiled_loss(model), or leave tiled_loss off), "
        "or read logits in a call without labels or under torch.no_grad()")


class TiledLogits:
    """Stands where a training call's logits would be: holds the hidden states the output head
    was given.  Only the tiled loss function reads it; any other use raises :class:`TiledLossError`."""

    __slots__ = ("hidden", "owner")

    def __init__(self, hidden: torch.Tensor, owner: "_Tiling") -> None:
        self.hidden, self.owner = hidden, owner

    def __getattr__(self, name: str) -> Any:
        raise _refuse(self.owner.model_name, f"logits.{name}")

    def contiguous(self, *args, **kwargs) -> "TiledLogits":
        """Each tile's logits are made in the loss, contiguous: nothing to do (OPT calls it
        between its head and its loss: transformers models/opt/modeling_opt.py)."""
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        owner = next((a.owner for a in list(args) + list((kwargs or {}).values()) if isinstance(a, TiledLogits)), None)
        raise _refuse(owner.model_name if owner else "the model", f"{getattr(func, '__name__', func)}(logits, ...)")

    def __repr__(self) -> str:
        return f"TiledLogits(not materialized: hidden {tuple(self.hidden.shape)})"


def _operator(name: str):
    def op(self, *args):
        raise _refuse(self.owner.model_name, f"the operator {name}")
    op.__name__ = name
    return op


for _name in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv", "pow", "matmul",
              "rmatmul", "neg", "pos", "abs", "getitem", "setitem", "iter", "len", "lt", "le", "gt", "ge",
              "float", "int", "bool", "array"):
    setattr(TiledLogits, f"__{_name}__", _operator(f"__{_name}__"))


class _Tiling:
    """One model's tiled-loss installation: its output head's and loss function's originals,
    the tile size, and whether the call running on this thread computes a tiled loss."""

    def __init__(self, model, head, loss_fn, chunk_tokens: int) -> None:
        self.model_name = type(model).__name__
        self.head, self.head_forward, self.loss_fn = head, head.forward, loss_fn
        self.chunk = int(chunk_tokens)
        self.local = threading.local()       # per thread: a stack of "this forward is armed"
        self.hooks: list = []
        self.calls = 0                       # losses computed in tiles (what tests check ran)
        # what to put back: an instance-level head forward and loss function, if there were any
        self.own_forward = vars(head).get("forward")
        self.own_loss = vars(model).get("_loss_function")

    def _stack(self) -> list:
        """This thread's stack of "the forward running here is armed" (the innermost last)."""
        stack = getattr(self.local, "stack", None)
        if stack is None:
            stack = self.local.stack = []
        return stack

    @property
    def armed(self) -> bool:
        stack = self._stack()
        return bool(stack) and stack[-1]

    # the output head: a stand-in while armed, else the head as it was
    def head_call(self, hidden, *args, **kwargs):
        if not self.armed or args or kwargs:
            return self.head_forward(hidden, *args, **kwargs)
        if torch.compiler.is_compiling():
            raise _refuse(self.model_name, "a compiled forward; the tiled loss runs eagerly only")
        return TiledLogits(hidden, self)

    def head_of(self, hidden):
        """The real logits of ``hidden``: the head module called as such (its hooks run, e.g. an
        FSDP unit's parameter gathering), disarmed for the call, also in the backward's recompute."""
        stack = self._stack()
        stack.append(False)
        try:
            return self.head(hidden)
        finally:
            stack.pop()

    def loss(self, logits=None, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index: int = -100,
             shift_labels=None, **kwargs):
        if not isinstance(logits, TiledLogits):
            return self.loss_fn(logits=logits, labels=labels, vocab_size=vocab_size,
                                num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                                shift_labels=shift_labels, **kwargs)
        hidden = logits.hidden
        self.calls += 1
        if shift_labels is None:       # as ForCausalLMLoss shifts, once over the whole row (not per tile)
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(hidden.device)
        problem = None
        if tuple(shift_labels.shape) != tuple(hidden.shape[:2]):
            problem = ValueError(f"usp_hal tiled loss: {self.model_name}'s labels have shape "
                                 f"{tuple(shift_labels.shape)}, its hidden states {tuple(hidden.shape[:2])} tokens")
        # split always gives a piece (an empty one for no tokens: the untiled sum/0 then).  A head
        # whose every call is a collective (an FSDP unit, tensor parallel) is called as often on
        # every rank of its mesh: a rank with fewer tokens adds empty tiles, and a refusal is
        # raised on every rank of that mesh
        pieces = list(zip(hidden.split(self.chunk, dim=1), shift_labels.split(self.chunk, dim=1)))
        tiles = _agreed_tiles(self.head, len(pieces), problem)
        pieces += [(hidden[:, :0], shift_labels[:, :0])] * (tiles - len(pieces))
        # the untiled mean is the sum over the counted labels divided by their number: every tile
        # divides its sum by that number (a device tensor: no host read)
        count = num_items_in_batch if num_items_in_batch is not None else (shift_labels != ignore_index).sum()

        def tile(h, y):
            y = y.contiguous()            # ForCausalLMLoss flattens it with view()
            return self.loss_fn(logits=self.head_of(h), labels=y, vocab_size=vocab_size,
                                num_items_in_batch=count, ignore_index=ignore_index, shift_labels=y, **kwargs)

        total = None
        for h, y in pieces:
            # the head and the cross entropy draw no random numbers: no RNG state to keep per tile
            part = checkpoint(tile, h, y, use_reentrant=False, preserve_rng_state=False) \
                if torch.is_grad_enabled() else tile(h, y)
            total = part if total is None else total + part
        return total

    # arming around the model's own forward
    def pre_hook(self, module, args, kwargs):
        self._stack().append(torch.is_grad_enabled() and kwargs.get("labels") is not None)

    def post_hook(self, module, args, kwargs, output):
        stack = self._stack()
        if stack:
            stack.pop()


def _head_mesh(head):
    """Where a call of ``head`` is collective: its FSDP2 unit's mesh, or the mesh of a DTensor
    parameter (tensor parallel); None for a plain head, "world" for an FSDP2 unit whose mesh
    is not where this torch keeps it."""
    from torch.distributed.fsdp import FSDPModule
    if isinstance(head, FSDPModule):
        try:     # FSDP2 keeps the unit's mesh on its parameter group (no public accessor)
            return head._get_fsdp_state()._fsdp_param_group.mesh_info.mesh
        except AttributeError:
            return "world"          # the default group: every rank computes this loss
    return next((p.device_mesh for p in head.parameters() if hasattr(p, "device_mesh")), None)


def _agreed_tiles(head, n: int, problem: Optional[Exception] = None) -> int:
    """``n`` tiles, or the most any rank of ``head``'s mesh has (an all-reduce per mesh
    dimension and one host read, only for a head whose calls are collectives).  ``problem``,
    this rank's refusal, is raised here: on every rank of such a head's mesh (the others name
    it as another rank's), so that none waits on a head call a refusing rank never makes."""
    mesh = _head_mesh(head)
    if mesh is None:
        if problem is not None:
            raise problem
        return n
    import torch.distributed as dist
    world = isinstance(mesh, str)
    p = next(head.parameters(), None)
    # on the mesh's device type (parameters offloaded to the host still communicate there)
    device = (p.device if p is not None else "cpu") if world else mesh.device_type
    t = torch.tensor([n, int(problem is not None)], dtype=torch.long, device=device)
    for g in ([None] if world else [mesh.get_group(d) for d in range(mesh.ndim)]):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
    most, refused = t.tolist()
    if problem is not None:
        raise problem
    if refused:
        raise ValueError("usp_hal tiled loss: another rank of the output head's mesh refused its loss (see that "
                         "rank's error); every rank stops here, none waits on the head's collectives")
    return most


def check_chunk_tokens(value, what: str = "chunk_tokens") -> int:
    """``value`` as tokens per tile (a positive int), else a ValueError naming ``what``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"usp_hal tiled loss: {what} must be a positive int (tokens per tile), got {value!r}")
    return value


def enable_tiled_loss(model, chunk_tokens: int = 1024):
    """Compute ``model``'s training loss in tiles of ``chunk_tokens`` tokens (see the module doc).
    ``model``: a transformers causal LM whose ``loss_function`` is transformers' ``ForCausalLMLoss``
    and whose output head is ``model.get_output_embeddings()``.  Returns ``model``."""
    name = type(model).__name__
    check_chunk_tokens(chunk_tokens)
    if getattr(model, "_usp_tiled_loss", None) is not None:
        model._usp_tiled_loss.chunk = chunk_tokens
        return model
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError as exc:      # pragma: no cover - transformers is what this integrates with
        raise ImportError("usp_hal tiled loss needs transformers (pip install transformers)") from exc
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        raise TypeError(f"usp_hal tiled loss: {name} has no output head (get_output_embeddings() is {head!r}); "
                        "it serves causal LMs")
    loss_fn = getattr(model, "loss_function", None)
    if loss_fn is not ForCausalLMLoss:
        raise TypeError(f"usp_hal tiled loss: {name}'s loss_function is "
                        f"{getattr(loss_fn, '__name__', loss_fn)!r}, not transformers' ForCausalLMLoss (loss_type "
                        f"{getattr(model, 'loss_type', None)!r}); the tiled loss computes that loss only. Train this "
                        "model without it")
    t = _Tiling(model, head, loss_fn, chunk_tokens)
    head.forward = t.head_call
    model.loss_function = t.loss
    t.hooks = [model.register_forward_pre_hook(t.pre_hook, with_kwargs=True),
               model.register_forward_hook(t.post_hook, with_kwargs=True, always_call=True)]
    model._usp_tiled_loss = t
    return model


def disable_tiled_loss(model):
    """Undo :func:`enable_tiled_loss` (a no-op for a model without it).  Returns ``model``."""
    t: Optional[_Tiling] = getattr(model, "_usp_tiled_loss", None)
    if t is None:
        return model
    for h in t.hooks:
        h.remove()
    if t.own_forward is not None:
        t.head.forward = t.own_forward
    else:
        del t.head.forward                 # back to the class's forward
    if t.own_loss is not None:
        model.loss_function = t.own_loss
    else:
        del model._loss_function           # back to transformers' own choice
    model._usp_tiled_loss = None
    return model
