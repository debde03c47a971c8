"""usp-hal as the attention of torchtitan 0.3.0's decoders (tested: Llama3, and gpt-oss's attention with sinks).

torchtitan's own context parallel swaps each block's ``attention.inner_attention.forward``
(torchtitan/distributed/context_parallel/api.py, ``apply_cp_to_forward``) before
``Module.parallelize()`` wraps it in TP's ``local_map``.  :func:`apply_usp` uses the same hook:
every inner attention becomes a call of one :class:`usp_hal.LongContextAttention` over
``mesh`` (Ulysses x Ring over the sequence-parallel ranks), so it composes with torchtitan's
TP (the hook sees this TP rank's heads; Ulysses then splits those over the sp group) and
FSDP2 (``apply_fsdp_to_decoder``, which shards over ``dp_shard x cp``: use the ``cp`` mesh
dim as the sequence-parallel one)::

    mesh = usp_hal.init_sequence_parallel(device_mesh=parallel_dims.get_mesh("cp"), set_default=False)
    apply_usp(model, mesh)                    # in place of apply_cp_to_forward: before model.parallelize and FSDP
    ...
    tokens, labels = (usp_hal.shard(t, layout="zigzag", mesh=mesh) for t in (tokens, labels))
    logits = model(tokens, positions=local_positions(mesh, S, B))    # this rank's tokens, their global positions
    loss = ce_sum(logits, labels) / global_valid_tokens               # torchtitan's own loss convention
    loss.backward()

No :func:`usp_hal.integrations.sync_gradients` here: torchtitan's ``apply_fsdp_to_decoder``
sets FSDP's gradient divide factor to 1.0, so FSDP *sums* over ``dp_shard x cp`` (the sp ranks
included) and, with the loss divided by the global token count, the gradients are already the
whole sequence's.  ``sync_gradients`` takes a DTensor gradient whose mesh holds the sp group
as averaged and multiplies it by sp (measured: the gradient norm doubled on sp 2).

What the hook honours: ``scale``, ``is_causal``, GQA (heads as they arrive), a causal sliding
window that the block's config declares (gpt-oss ``sliding_window_size``), and gpt-oss's
sinks: its ``out_transform`` (``out * sigmoid(lse - sink)``) is softmax with ``exp(sink)`` in
the denominator, which usp-hal computes itself (``sinks=``, gradient included); any other
``out_transform`` is refused (usp-hal's lse output carries no gradient).

Refused: an inner attention other than torchtitan's ``ScaledDotProductAttention`` /
``FlexAttention`` (by layer name, in :func:`apply_usp`: e.g. ``VarlenAttention``, whose
documents come as metadata built from local positions); at call time, ``attention_masks``
(a BlockMask or varlen metadata is built over this rank's tokens only: call the model with
``attention_masks=None``, the attention is causal over the global sequence) and flex
``score_mod``; a model call without ``positions`` while the sequence is sharded (RoPE would
number this rank's tokens from 0).  Each raises on every rank alike (the same call).
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

__all__ = ["apply_usp", "local_positions", "SUPPORTED_INNER_ATTENTION"]

SUPPORTED_INNER_ATTENTION = ("ScaledDotProductAttention", "FlexAttention")


def local_positions(mesh, seqlen: int, batch: int, layout: str = "zigzag", device=None) -> torch.Tensor:
    """This rank's global positions ``[batch, S_local]`` (the ``positions=`` of the model call)."""
    from usp_hal import shard
    pos = torch.arange(seqlen, device=device).unsqueeze(0).expand(batch, seqlen)
    return shard(pos, layout=layout, mesh=mesh)


def _window(model, index: int) -> Tuple[int, int]:
    """The causal sliding window a layer's config declares (gpt-oss), as flash's window_size."""
    layers = getattr(getattr(model, "config", None), "layers", None)
    try:
        size = layers[index].attention.sliding_window_size  # type: ignore[index]
    except (AttributeError, IndexError, TypeError):
        return (-1, -1)
    return (-1, -1) if size is None else (int(size) - 1, 0)


def apply_usp(model: torch.nn.Module, mesh, *, layout: str = "zigzag", **usp_kwargs: Any) -> int:
    """Make every transformer block's inner attention usp-hal's (before ``model.parallelize``
    and FSDP).  ``layout``: how the tokens are sharded (``usp_hal.shard(x, layout=...)``);
    ``usp_kwargs`` go to :class:`usp_hal.LongContextAttention`.  Returns the number of layers
    replaced; refuses, naming them, layers it cannot shard (module docstring)."""
    from usp_hal import LongContextAttention
    blocks = getattr(model, "layers", None)
    if blocks is None:
        raise TypeError(f"apply_usp: {type(model).__name__} has no .layers; pass a torchtitan Decoder "
                        "(Llama3Model, Qwen3Model, GptOssModel, ...)")
    found: List[Tuple[str, Any, Tuple[int, int]]] = []
    refused: List[str] = []
    for i, (name, block) in enumerate(blocks.items() if hasattr(blocks, "items") else enumerate(blocks)):
        inner = getattr(getattr(block, "attention", None), "inner_attention", None)
        kind = type(inner).__name__
        if kind in SUPPORTED_INNER_ATTENTION:
            found.append((str(name), inner, _window(model, i)))
        else:
            refused.append(f"layers.{name}: {kind}")
    if refused:
        raise NotImplementedError(
            "apply_usp: these layers' inner attention cannot be sequence-sharded by usp-hal: " + "; ".join(refused)
            + f" (supported: torchtitan's {' and '.join(SUPPORTED_INNER_ATTENTION)}; build the model with one of "
            "them, e.g. attn_backend='flex', or leave those layers unsharded by not using apply_usp)")
    attn = LongContextAttention(ring_impl_type=layout, mesh=mesh, **usp_kwargs)
    for name, inner, window in found:
        inner.forward = _usp_forward(attn, name, window)      # the hook torchtitan's own CP uses
    model.register_forward_pre_hook(_needs_positions(mesh), with_kwargs=True)
    model._usp_attention = attn
    return len(found)


def _usp_forward(attn, name: str, window: Tuple[int, int]):
    def forward(q, k, v, *, attention_masks=None, scale: Optional[float] = None, enable_gqa: bool = False,
                is_causal: bool = True, score_mod=None, out_transform=None, **_):
        if attention_masks is not None or score_mod is not None:
            raise NotImplementedError(
                f"apply_usp (layers.{name}): attention_masks/score_mod are built over this rank's tokens only; call "
                "the model with attention_masks=None (usp-hal attends causally over the global sequence; packed "
                "documents are not supported through this hook)")
        if out_transform is None:
            return attn(q, k, v, softmax_scale=scale, causal=is_causal, window_size=window)
        sinks = _sinks_of(out_transform)
        if sinks is None:
            raise NotImplementedError(
                f"apply_usp (layers.{name}): an out_transform other than gpt-oss's sink rescaling "
                f"({getattr(out_transform, '__qualname__', out_transform)!r}): it would need the gradient of the "
                "lse, which usp-hal's attention does not return")
        # gpt-oss's out * sigmoid(lse - sink) is softmax with exp(sink) in the denominator: usp-hal's sinks=
        return attn(q, k, v, softmax_scale=scale, causal=is_causal, window_size=window, sinks=sinks)
    return forward


def _sinks_of(out_transform) -> Optional[torch.Tensor]:
    """The per-head sink logits behind gpt-oss's ``Attention._apply_sinks`` (this TP rank's
    heads, as its own hook takes them: torchtitan/models/gpt_oss/model.py), else None."""
    owner = getattr(out_transform, "__self__", None)
    sinks = getattr(owner, "sinks", None)
    if getattr(out_transform, "__name__", "") != "_apply_sinks" or not isinstance(sinks, torch.Tensor):
        return None
    to_local = getattr(sinks, "to_local", None)
    return to_local(grad_placements=sinks.placements) if to_local is not None else sinks  # type: ignore[attr-defined]


def _needs_positions(mesh):
    def hook(module, args, kwargs):
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if positions is None and mesh.sp_size > 1:
            raise ValueError(
                "apply_usp: the model was called without positions= while its sequence is sharded over "
                f"{mesh.sp_size} ranks: RoPE would number this rank's tokens from 0; pass positions="
                "usp_hal.integrations.torchtitan.local_positions(mesh, S, B, layout)")
    return hook
