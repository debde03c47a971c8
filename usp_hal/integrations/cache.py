"""A transformers ``Cache`` over :class:`usp_hal.serving.ShardedKVCache`: generation with
``attn_implementation="usp_hal"`` on a sequence-parallel mesh.

Each rank keeps the K/V of its heads (Ulysses) and its tokens (Ring); see
:mod:`usp_hal.serving` for the placement and the decode step.  The cache never hands
transformers a tensor of cached keys: ``update`` tags the new key states with the cache and
the layer, and the usp_hal attention function (``usp_hal.integrations.transformers``) routes
the call: the first call of a layer is the prefill (the USP call on the sharded prompt, which
fills the layer), every later one a decode step (the new tokens, the same on every rank).

With ``model.generate(**shard_batch(batch, mesh), max_new_tokens=N, do_sample=False)`` the
integration creates one and hands it to generate itself; pass ``past_key_values=ShardedCache()``
to keep it.  ``get_seq_length()`` is the global length (every rank agrees on it).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

ROUTE_ATTR = "_usp_hal_cache_route"     # set on the key states update() returns: (cache, layer index)


class _ShardedLayer(CacheLayerMixin):
    """One layer's view of the sharded cache (the storage lives in the core cache)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: "ShardedCache", index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        setattr(key_states, ROUTE_ATTR, (self.owner, self.index))
        return key_states, value_states

    def get_seq_length(self) -> int:
        core = self.owner.core
        return max(core.lengths(self.index)) if core is not None else 0

    def get_mask_sizes(self, query_length: int):
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        core = self.owner.core
        if core is not None:
            core.layers[self.index].reset()

    def offload(self):
        raise NotImplementedError("usp_hal ShardedCache: offloading is not supported (each rank already holds "
                                  "1/W of the cache)")

    def prefetch(self):
        return None

    def _unsupported(self, what: str):
        raise NotImplementedError(f"usp_hal ShardedCache: {what} is not supported (greedy or sampled decoding of "
                                  "one sequence per row only; no beam search, no cropping)")

    def reorder_cache(self, beam_idx) -> None:
        self._unsupported("reorder_cache (beam search)")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("crop (assisted generation)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        self._unsupported("batch_select_indices")


class ShardedCache(Cache):
    """The transformers Cache of a sequence-parallel model (see the module doc).

    ``config``: the model config (its ``num_hidden_layers``), or pass ``num_layers``;
    ``mesh``: default the attention function's; ``block_size``: the decode placement block;
    ``verify``: ``"layer"`` (default: every layer's decode agrees on the CPU side group after
    its local work; nothing is read from the device) or ``"step"`` (the ranks agree once per
    step, at layer 0, and every later layer reads a failure flag from the device: a host sync
    per layer); ``check_inputs=True``: a debugging aid that also compares a fingerprint of
    each layer's new q, k and v (see :class:`usp_hal.serving.ShardedKVCache`).  The storage is
    created at the first prefill, from the shapes it sees (collective: every rank of the
    group does it together).
    """

    def __init__(self, config: Any = None, *, num_layers: Optional[int] = None, mesh=None, block_size: int = 256,
                 attn_type: Optional[str] = None, verify: str = "layer", check_inputs: bool = False):
        if num_layers is None:
            if config is None:
                raise ValueError("ShardedCache needs the model config (or num_layers=)")
            cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
            num_layers = int(cfg.num_hidden_layers)
        super().__init__(layers=[_ShardedLayer(self, i) for i in range(num_layers)])
        self.mesh = mesh
        self.block_size = block_size
        self.attn_type = attn_type
        self.verify = verify
        self.check_inputs = check_inputs
        self.core: Any = None        # usp_hal.serving.ShardedKVCache, built at the first prefill
        #: the prompts' padding (``usp_hal.integrations.transformers.Padding``, set by generate()
        #: from shard_batch's attention_mask): the prefill's key mask, and the first real position
        #: of each row, before which decode steps attend no key
        self.padding: Any = None

    def ensure_core(self, mesh, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_type: str):
        """The core cache (created on the first prefill, from ``[B, S, H|Hkv, D]`` shapes)."""
        if self.core is None:
            from usp_hal.serving import ShardedKVCache
            self.core = ShardedKVCache(
                mesh, num_layers=len(self.layers), batch_size=int(query.shape[0]), num_heads=int(query.shape[2]),
                num_kv_heads=int(key.shape[2]), head_dim=int(query.shape[3]), v_head_dim=int(value.shape[3]),
                dtype=query.dtype, device=query.device, block_size=self.block_size,
                attn_type=self.attn_type or attn_type, verify=self.verify, check_inputs=self.check_inputs)
        return self.core

    @property
    def is_empty(self) -> bool:
        return self.core is None or not any(ly.filled for ly in self.core.layers)

    def memory_bytes(self) -> int:
        """K/V bytes this rank holds (allocated)."""
        return 0 if self.core is None else self.core.memory_bytes()


def route_of(key: torch.Tensor):
    """``(cache, layer index)`` when ``key`` came from :meth:`ShardedCache.update`, else None."""
    return getattr(key, ROUTE_ATTR, None)
