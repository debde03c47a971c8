"""How tokens get into a :class:`~usp_hal.serving.ShardedKVCache`: :meth:`~CacheFilling.load`
from global K/V placed by a layout (or on one ring rank), and :meth:`~CacheFilling.prefill`
through the module's own USP call, whose Ulysses all-to-all delivers each rank the
head-layout K/V of its ring shard (kept with one copy into the cache's storage, no extra
collective).  Decode appends the tokens after these (``usp_hal.serving.kv_cache``)."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Union

import torch

from ..parallel.comm import agree
from ..pipeline.options import CallOptions
from ..pipeline.spec import fingerprint as fingerprint_of
from ..sequence.positions import Segment, check_layout, ring_segments
from .blocktable import add_run

SERVING_WHAT = "usp_hal sharded KV cache"


class CacheFilling:
    """What a :class:`~usp_hal.serving.ShardedKVCache` takes in: :meth:`load`, :meth:`prefill`,
    and the checks of the tensors handed to it (by these and by ``decode``); its storage,
    placement and decode agreement are the cache's own (``usp_hal.serving.kv_cache``)."""

    mesh: Any
    layers: list
    layout: str
    batch_size: int
    num_layers: int
    _config_digest: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    device: torch.device
    _my_heads: Callable[[torch.Tensor], torch.Tensor]
    _reserve: Callable[..., None]

    def load(self, layer: int, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int],
             placement: Union[str, int, Sequence[Union[str, int]], None] = None) -> None:
        """Fill ``layer`` from the global K/V ``[B, S_max, Hkv, D]`` (the same on every rank):
        sequence ``b`` is ``k[b, :lengths[b]]``.  ``placement`` (per sequence, or one for all):
        a layout name (its ring shards, default the cache's ``layout``) or a ring rank that
        holds the whole sequence.  Later tokens are placed by blocks (see the module doc).
        Collective (the ranks agree on the arguments)."""
        m = self.mesh
        ly = self.layers[layer] if 0 <= layer < self.num_layers else None
        problem = None
        per: List[Union[str, int]] = []
        try:
            if ly is None:
                raise ValueError(f"layer {layer} is out of range (the cache has {self.num_layers} layers)")
            self._check_kv(k, v, "load")
            if len(lengths) != self.batch_size or any(int(n) < 0 or int(n) > k.shape[1] for n in lengths):
                raise ValueError(f"lengths {list(lengths)} must give 0..{k.shape[1]} tokens for each of the "
                                 f"{self.batch_size} sequences")
            raw = placement if placement is not None else self.layout
            per = list(raw) if isinstance(raw, (list, tuple)) else [raw] * self.batch_size  # type: ignore[list-item]
            if len(per) != self.batch_size:
                raise ValueError(f"placement has {len(per)} entries for {self.batch_size} sequences")
            for p in per:
                if isinstance(p, int):
                    if not 0 <= p < m.ring_degree:
                        raise ValueError(f"placement ring rank {p} is not in 0..{m.ring_degree - 1}")
                else:
                    check_layout(p)
            if ly.filled:
                raise ValueError(f"layer {layer} already holds tokens; reset() the cache first")
        except (ValueError, TypeError) as exc:
            problem = exc
        codes = [p if isinstance(p, int) else -1 - sum(str(p).encode()) for p in per] or [0] * self.batch_size
        self._agree(problem, "load", [layer, *[int(n) for n in lengths], *codes,
                                      fingerprint_of(k) if problem is None else 0])
        assert ly is not None
        me = m.ring_rank
        segments = [[[Segment(0, int(n))] if p == r else [] if isinstance(p, int) else
                     ring_segments(p, int(n), m.ring_degree, r) for r in range(m.ring_degree)]
                    for n, p in zip(lengths, per)]
        self._reserve(ly, max(1, max(sum(s.count for s in row[me]) for row in segments)))   # this rank's share only
        kk, vv = self._my_heads(k), self._my_heads(v)
        assert ly.k is not None and ly.v is not None
        for b, (n, p) in enumerate(zip(lengths, per)):
            n = int(n)
            for r in range(m.ring_degree):
                segs = segments[b][r]
                ly.counts[b][r] = sum(s.count for s in segs)
                if r != me:
                    continue
                for s in segs:
                    if s.step != 1 and s.count > 1:
                        raise ValueError(f"placement {p!r} is not contiguous; use 'basic' or 'zigzag'")
                    at = ly.hold(b, s.start, s.count)
                    ly.k[b, :, at:at + s.count] = kk[b, s.start:s.start + s.count].transpose(0, 1)
                    ly.v[b, :, at:at + s.count] = vv[b, s.start:s.start + s.count].transpose(0, 1)
            ly.total[b] = n

    def prefill(self, layer: int, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                softmax_scale=None, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                sinks: Optional[torch.Tensor] = None, mask=None) -> torch.Tensor:
        """Run ``attn`` (a :class:`usp_hal.LongContextAttention` on this cache's mesh) on this rank's
        shard ``q``/``k``/``v`` ``[B, S_local, H|Hkv, D]`` (sharded as ``attn``'s layout shards)
        and keep the head-layout K/V its Ulysses all-to-all delivers.  Returns the call's
        output, ``[B, S_local, H, Dv]``.  ``mask``: as for the module's call (a
        :class:`usp_hal.sequence.masks.Mask` over global positions, e.g. the prompts' padding); every
        key is stored, masked or not (decode excludes a left padding with ``key_start``).
        Collective."""
        from ..attention import LongContextAttention
        from ..pipeline import run as _run
        from ..pipeline.options import Sinks
        m = self.mesh
        ly = self.layers[layer] if 0 <= layer < self.num_layers else None
        problem = None
        try:
            if not isinstance(attn, LongContextAttention):
                raise TypeError(f"attn must be a usp_hal.LongContextAttention, got {type(attn).__name__}")
            if attn.pipeline.resolve_mesh() != m:
                raise ValueError("the attention module's mesh is not the cache's mesh")
            if type(attn)._head_groups is not LongContextAttention._head_groups:
                raise ValueError("prefill takes a plain LongContextAttention (not one that pipelines head groups)")
            if not attn.pipeline.layout.contiguous:
                raise ValueError(f"the {attn.pipeline.layout.name!r} layout is not contiguous; prefill a cache with "
                                 "ring_impl_type='basic' or 'zigzag'")
            if ly is None:
                raise ValueError(f"layer {layer} is out of range (the cache has {self.num_layers} layers)")
            if ly.filled:
                raise ValueError(f"layer {layer} already holds {max(ly.total)} tokens: prefill fills an empty "
                                 "layer (decode() appends); reset() the cache for a new batch")
            self._check_kv(k, v, "prefill", q)
            if mask is not None:
                from ..sequence.masks import Mask
                mask = Mask.of(mask)
        except (ValueError, TypeError) as exc:
            problem = exc
        self._agree(problem, "prefill", [layer])
        assert ly is not None
        pipe = attn.pipeline
        opts = CallOptions.of(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                              sinks=Sinks.given(sinks is not None), mask=mask)
        _, plan = pipe.prepare(m, q, k, v, opts, alibi_slopes=alibi_slopes, needs_grad=False)
        ring, me = plan.stages[0].ring, m.ring_rank
        out, kh, vh = _run.run_keeping_kv(plan, q, k, v, sinks)       # the call's own all-to-all delivers them
        n = kh.shape[1]
        self._reserve(ly, max(n, 1))
        assert ly.k is not None and ly.v is not None
        ly.k[:, :, :n] = kh.transpose(1, 2)
        ly.v[:, :, :n] = vh.transpose(1, 2)
        for b in range(self.batch_size):
            ly.local[b] = n
            ly.runs[b] = []
            for s in ring.segments[me]:
                add_run(ly.runs[b], s.start, s.count)
            ly.counts[b] = list(ring.lengths)
            ly.total[b] = sum(ring.lengths)
        return out

    def _agree(self, problem, what: str, values: list) -> None:
        m = self.mesh
        if m.sp_size > 1:
            agree(problem, m.metadata_group, what=f"{SERVING_WHAT}: {what}", where=m.where("sequence-parallel"),
                  values=[self._config_digest, *values], width=1 + len(values), same=True, ranks=m.sp_ranks)
        elif problem is not None:
            raise problem

    def _check_kv(self, k, v, what: str, q=None) -> None:
        for name, t in (("key", k), ("value", v)) + ((("query", q),) if q is not None else ()):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{what}: {name} must be a [batch, seq, heads, head_dim] tensor")
        want_h = self.num_heads
        if k.shape[0] != self.batch_size or k.shape[2] != self.num_kv_heads or k.shape[3] != self.head_dim:
            raise ValueError(f"{what}: key {tuple(k.shape)} does not match the cache (batch {self.batch_size}, "
                             f"{self.num_kv_heads} KV heads, head_dim {self.head_dim})")
        if tuple(v.shape[:3]) != tuple(k.shape[:3]) or v.shape[3] != self.v_head_dim:
            raise ValueError(f"{what}: value {tuple(v.shape)} does not match key {tuple(k.shape)} and v_head_dim "
                             f"{self.v_head_dim}")
        if q is not None and (tuple(q.shape[:2]) != tuple(k.shape[:2]) or q.shape[2] != want_h
                              or q.shape[3] != self.head_dim):
            raise ValueError(f"{what}: query {tuple(q.shape)} does not match the cache ({want_h} heads, head_dim "
                             f"{self.head_dim}) and key {tuple(k.shape)}")
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v) if t is not None):
            raise ValueError(f"{what}: inputs that require gradients: the sharded KV cache serves inference and "
                             "passes no gradient; run under torch.no_grad() (or, for training, without a cache)")
        for name, t in (("key", k), ("value", v)) + ((("query", q),) if q is not None else ()):
            if t.dtype != self.dtype or t.device != self.device:
                raise ValueError(f"{what}: {name} is {t.dtype} on {t.device}; the cache holds {self.dtype} on "
                                 f"{self.device}")
