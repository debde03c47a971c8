"""usp-hal as a transformers attention implementation.

Importing this module registers ``"usp_hal"`` in transformers' ``AttentionInterface`` (and its
mask counterpart), so a model whose attention goes through that interface runs
sequence-parallel (tested: Llama with GQA, Mistral with a sliding window) with::

    import usp_hal.integrations.transformers as usp
    mesh = usp.init_distributed(ulysses_degree=2, ring_degree=1)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="usp_hal")
    out = model(**usp.shard_batch(batch, mesh))          # batch: the global input_ids, labels
    out.loss.backward()
    loss = usp.sync_gradients(model, mesh, out.loss)     # gradients and loss of the whole sequence

What the attention function does with each call (``query`` ``[B, H, S_local, D]``, key/value
``[B, Hkv, S_local, D]``): transposes to usp-hal's ``[B, S_local, H, D]`` and calls
:class:`usp_hal.LongContextAttention` with transformers' ``scaling``, ``dropout``, causality
and sliding window; GQA is handled by the core, without repeating KV heads.

Packed sequences (several documents in one row, attention kept inside each): pass the
global boundaries to :func:`shard_batch` (``cu_seqlens=``, or the ``cu_seq_lens_q`` /
``cu_seq_lens_k`` of transformers' ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``,
or position ids that restart at 0 at every document).  It shards in the layout with those
boundaries, gives position ids restarting per document (RoPE), drops the label that would
predict the next document's first token, and adds ``cu_seq_lens_q/k``, which the model hands
to the attention function with every call; the attention function runs
:class:`usp_hal.LongContextAttention` with ``cu_seqlens``.

Padded batches: pass the global ``attention_mask`` to :func:`shard_batch` with the batch
(``shard_batch({"input_ids": ids, "attention_mask": mask, "labels": labels}, mesh)``).  The
padding travels with the returned position ids (a :class:`Padding`, the same on every rank:
shard_batch checks) and the attention function passes it to :class:`usp_hal.LongContextAttention`
as a per-row key mask over global positions (``mask=``), and'ed with causality and windows:
padded keys are excluded for every query, as transformers does with a 2-D mask.  Tested (tiny
GQA Llama, 1 process, Ulysses-2 and Ring-2): left- and right-padded rows in one batch give one
process's logits at the real tokens, loss and gradients.  A query that sees no key (a left pad)
gets attention output 0, where transformers' kernels disagree among themselves: label it -100,
and the token after a left padding too (the pad predicts it).  Refused: padding with packed
documents, and with the recurrent/convolution models of :mod:`.hybrid`.

What it refuses, on every rank together and before any data is exchanged: padding masks given to
the model directly (2-D masks with zeros: pass them to shard_batch), custom 4-D masks and mask
patterns other than causal, bidirectional and sliding-window ones (image-token blocks, chunked
attention), ``position_ids`` that do not match the layout (missing ones, or packed ones without
their boundaries), a KV cache other than
the ShardedCache holding more tokens than the query,
position biases and ``output_attentions``.

Generation: ``model.generate(**shard_batch({"input_ids": prompt}, mesh), max_new_tokens=N,
do_sample=False)`` runs the prefill as the USP call on the sharded prompt, keeps each rank's
heads and tokens in a :class:`usp_hal.integrations.cache.ShardedCache`, gives every rank the
prompt's last logits (one all-reduce), and decodes each new token on every rank through the
sharded cache (:mod:`usp_hal.serving`): the generated tokens are the same on every rank and
equal a single process's (tested: Llama with GQA, Mistral with a sliding window, 1, 2 and 4
ranks).  The ranks stop together (their stopping criteria are combined each step) and sample
together (every rank starts from the first rank's random state); beam search, assisted
generation, chunked prefill and ``use_cache=False`` (decoding without the sharded cache) are
refused on every rank.

Left-padded prompts of different lengths: ``model.generate(**shard_batch({"input_ids": ids,
"attention_mask": mask}, mesh), max_new_tokens=N)``.  As transformers' generate, each row's
positions (RoPE) count from its first real token (``cumsum(mask) - 1``, 0 on the pads) and
no query attends a pad: the prefill runs with the padding as the key mask, and every decode
step attends only the cached keys from each row's first real token on (``key_start`` of
:meth:`usp_hal.serving.ShardedKVCache.decode`).  Tested: the greedy tokens and logits of one
process's ``generate(ids, attention_mask=mask)`` for prompts with 0, 5 and 12 pads, on 1
process, Ulysses-2, Ring-2 (Llama with GQA, and Mistral with a sliding window) and 2 x 2
ranks.  Right padding (or pads inside a prompt), rows without a token, and an
``attention_mask`` with zeros passed to generate() itself are refused on every rank.

Calls outside the group: a model call (or generate()) whose ``position_ids`` did not come from
:func:`shard_batch` raises at once on its rank, without entering any collective (evaluation on
rank 0 alone after sequence-parallel steps; switch the attention back with
``model.set_attn_implementation("sdpa")`` for that).
Transformers drops a 2-D mask silently for an attention implementation without a mask
function, so one is registered too: it never builds a mask, it reports what it was asked for.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

import usp_hal
from usp_hal.comm import agree, digest_ints

from . import init_distributed, sync_gradients
from .grads import watch

__all__ = ["ATTN_IMPLEMENTATION", "register", "shard_batch", "init_distributed", "sync_gradients",
           "usp_attention_forward", "usp_mask"]

ATTN_IMPLEMENTATION = "usp_hal"
TESTED_VERSIONS = ("5.23.0",)
DEFAULT_LAYOUT = "zigzag"
IGNORE_INDEX = -100


# ----------------------------------------------------------------------------- the mask function
@dataclass(frozen=True)
class MaskInfo:
    """What the model's mask creation asked for, handed to the attention function in place
    of a mask tensor: causal or not, a sliding window, or the reason it cannot be honoured."""

    causal: bool = True
    sliding_window: Optional[int] = None
    refused: Optional[str] = None


_CAUSAL, _BIDIRECTIONAL = "causal_mask_function", "bidirectional_mask_function"
_WINDOW_CAUSAL = "sliding_window_overlay.<locals>.inner_mask"
_WINDOW_BIDIRECTIONAL = "sliding_window_bidirectional_overlay.<locals>.inner_mask"
# transformers wraps the mask function when position_ids are not 0, 1, 2, ... ("packed
# sequences"); sharded positions look like that.  Real packing is refused by the position check.
_PACKED = ("packed_sequence_mask_function.<locals>.inner_mask",
           "remap_positions_for_packed_sequence.<locals>.inner_mask")
_AND = "and_masks.<locals>.and_mask"


def _closure(fn) -> Dict[str, Any]:
    cells = getattr(fn, "__closure__", None) or ()
    return {name: c.cell_contents for name, c in zip(fn.__code__.co_freevars, cells)}


def _describe_mask_function(fn, found: dict) -> Optional[str]:
    """Walk a transformers mask function; return why it cannot be honoured, or None.
    Only patterns known to be plain causal / bidirectional / sliding window are accepted:
    anything else (an unknown name, a union, chunked or block masks) is refused."""
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if name == _CAUSAL:
        found.setdefault("causal", set()).add(True)
        return None
    if name == _BIDIRECTIONAL:
        found.setdefault("causal", set()).add(False)
        return None
    if name in (_WINDOW_CAUSAL, _WINDOW_BIDIRECTIONAL):
        w = _closure(fn).get("sliding_window")
        if not isinstance(w, int):
            return f"a sliding window of unknown size ({name})"
        if name == _WINDOW_BIDIRECTIONAL:
            return ("a bidirectional sliding window (transformers' masks and kernels count it differently; "
                    "use a causal sliding window or full attention)")
        found.setdefault("window", set()).add(w)
        return None
    if name in _PACKED:
        inner = _closure(fn).get("mask_function")
        return None if inner is None else _describe_mask_function(inner, found)
    if name == _AND:
        for sub in _closure(fn).get("mask_functions", ()):
            why = _describe_mask_function(sub, found)
            if why:
                return why
        return None
    return f"the custom mask pattern {name!r} (only causal, bidirectional and causal sliding-window masks)"


# Under torch.compile, Dynamo traces the mask interface; traced, a function's ``__qualname__``
# and closure cells are not what the walk above reads (a traced hybrid model's mask function
# read as 'function' and was refused), so the walk always runs eagerly (one graph break per
# mask built, beside the attention call's own).
_describe_mask_function = torch.compiler.disable(_describe_mask_function, recursive=True)


def usp_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
             attention_mask=None, use_vmap=False, **kwargs) -> MaskInfo:
    """The mask function registered with transformers' ``AttentionMaskInterface``.

    It builds no mask: the attention function applies causality and windows itself.  It
    returns a :class:`MaskInfo` saying what was asked for; refusals are raised by the
    attention function, on every rank together."""
    if attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()):
        return MaskInfo(refused=_DIRECT_PADDING)
    if use_vmap:
        return MaskInfo(refused="a custom mask pattern (or_mask_function/and_mask_function overlays)")
    found: dict = {}
    why = _describe_mask_function(mask_function, found) if mask_function is not None else None
    if why:
        return MaskInfo(refused=why)
    causal = found.get("causal", {True})
    windows = found.get("window", set())
    if len(causal) > 1 or len(windows) > 1:
        return MaskInfo(refused="a mask combining several patterns")
    return MaskInfo(causal=next(iter(causal)), sliding_window=next(iter(windows)) if windows else None)


# ----------------------------------------------------------------------------- the attention function
SHARDED_ATTR = "_usp_hal_sharded"   # set by shard_batch on the position_ids it returns
PADDING_ATTR = "_usp_hal_padding"   # a Padding, set by shard_batch on those position_ids for a padded batch
_DIRECT_PADDING = ("a padding mask (attention_mask with zeros) given to the model or generate() directly: each rank "
                   "would see its own shard of it only; pass the attention_mask to shard_batch with the batch "
                   "(shard_batch({'input_ids': ids, 'attention_mask': mask}, mesh)), which carries the global "
                   "padding to the attention as a key mask")


class Padding:
    """The padding of a batch given to :func:`shard_batch` with an ``attention_mask`` that has
    zeros: ``keep`` ``[B, S]`` (bool, global, the same on every rank: shard_batch checks) says
    which keys every row attends.  ``mask`` is that as a :class:`usp_hal.masks.Mask` over global
    positions (per row), and'ed by the attention with causality and windows; ``left`` holds
    each row's number of leading pads when every row is left-padded (zeros, then ones), else
    None.  It travels with the position_ids shard_batch returns (attribute ``PADDING_ATTR``)."""

    def __init__(self, keep: torch.Tensor):
        from usp_hal.masks import Mask
        self.keep = keep = keep.detach().bool().contiguous()
        bsz, seqlen = keep.shape
        ones = keep.sum(1)
        self.empty_rows = [b for b in range(bsz) if int(ones[b]) == 0]
        lead = (seqlen - ones).tolist()
        idx = torch.arange(seqlen, device=keep.device).view(1, -1)
        is_left = bool((keep == (idx >= (seqlen - ones).view(-1, 1))).all())
        self.left = [int(x) for x in lead] if is_left else None

        def padding_mod(b, h, q_idx, kv_idx):
            return keep.to(kv_idx.device)[b, kv_idx]
        self.mask = Mask.from_mod(padding_mod, batch=int(bsz), name="padding")

    def positions(self, index_positions: torch.Tensor) -> torch.Tensor:
        """generate()'s position ids of a left-padded prompt (transformers: ``cumsum(mask) - 1``,
        0 on the pads) from the tokens' global indices ``[B|1, n]``."""
        assert self.left is not None
        lead = torch.tensor(self.left, dtype=index_positions.dtype, device=index_positions.device).view(-1, 1)
        return (index_positions - lead).clamp(min=0)
# A call is sequence-parallel only when its batch came through shard_batch (its position_ids
# carry SHARDED_ATTR).  Any other call raises at once, on this rank, before any collective: the
# other ranks may not be calling at all (evaluation on rank 0 alone), and attention over this
# rank's tokens only would be silently wrong if the batch was a shard.
_OUTSIDE = ("usp_hal attention (transformers): this {what} did not come through shard_batch (its position_ids "
            "are not the ones shard_batch returns; a copy, e.g. by .to(device), is not: move the batch before "
            "shard_batch), so it is not a sequence-parallel call and usp_hal enters no "
            "collective for it. On every rank of the group pass model(**shard_batch(batch, mesh)); to run the "
            "model on one rank or on whole sequences, switch its attention back first: "
            "model.set_attn_implementation('sdpa') (and back to the usp_hal name afterwards)")

_REFUSED_KWARGS = {
    "position_bias": "a position bias",
    "cache": "a paged KV cache",
}


class _Validated:
    """Per-forward cache of the cross-rank check: the first layer of a forward exchanges, the
    other layers (same position_ids and mask objects) reuse the verdict."""

    def __init__(self):
        self.key = None

    @staticmethod
    def _ref(t):
        if isinstance(t, torch.Tensor):
            return (weakref.ref(t), t._version)
        if t is None or isinstance(t, MaskInfo):
            return (t, None)
        return (id(t), None)

    def make_key(self, mesh, q, position_ids, attention_mask, cu_seqlens=None):
        return (id(mesh), tuple(q.shape), self._ref(position_ids), self._ref(attention_mask), self._ref(cu_seqlens))

    def hit(self, key) -> bool:
        if self.key is None or len(self.key) != len(key):
            return False
        for a, b in zip(self.key, key):
            if isinstance(a, tuple) and a and isinstance(a[0], weakref.ref):
                if not (isinstance(b, tuple) and isinstance(b[0], weakref.ref) and a[0]() is not None
                        and a[0]() is b[0]() and a[1] == b[1]):
                    return False
            elif a != b:
                return False
        return True


class USPAttentionFunction:
    """The function registered in transformers' ``AttentionInterface`` (see :func:`register`)."""

    def __init__(self, mesh=None, layout: str = DEFAULT_LAYOUT, attn_type="auto", rotation: str = "p2p",
                 low_memory=False):
        from usp_hal.attention import low_memory_groups
        from usp_hal.layout import check_layout
        low_memory_groups(low_memory)                   # a bad value fails at registration
        self.low_memory = low_memory
        self.mesh = mesh
        self.layout = check_layout(layout)
        self.attn_type = attn_type
        self.rotation = rotation
        usp_hal.REGISTRY.canonical_name(attn_type)     # unknown names fail at registration
        self._attn: dict = {}
        self._validated = _Validated()

    def _module_for(self, mesh):
        key = id(mesh)
        if key not in self._attn:
            self._attn[key] = (mesh, usp_hal.LongContextAttention(
                attn_type=self.attn_type, ring_impl_type=self.layout, mesh=mesh, rotation=self.rotation,
                low_memory=self.low_memory))
        return self._attn[key][1]

    # -- checks that depend only on the call (the same on every rank of a SPMD program)
    def _local_problem(self, query, key, attention_mask, kwargs, packing_problem=None) -> Optional[str]:
        if isinstance(attention_mask, MaskInfo):
            if attention_mask.refused:
                return attention_mask.refused
        elif isinstance(attention_mask, torch.Tensor):
            if attention_mask.dim() == 2 and bool(attention_mask.bool().all()):
                pass
            else:
                return (f"a {attention_mask.dim()}-D attention mask tensor (custom masks cannot be applied across "
                        "sequence shards); pass no mask")
        elif attention_mask is not None:
            return f"an attention mask of type {type(attention_mask).__name__}"
        for name, what in _REFUSED_KWARGS.items():
            if kwargs.get(name) is not None:
                return what
        if kwargs.get("output_attentions"):
            return "output_attentions=True (sequence-parallel attention never forms the attention weights)"
        if query.shape[2] != key.shape[2]:
            return (f"keys/values of {key.shape[2]} tokens for {query.shape[2]} queries: generation is not supported "
                    "yet with this KV cache (transformers' own caches hold only this rank's tokens), nor "
                    "cross-attention; generate with model.generate(...) or pass "
                    "past_key_values=usp_hal.integrations.cache.ShardedCache(model.config), or run without a cache "
                    "(use_cache=False)")
        if packing_problem:
            return packing_problem
        pos = kwargs.get("position_ids")
        if pos is not None and (not isinstance(pos, torch.Tensor) or pos.dim() not in (1, 2)):
            return ("position_ids of shape "
                    f"{tuple(pos.shape) if isinstance(pos, torch.Tensor) else type(pos).__name__}: only [S] or "
                    "[B, S] position ids are supported (not multi-dimensional RoPE)")
        return None

    def _position_problem(self, mesh, position_ids, seqlen: int, cu=None, padding=None) -> Optional[str]:
        """Why ``position_ids`` are not this rank's positions (None when they are); with a
        left ``padding`` (generate()), the positions transformers gives its padded prompts."""
        if position_ids is None:
            return None
        if padding is not None:
            expect = padding.positions(mesh.local_position_ids(seqlen, self.layout, device=position_ids.device)
                                       .view(1, -1))
            rows = position_ids.reshape(-1, position_ids.shape[-1])
            if tuple(rows.shape) != tuple(expect.shape) or not bool((rows == expect).all()):
                return (f"position_ids {_brief(rows[0].tolist())} are not generate()'s positions of this rank's "
                        f"tokens of the left-padded prompt ({_brief(expect[0].tolist())})")
            return None
        if cu is not None and cu[-1] != seqlen:
            return (f"cu_seq_lens_q ends at {cu[-1]} but the ranks hold {seqlen} tokens: pass the global "
                    "boundaries that shard_batch returns")
        try:
            expect = mesh.local_position_ids(seqlen, self.layout, device=position_ids.device, cu_seqlens=cu)
        except ValueError as exc:
            return f"cu_seq_lens_q does not fit the {self.layout!r} layout of {seqlen} tokens: {exc}"
        rows = position_ids.reshape(-1, position_ids.shape[-1])
        if rows.shape[-1] != expect.numel() or not bool((rows == expect).all()):
            first = rows[0].tolist()
            what = ("position ids (restarting per document)" if cu is not None else "global positions")
            hint = ("" if cu is not None else " (for packed sequences pass their boundaries to shard_batch, which "
                    "adds cu_seq_lens_q/k to the batch)")
            return (f"position_ids {_brief(first)} are not this rank's {what} in the {self.layout!r} layout of the "
                    f"{seqlen}-token sequence ({_brief(expect.tolist())}); pass the position_ids from "
                    f"shard_batch(batch, mesh, layout={self.layout!r}){hint}")
        return None

    def _agree(self, mesh, problem: Optional[str], extra: list) -> list:
        """One small all-gather (``usp_hal.comm.agree``): every rank's error flag and ``extra``
        ints; raise on every rank (with every rank's reason) if any rank has a problem."""
        return agree(problem, mesh.metadata_group, what="usp_hal attention (transformers) cannot run this call",
                     where=mesh.where("sequence-parallel"), values=extra, width=len(extra), ranks=mesh.sp_ranks)

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask=None, dropout: float = 0.0, scaling: Optional[float] = None,
                 is_causal: Optional[bool] = None, **kwargs):
        mesh = self.mesh if self.mesh is not None else usp_hal.get_default_mesh()
        route = getattr(key, _ROUTE_ATTR, None)
        if route is not None:        # the key states came from a usp_hal ShardedCache: prefill or decode
            return self._with_cache(route, mesh, module, query, key, value, attention_mask, dropout, scaling,
                                    is_causal, kwargs)
        position_ids = kwargs.get("position_ids")
        if mesh.sp_size > 1 and not getattr(position_ids, SHARDED_ATTR, False):
            if query.shape[2] != key.shape[2]:      # a decode step with transformers' own cache
                raise ValueError("usp_hal attention (transformers) cannot run this call: "
                                 f"{self._local_problem(query, key, None, {})}")
            raise ValueError(_OUTSIDE.format(what="model call"))
        cu_arg = kwargs.get("cu_seq_lens_q")
        cu, why = _packing(cu_arg, kwargs.get("cu_seq_lens_k"))
        padding = getattr(position_ids, PADDING_ATTR, None)
        if padding is not None:
            why = why or _padding_problem(module, cu)
        problem = self._local_problem(query, key, attention_mask, kwargs, why)
        vkey = self._validated.make_key(mesh, query, position_ids, attention_mask, cu_arg)
        if mesh.sp_size > 1 and not self._validated.hit(vkey):
            self._validated.key = None
            rows = self._agree(mesh, problem, [int(query.shape[2])])
            seqlen = sum(r[0] for r in rows)
            self._agree(mesh, self._position_problem(mesh, position_ids, seqlen, cu), [])
            self._validated.key = vkey
        elif problem:
            raise ValueError(f"usp_hal attention (transformers) cannot run this call: {problem}")

        causal, window, softcap = self._options(module, attention_mask, is_causal, kwargs)
        attn = self._module_for(mesh)
        # gpt-oss style sinks (s_aux, one logit per head): one more term of each row's denominator
        sinks = kwargs.get("s_aux")
        out = attn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p=float(dropout),
                   softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap, cu_seqlens=cu,
                   sinks=sinks, mask=padding.mask if padding is not None else None)
        return watch(out, mesh, "transformers attn_implementation='usp_hal'"), None

    def _options(self, module, attention_mask, is_causal, kwargs):
        """``(causal, window, softcap)`` of a call, from the mask transformers asked for and the layer."""
        info = attention_mask if isinstance(attention_mask, MaskInfo) else None
        if info is not None:
            causal = info.causal
        else:
            causal = bool(is_causal) if is_causal is not None else bool(getattr(module, "is_causal", True))
        softcap = kwargs.get("softcap")
        return causal, _window(kwargs.get("sliding_window"), info, causal), float(softcap) if softcap else 0.0

    def _with_cache(self, route, mesh, module, query, key, value, attention_mask, dropout, scaling, is_causal,
                    kwargs):
        """A call whose key states a :class:`usp_hal.integrations.cache.ShardedCache` handed over:
        the layer's first call is the prefill (the USP call on this rank's shard of the prompt,
        which fills the layer), later ones decode the new tokens (the same on every rank)."""
        cache, layer = route
        problem = self._local_problem(query, key, attention_mask, kwargs)
        if not problem and dropout:
            problem = f"attention dropout ({dropout}) in generation; call model.eval() first"
        if not problem and cache.mesh is not None and cache.mesh != mesh:
            problem = ("the ShardedCache was made for another mesh than the attention function's; pass the mesh "
                       "given to register()")
        try:
            causal, window, softcap = self._options(module, attention_mask, is_causal, kwargs)
        except ValueError as exc:
            problem = problem or str(exc)
            causal, window, softcap = True, (-1, -1), 0.0
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        position_ids = kwargs.get("position_ids")
        padding = getattr(cache, "padding", None)
        if not problem and padding is None and getattr(position_ids, PADDING_ATTR, None) is not None:
            problem = ("a padded batch with a ShardedCache outside generate(): generate left-padded prompts with "
                       "model.generate(**shard_batch(batch, mesh), ...)")
        if cache.core is None or not cache.core.layers[layer].filled:
            rows = self._agree(mesh, problem, [int(query.shape[2])]) if mesh.sp_size > 1 else [[query.shape[2]]]
            if problem and mesh.sp_size == 1:
                raise ValueError(f"usp_hal attention (transformers) cannot run this call: {problem}")
            seqlen = sum(r[0] for r in rows)
            why = self._position_problem(mesh, position_ids, seqlen, padding=padding) if position_ids is not None \
                else "no position_ids: pass the batch from shard_batch(batch, mesh) to generate()"
            if mesh.sp_size > 1:
                self._agree(mesh, why, [])
            elif why:
                raise ValueError(f"usp_hal attention (transformers) cannot run this call: {why}")
            core = cache.ensure_core(mesh, q, k, v, self.attn_type)
            out = core.prefill(layer, self._module_for(mesh), q, k, v, causal=causal, softmax_scale=scaling,
                               window_size=window, softcap=softcap, sinks=kwargs.get("s_aux"),
                               mask=padding.mask if padding is not None else None)
            return out, None
        core = cache.core
        if not problem:
            n = int(query.shape[2])
            starts = torch.tensor(core.lengths(layer), device=query.device).view(-1, 1)
            want = starts + torch.arange(n, device=query.device).view(1, -1)
            if padding is not None:        # transformers counts a padded row's positions from its first token
                want = padding.positions(want)
            if not isinstance(position_ids, torch.Tensor) or position_ids.reshape(-1, n).shape[0] not in \
                    (1, want.shape[0]) or not bool((position_ids.reshape(-1, n) == want).all()):
                got = position_ids.tolist() if isinstance(position_ids, torch.Tensor) else position_ids
                problem = (f"decode position_ids {got} are not the new tokens' global positions "
                           f"{want.tolist()} (the cache holds {core.lengths(layer)} tokens per sequence); a second "
                           "prefill on a filled cache (chunked prefill) is not supported: reset() the cache first")
        out = core.decode(layer, q, k, v, causal=causal, softmax_scale=scaling, window_size=window,
                          softcap=softcap, mesh=mesh, problem=problem, sinks=kwargs.get("s_aux"),
                          key_start=padding.left if padding is not None else None)
        return out, None


def _padding_problem(module, cu=None) -> Optional[str]:
    """Why a padded batch (shard_batch's key mask) cannot run through this layer's model."""
    from .hybrid import COVERED_MODEL_TYPES
    if cu is not None:
        return "a padding mask together with packed documents (cu_seq_lens_q/k)"
    kind = getattr(getattr(module, "config", None), "model_type", None)
    if kind in COVERED_MODEL_TYPES:
        return (f"a padding mask with model type {kind!r}: its recurrent or convolution layers would take the "
                "pads into the real tokens' state (transformers zeroes them with the attention_mask, which the "
                "key mask does not reach); pass batches without padding")
    return None


def _packing(cu_q, cu_k):
    """``(boundaries, None)`` for a packed self-attention call (``cu_seq_lens_q`` as a tuple:
    one host copy of each, and shard_batch gives CPU tensors), ``(None, why)`` when the pair
    cannot be used, ``(None, None)`` without packing."""
    from usp_hal.varlen import as_cu_seqlens
    if cu_q is None and cu_k is None:
        return None, None
    if cu_q is None or cu_k is None:
        return None, "only one of cu_seq_lens_q / cu_seq_lens_k (packed self-attention needs both, equal)"
    try:
        a, b = as_cu_seqlens(cu_q), as_cu_seqlens(cu_k)
    except (TypeError, ValueError) as exc:
        return None, f"cu_seq_lens_q/k: {exc}"
    if a != b:
        return None, "cu_seq_lens_q differs from cu_seq_lens_k (packed cross-attention is not supported)"
    return a, None


def _window(sliding_window, info: Optional[MaskInfo], causal: bool):
    """transformers' causal sliding window W lets a query see itself and the W-1 keys before it."""
    mask_w = info.sliding_window if info is not None else None
    if sliding_window is not None and mask_w is not None and int(sliding_window) != mask_w:
        raise ValueError(f"usp_hal attention (transformers): the layer's sliding_window={sliding_window} differs "
                         f"from its mask's window {mask_w}")
    if mask_w is not None and sliding_window is None:
        raise ValueError(f"usp_hal attention (transformers): the model built a sliding-window mask (window {mask_w}) "
                         "but its attention layer passed no sliding_window; refusing rather than attending to "
                         "everything")
    w = sliding_window if sliding_window is not None else None
    if w is None:
        return (-1, -1)
    if not causal:
        raise ValueError("usp_hal attention (transformers): a bidirectional sliding window is not supported")
    if int(w) < 1:
        raise ValueError(f"usp_hal attention (transformers): sliding_window={w} must be >= 1")
    return (int(w) - 1, 0)


def _brief(xs: list) -> str:
    if len(xs) <= 8:
        return str(xs)
    return "[" + ", ".join(map(str, xs[:4])) + ", ..., " + ", ".join(map(str, xs[-2:])) + "]"


_DEFAULT: Optional[USPAttentionFunction] = None


def usp_attention_forward(module, query, key, value, attention_mask=None, **kwargs):
    """The attention function behind ``attn_implementation="usp_hal"`` with the settings of the
    last :func:`register` call (default: the default mesh, the zigzag layout, ``attn_type="auto"``)."""
    return _DEFAULT(module, query, key, value, attention_mask, **kwargs)


def register(name: str = ATTN_IMPLEMENTATION, *, mesh=None, layout: str = DEFAULT_LAYOUT, attn_type="auto",
             rotation: str = "p2p", low_memory=False, recurrence: str = "auto") -> str:
    """Register usp-hal attention with transformers under ``name`` and return the name.

    ``mesh``: the sequence-parallel mesh (default: the default mesh at call time);
    ``layout``: how the sequence is sharded ("zigzag" balances causal work over a ring;
    ``shard_batch`` must use the same one, which every forward checks through position_ids);
    ``attn_type``/``rotation``/``low_memory``: as for :class:`usp_hal.LongContextAttention`
    (``low_memory=True``: a smaller peak per rank for some more time, see docs/performance.md).
    ``recurrence``: how the recurrences of covered hybrid layers (gated DeltaNet, KDA, Mamba2)
    cross the shards: ``"head_parallel"``, ``"state_passing"`` or ``"auto"`` (state passing
    when the ring degree is above 1 and the layer has it; see docs/hybrid.md).
    Importing this module already registers ``"usp_hal"`` with the defaults.
    """
    global _DEFAULT
    _check_version()
    from transformers import AttentionInterface, AttentionMaskInterface

    from .hybrid import set_recurrence
    set_recurrence(name, recurrence)        # a bad value fails at registration
    fn = USPAttentionFunction(mesh=mesh, layout=layout, attn_type=attn_type, rotation=rotation, low_memory=low_memory)
    _NAMES.add(name)
    _FUNCTIONS[name] = fn
    _guard_generate()
    from .hybrid import install
    install(_FUNCTIONS.get)     # models check their layers before their first sequence-parallel forward
    if name == ATTN_IMPLEMENTATION:
        _DEFAULT = fn
        AttentionInterface.register(name, usp_attention_forward)
    else:
        AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, usp_mask)
    return name


_NAMES: set = set()
_FUNCTIONS: Dict[str, USPAttentionFunction] = {}
_GENERATE_GUARDED = False
_ROUTE_ATTR = "_usp_hal_cache_route"      # usp_hal.integrations.cache.ROUTE_ATTR (not imported: no cost)


def _guard_generate():
    """``generate()`` on a model whose attention is one of ours runs sequence-parallel
    generation (:func:`_sharded_generate`); other models are untouched."""
    global _GENERATE_GUARDED
    if _GENERATE_GUARDED:
        return
    import functools

    from transformers.generation.utils import GenerationMixin
    original = GenerationMixin.generate

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        impl = getattr(getattr(self, "config", None), "_attn_implementation", None)
        if impl in _NAMES:
            return _sharded_generate(original, self, impl, args, kwargs)
        return original(self, *args, **kwargs)

    GenerationMixin.generate = generate
    _GENERATE_GUARDED = True


def _generation_problem(model, ids, kwargs, cache_cls) -> Optional[str]:
    """Why this generate() call cannot run sequence-parallel (None when it can)."""
    gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)

    def opt(name, default=None):
        return kwargs[name] if name in kwargs else getattr(gc, name, default)

    from .hybrid import generation_problem
    why = generation_problem(model)
    if why:
        return why
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return ("input_ids must be this rank's [batch, seq] shard of the prompt: "
                "model.generate(**shard_batch({'input_ids': prompt}, mesh), ...)")
    if kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds (pass input_ids from shard_batch)"
    if not isinstance(kwargs.get("position_ids"), torch.Tensor):
        return "no position_ids: pass the batch from shard_batch(batch, mesh), which gives each rank its positions"
    if (opt("num_beams", 1) or 1) > 1 or (opt("num_return_sequences", 1) or 1) > 1:
        return "beam search / several sequences per prompt (the sharded cache is not reordered); use num_beams=1"
    if kwargs.get("assistant_model") is not None or opt("prompt_lookup_num_tokens") is not None:
        return "assisted generation (the sharded cache cannot be cropped)"
    if opt("use_cache", True) is False:
        return ("use_cache=False (each decode step would recompute the whole sequence, and each rank holds only "
                "its shard of the prompt); generate with use_cache=True (the default), which decodes through the "
                "sequence-parallel ShardedCache")
    if opt("prefill_chunk_size") is not None:
        return "prefill_chunk_size (the prefill is one sequence-parallel call)"
    if kwargs.get("max_new_tokens") is None and getattr(gc, "max_new_tokens", None) is None:
        return ("no max_new_tokens (a max_length would count each rank's shard of the prompt, not the whole "
                "prompt); pass max_new_tokens")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        return _DIRECT_PADDING
    padding = getattr(kwargs.get("position_ids"), PADDING_ATTR, None)
    if padding is not None and padding.empty_rows:
        return (f"prompt row(s) {padding.empty_rows} with no token (their attention_mask is all zeros); leave them "
                "out of the batch")
    if padding is not None and padding.left is None:
        return ("right padding (or padding inside a prompt): generate() appends the new tokens after the last "
                "column, so pad the prompts on the left (tokenizer.padding_side = 'left')")
    cache = kwargs.get("past_key_values")
    if cache is not None and (not isinstance(cache, cache_cls) or not cache.is_empty):
        return ("past_key_values must be an empty usp_hal.integrations.cache.ShardedCache (got "
                f"{type(cache).__name__}{'' if not isinstance(cache, cache_cls) else ' holding tokens'})")
    return None


def _sharded_generate(original, model, impl, args, kwargs):
    """generate() on the sequence-parallel model: the prompt is this rank's shard (from
    :func:`shard_batch`); the prefill is the USP call, filling a
    :class:`~usp_hal.integrations.cache.ShardedCache`; the next-token logits of the prompt's last
    position reach every rank (one all-reduce); every decode step runs the new token on every
    rank and attends through the cache.  Returns what generate returns (this rank's prompt
    shard followed by the generated tokens, which are the same on every rank)."""
    import torch.distributed as dist

    from usp_hal.comm import collective

    from .cache import ShardedCache
    fn = _FUNCTIONS.get(impl, _DEFAULT)
    assert fn is not None
    mesh = fn.mesh if fn.mesh is not None else usp_hal.get_default_mesh()
    kwargs = dict(kwargs)
    if args:
        kwargs.setdefault("input_ids", args[0])
        args = args[1:]
    ids = kwargs.get("input_ids")
    if mesh.sp_size > 1 and not getattr(kwargs.get("position_ids"), SHARDED_ATTR, False):
        raise ValueError(_OUTSIDE.format(what="generate() call"))
    problem = _generation_problem(model, ids, kwargs, ShardedCache)
    pos = kwargs.get("position_ids")
    local = int(ids.shape[1]) if problem is None else 0
    last = int(pos.reshape(-1, pos.shape[-1])[0].max()) if problem is None and local else -1
    tail = int(pos.reshape(-1, pos.shape[-1])[0, -1]) if problem is None and local else -1
    new_tokens, options = _generation_options(model, kwargs)

    def holder_problem(rows):
        if len({r[3] for r in rows}) > 1:
            return ("the ranks passed different max_new_tokens (" + ", ".join(
                f"rank {mesh.sp_ranks[i]}: {r[3]}" for i, r in enumerate(rows)) + "); every rank must generate "
                    "the same number of tokens")
        if len({r[4] for r in rows}) > 1:
            return ("the ranks passed different generation options (" + ", ".join(_AGREED_OPTIONS) + " must be "
                    "the same on every rank)")
        total = sum(r[0] for r in rows)
        holders = [i for i, r in enumerate(rows) if r[1] == total - 1]
        if len(holders) != 1:
            return (f"no single rank holds the prompt's last position {total - 1} (position_ids must be the ones "
                    "shard_batch gives)")
        return None

    rows = agree(problem, mesh.metadata_group, what="usp_hal generate()", where=mesh.where("sequence-parallel"),
                 values=[local, last, tail, new_tokens, options], width=5, ranks=mesh.sp_ranks,
                 check=holder_problem) if mesh.sp_size > 1 else [[local, last, tail]]
    if problem and mesh.sp_size == 1:
        raise NotImplementedError(f"usp_hal generate(): {problem}")
    if mesh.sp_size > 1 and _generation_flag(model, kwargs, "do_sample"):
        _share_rng_state(mesh, ids.device)
    prompt = sum(r[0] for r in rows)
    cache = kwargs.get("past_key_values")
    if cache is None:
        cache = kwargs["past_key_values"] = ShardedCache(model.config, mesh=mesh)
    padding = getattr(pos, PADDING_ATTR, None)
    cache.padding = padding       # the prefill's key mask and the decode steps' key_start
    kwargs.setdefault("attention_mask", torch.ones_like(ids))     # not inferred from pad tokens per shard
    here = (pos.reshape(-1, pos.shape[-1])[0] == prompt - 1).nonzero().flatten().tolist()
    state = {"prefill": True}

    def pre(module, margs, mkw):
        # no padding (checked) or the padding carried by the cache: the attention applies causality and it
        mkw["attention_mask"] = None
        if state["prefill"]:
            if "logits_to_keep" in mkw:       # the prompt's last position, on the rank that holds it
                mkw["logits_to_keep"] = torch.tensor([here[0] if here else local - 1], device=ids.device)
            if padding is not None:           # transformers' positions of left-padded prompts, for RoPE
                mkw["position_ids"] = padding.positions(pos)
            return margs, mkw
        n = int(mkw["input_ids"].shape[1])
        start = max(cache.core.lengths(0)) if cache.core is not None else prompt
        steps = torch.arange(start, start + n, device=ids.device).view(1, n)
        mkw["position_ids"] = padding.positions(steps) if padding is not None else steps.expand(ids.shape[0], n)
        return margs, mkw

    def post(module, margs, mkw, output):
        if not state["prefill"]:
            return output
        state["prefill"] = False
        logits = output.logits
        if here and logits.shape[1] == 1:
            row = logits[:, -1:].clone()
        elif here:
            row = logits[:, here[0]:here[0] + 1].clone()
        else:
            row = torch.zeros_like(logits[:, -1:])
        if mesh.sp_size > 1:   # only the holder's row is non-zero: the sum is its row, exactly
            collective("all-reduce of the prompt's last logits", mesh.where("sequence-parallel"), dist.all_reduce,
                       row, group=mesh.sp_group)
        output.logits = row
        return output

    handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
               model.register_forward_hook(post, with_kwargs=True)]
    own_criteria = model.__dict__.get("_get_stopping_criteria")
    if mesh.sp_size > 1:
        plain = model._get_stopping_criteria

        def agreed_criteria(*a, **kw):
            return _AgreedStop(plain(*a, **kw), mesh)
        model.__dict__["_get_stopping_criteria"] = agreed_criteria
    try:
        return original(model, *args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        if own_criteria is None:
            model.__dict__.pop("_get_stopping_criteria", None)
        else:
            model.__dict__["_get_stopping_criteria"] = own_criteria


# what every rank's generate() must share (compared through one digest; max_new_tokens apart)
_AGREED_OPTIONS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
                   "min_new_tokens", "max_time", "eos_token_id", "pad_token_id", "stop_strings", "num_beams",
                   "no_repeat_ngram_size", "bad_words_ids")


def _generation_flag(model, kwargs, name, default=None):
    if name in kwargs:
        return kwargs[name]
    gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    return getattr(gc, name, default)


def _generation_options(model, kwargs):
    """``(max_new_tokens, digest of the other options every rank must share)``."""
    import zlib
    new = _generation_flag(model, kwargs, "max_new_tokens")
    text = repr([(n, _generation_flag(model, kwargs, n)) for n in _AGREED_OPTIONS]).encode()
    return (int(new) if isinstance(new, int) else -1), zlib.crc32(text)


def _share_rng_state(mesh, device) -> None:
    """Sampling: every rank of the group continues from the first rank's random state (the CPU
    generator, and the device's for a device prompt), so that equal probabilities give equal
    draws; each decode step then checks that the ranks did pick the same tokens."""
    import torch.distributed as dist

    from usp_hal.comm import collective
    src = mesh.sp_ranks[0]
    states: list = [(torch.get_rng_state, torch.set_rng_state)]
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    if module is not None and hasattr(module, "get_rng_state"):
        states.append((lambda: module.get_rng_state(device), lambda st: module.set_rng_state(st, device)))
    for get, put in states:
        state = get().clone()
        collective("broadcast of the sampling generator state", mesh.where("sequence-parallel"), dist.broadcast,
                   state, src=src, group=mesh.metadata_group)
        put(state)


class _AgreedStop(list):
    """The stopping criteria of a sequence-parallel generate(), decided together: each step
    every rank evaluates its criteria (max_time, end of sequence, custom ones), and a row stops
    when any rank's criteria stop it (one small all-gather per step, which also compares the
    tokens just picked: a rank that picked another token raises on every rank)."""

    def __init__(self, criteria, mesh):
        super().__init__(criteria)
        self.criteria, self.mesh = criteria, mesh

    @property
    def max_length(self):
        return self.criteria.max_length

    def __call__(self, input_ids, scores, **kwargs):
        from usp_hal.comm import digest_ints
        done = self.criteria(input_ids, scores, **kwargs)
        mine = [int(x) for x in done.reshape(-1).tolist()]
        tokens = digest_ints(input_ids[:, -1].tolist())
        mesh = self.mesh

        def differ(rows):
            if len({r[-1] for r in rows}) > 1:
                return ("the ranks picked different next tokens (their logits or random states differ); "
                        "generation stopped on every rank")
            return None

        rows = agree(None, mesh.metadata_group, what="usp_hal generate() step", where=mesh.where("sequence-parallel"),
                     values=mine + [tokens], ranks=mesh.sp_ranks, check=differ)
        agreed = [any(r[i] for r in rows) for i in range(len(mine))]
        return torch.tensor(agreed, dtype=torch.bool, device=done.device).view_as(done)


def _check_version():
    import transformers
    from packaging.version import Version
    if Version(transformers.__version__) < Version("5.0"):
        raise ImportError(f"usp_hal.integrations.transformers needs transformers >= 5.0 (its mask interface); "
                          f"found {transformers.__version__}; tested with {', '.join(TESTED_VERSIONS)}")


# ----------------------------------------------------------------------------- batches
_SEQ_KEYS = ("input_ids", "inputs_embeds", "token_type_ids")


def shard_batch(batch: Dict[str, Any], mesh=None, layout: str = DEFAULT_LAYOUT, *, cu_seqlens=None,
                ignore_index: int = IGNORE_INDEX, check: bool = True, dp_group=None) -> Dict[str, Any]:
    """This rank's share of a global batch, ready for ``model(**batch)``.

    Every rank of the sequence-parallel group passes the same global batch (``[B, S]`` tensors).
    Returns ``input_ids`` (or ``inputs_embeds``, ``token_type_ids``) sharded in ``layout``;
    ``position_ids``: this rank's global positions, for RoPE; ``labels`` and ``shift_labels``:
    the labels shifted by one over the *global* sequence (then sharded), so the last token of
    each shard predicts the first token of the next one; ``num_items_in_batch``: the global
    number of labels that count (not ``ignore_index``), so that each rank's loss is its share
    of the loss of the whole sequence (sum them with :func:`sync_gradients`).

    Packed sequences: ``cu_seqlens`` (the global document boundaries ``[0, l1, l1+l2, ..., S]``,
    shared by every row), or ``cu_seq_lens_q``/``cu_seq_lens_k`` in the batch, or
    ``position_ids`` restarting at 0 at every document.  The batch is then sharded with those
    boundaries (``layout="varlen_zigzag"`` balances causal work per document), ``position_ids``
    restart per document, the label of each document's last token (which would predict the
    next document) is ``ignore_index``, and ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32, CPU)
    carry the boundaries to the attention function.

    ``dp_group``: the data-parallel group (``mesh.dp_group``; every replica passes its own
    batch).  ``num_items_in_batch`` is then the non-ignored labels of *every* replica's batch
    divided by the number of replicas (one all-reduce of one integer), so that the mean over
    replicas that :func:`sync_gradients` takes for a plain module (and DDP or FSDP2 for theirs)
    gives the loss and gradients of one process on the replicas' batches together, also when
    the replicas hold different numbers of labels.  Without it each replica's loss is the mean
    over its own labels, and the mean of those means is what the step gets.

    ``attention_mask`` (``[B, S]``, 0 = padding): one of all ones is dropped.  One with padding
    (any pattern: left, right, or both in one batch) is not returned either: the global mask
    travels with the returned ``position_ids`` (a :class:`Padding`) to the attention function,
    which excludes the padded keys for every query (a per-row key mask over global positions,
    and'ed with causality and windows), as transformers does with a 2-D mask; positions stay
    ``0..S-1`` as in a transformers forward without ``position_ids``.  The outputs of a query
    that sees no key (a left pad) are 0 attention (transformers' kernels disagree there: label
    such positions -100).  ``generate()`` takes left-padded prompts this way (see the module
    doc).  Not with packed documents.  Other tensors are refused rather than passed through
    unsharded.  ``check`` (one small all-gather)
    verifies that every rank passed the same batch.
    """
    mesh = mesh if mesh is not None else usp_hal.get_default_mesh()
    problem: Optional[BaseException] = None
    plan = None
    try:
        plan = _batch_plan(batch, layout, cu_seqlens, ignore_index)
        from usp_hal.sharding import empty_rank_problem
        short = empty_rank_problem(mesh, layout, plan[4], plan[5])
        if short:
            raise ValueError(f"shard_batch: {short}")
    except (TypeError, ValueError) as exc:
        problem = exc
    if check and mesh.sp_size > 1:
        # every rank's local checks and its batch's fingerprint, in one small all-gather: a bad
        # or different batch on any rank raises on every rank (none is left in a collective)
        agree(problem, mesh.metadata_group, what="shard_batch", where=mesh.where("sequence-parallel"),
              values=_batch_prints(plan) if plan is not None else (), width=3, ranks=mesh.sp_ranks,
              check=lambda rows: _different_batches(rows, plan))
    elif problem is not None:
        raise problem
    assert plan is not None
    batch, main, seq_keys, bsz, seqlen, cu, shifted, out, padding = plan

    def sh(x):
        return usp_hal.shard(x, layout=layout, mesh=mesh, seq_dim=1, cu_seqlens=cu)

    for k in seq_keys:
        out[k] = sh(batch[k])
    positions = mesh.local_position_ids(seqlen, layout, device=batch[main].device, cu_seqlens=cu)
    out["position_ids"] = positions.unsqueeze(0).expand(bsz, -1).contiguous()
    setattr(out["position_ids"], SHARDED_ATTR, True)     # what makes a model call sequence-parallel
    if padding is not None:       # the global padding, for the attention (a key mask) and generate()
        setattr(out["position_ids"], PADDING_ATTR, padding)
    if cu is not None:
        bounds = torch.tensor(cu, dtype=torch.int32)
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = bounds
    if shifted is not None:
        local = sh(shifted)
        out["labels"] = local           # the model computes a loss only when labels are given ...
        out["shift_labels"] = local     # ... and uses these as they are (already shifted)
        out["num_items_in_batch"] = int((shifted != ignore_index).sum())
    if dp_group is not None:
        total = _global_count(out.get("num_items_in_batch"), dp_group, batch[main].device)
        if total is not None:
            out["num_items_in_batch"] = total
    return out


def _global_count(count: Optional[int], dp_group, device):
    """The label count of every replica's batch over the replicas (see shard_batch's ``dp_group``)."""
    import torch.distributed as dist

    from usp_hal.comm import collective
    replicas = dist.get_world_size(dp_group)
    total = torch.tensor([-1 if count is None else count, 1 if count is None else 0], dtype=torch.int64,
                         device=device)
    collective("all-reduce of the label count", "data-parallel group", dist.all_reduce, total, group=dp_group)
    missing = int(total[1])
    if missing == replicas:
        return None
    if missing:
        raise ValueError("shard_batch: dp_group= counts the labels of every replica's batch, but "
                         f"{missing} of the {replicas} replicas passed a batch without labels")
    return int(total[0]) / replicas


def _batch_plan(batch, layout: str, cu_seqlens, ignore_index: int):
    """The local checks of :func:`shard_batch` (ValueError/TypeError naming the problem), and
    what it shards: ``(batch, main key, sequence keys, B, S, cu, shifted labels, passed-through)``."""
    from usp_hal.positions import check_layout, document_positions
    check_layout(layout)
    if not isinstance(batch, dict) and hasattr(batch, "keys"):
        batch = dict(batch)
    if not isinstance(batch, dict):
        raise TypeError(f"shard_batch: expected a dict of tensors, got {type(batch).__name__}")
    seq_keys = [k for k in _SEQ_KEYS if batch.get(k) is not None]
    main = "input_ids" if batch.get("input_ids") is not None else "inputs_embeds"
    if batch.get(main) is None:
        raise ValueError("shard_batch: the batch has neither input_ids nor inputs_embeds")
    ref = batch[main]
    if ref.dim() < 2:
        raise ValueError(f"shard_batch: {main} must be [batch, seq{', hidden' if main == 'inputs_embeds' else ''}], "
                         f"got shape {tuple(ref.shape)}")
    bsz, seqlen = int(ref.shape[0]), int(ref.shape[1])
    out: Dict[str, Any] = {}
    padding: Optional[Padding] = None
    cu = _batch_boundaries(batch, cu_seqlens, bsz, seqlen)
    for k, v in batch.items():
        if k in seq_keys or k in ("labels", "shift_labels", "attention_mask", "position_ids") + _PACKING_KEYS:
            continue
        if isinstance(v, torch.Tensor):
            raise ValueError(f"shard_batch: don't know how to shard the tensor {k!r} {tuple(v.shape)}; shard it "
                             "yourself with usp_hal.shard(x, layout, mesh, seq_dim=...) or leave it out")
        out[k] = v
    for k in seq_keys:
        v = batch[k]
        if tuple(v.shape[:2]) != (bsz, seqlen):
            raise ValueError(f"shard_batch: {k} has shape {tuple(v.shape)}, expected [{bsz}, {seqlen}, ...]")
    mask = batch.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != (bsz, seqlen):
            raise ValueError("shard_batch: attention_mask must be a [batch, seq] tensor; custom masks are not "
                             "supported by sequence-parallel attention")
        if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
            seen = sorted(set(mask.reshape(-1).tolist()))[:6]
            raise ValueError(f"shard_batch: the attention_mask must hold 0 (padding) and 1 (token) only; got values "
                             f"{seen} ({mask.dtype}). Custom masks are not supported through shard_batch")
        if not bool(mask.bool().all()):
            if cu is not None:
                raise ValueError("shard_batch: an attention_mask with padding together with packed documents "
                                 "(cu_seqlens) is not supported; pack without padding")
            padding = Padding(mask)
    pos = batch.get("position_ids")
    if pos is not None:
        expect = torch.arange(seqlen, device=pos.device)
        if cu is not None:
            expect = document_positions(expect, cu)
        if not bool((pos.reshape(-1, pos.shape[-1]) == expect).all()):
            raise ValueError("shard_batch: position_ids other than 0..S-1 (or, for packed sequences, 0.. in every "
                             "document of cu_seqlens) are not supported; leave position_ids out and shard_batch "
                             "makes them")
    shifted = batch.get("shift_labels")
    if shifted is None and batch.get("labels") is not None:
        labels = batch["labels"]
        if tuple(labels.shape) != (bsz, seqlen):
            raise ValueError(f"shard_batch: labels have shape {tuple(labels.shape)}, expected [{bsz}, {seqlen}] "
                             "(token labels of a causal LM)")
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)
        if cu is not None:      # a document's last token does not predict the next document
            ends = torch.tensor([e - 1 for e in cu[1:] if e > 0], dtype=torch.long, device=shifted.device)
            shifted = shifted.index_fill(1, ends, ignore_index)
    if shifted is not None and tuple(shifted.shape) != (bsz, seqlen):
        raise ValueError(f"shard_batch: shift_labels have shape {tuple(shifted.shape)}, expected [{bsz}, {seqlen}]")
    return batch, main, seq_keys, bsz, seqlen, cu, shifted, out, padding


_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _batch_boundaries(batch, cu_seqlens, bsz: int, seqlen: int):
    """The packed batch's global document boundaries (a tuple), or None for one sequence per row."""
    from usp_hal.varlen import as_cu_seqlens
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    found = []
    if cu_seqlens is not None:
        found.append(("cu_seqlens", as_cu_seqlens(cu_seqlens, seqlen)))
    packed, why = _packing(cu_q, cu_k)
    if why:
        raise ValueError(f"shard_batch: {why}")
    if packed is not None:
        found.append(("cu_seq_lens_q", as_cu_seqlens(packed, seqlen)))
    pos = batch.get("position_ids")
    if not found and isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape[-1] == seqlen:
        rows = pos.reshape(-1, seqlen)
        starts = (rows[0] == 0).nonzero().flatten().tolist()
        if len(starts) > 1 and starts[0] == 0 and bool((rows == rows[0]).all()):
            cu = tuple(starts) + (seqlen,)
            found.append(("position_ids", as_cu_seqlens(cu, seqlen)))
    if len({c for _, c in found}) > 1:
        raise ValueError("shard_batch: the document boundaries disagree: "
                         + "; ".join(f"{name} gives {list(c)}" for name, c in found))
    return found[0][1] if found else None


def _fingerprint(t: torch.Tensor) -> int:
    x = t.detach()
    if x.is_floating_point():
        x = x.to(torch.float64).view(torch.int64)
    x = x.reshape(-1).to(torch.int64).cpu()
    if x.numel() == 0:
        return 0
    w = torch.arange(1, x.numel() + 1, dtype=torch.int64) * 1000003 + 12345
    return int((x * w).sum()) ^ int(x.sum())       # int64 arithmetic wraps: a hash, not a number


def _checked_keys(plan) -> list:
    batch, _, seq_keys = plan[:3]
    return seq_keys + [k for k in ("labels", "shift_labels") if batch.get(k) is not None] + \
        (["attention_mask"] if plan[8] is not None else [])


def _batch_prints(plan) -> list:
    """Three ints that every rank of the group must share: the checked keys, their contents
    (fingerprints) and the document boundaries."""
    batch, cu, keys = plan[0], plan[5], _checked_keys(plan)
    return [digest_ints([len(keys)] + [sum(k.encode()) * 131 + len(k) for k in keys]),
            digest_ints([_fingerprint(batch[k]) for k in keys]), digest_ints(cu) if cu is not None else 0]


def _different_batches(rows, plan) -> Optional[str]:
    if all(r == rows[0] for r in rows):
        return None
    keys = _checked_keys(plan)
    what = ("the keys of the batch" if len({r[0] for r in rows}) > 1 else ", ".join(keys)) + \
        (" or the document boundaries" if plan[5] is not None or any(r[2] for r in rows) else "")
    return ("the ranks of the sequence-parallel group passed different batches "
            f"({what} differ); every rank of the group must pass the same global batch "
            "(give data loaders one shard per data-parallel replica, not per rank)")


register()
