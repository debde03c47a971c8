"""usp-hal's attention function for transformers (:class:`USPAttentionFunction`), and the calls
that make it and its companions known to transformers: :func:`register`, :func:`enable`,
:func:`disable` and :func:`patched`.

Importing this module (or its package) changes nothing in transformers.  :func:`enable` makes
every process-wide change (``GenerationMixin.generate``, ``PreTrainedModel.post_init`` and
``set_attn_implementation``, and the per-head sequence functions of the covered hybrid layers'
modeling modules), :func:`register` calls it and adds its name to ``AttentionInterface`` and
``AttentionMaskInterface``; both log what they changed, :func:`patched` lists it as
"module.qualname" strings, and :func:`disable` restores every original.
"""
from __future__ import annotations

import logging
import weakref
from typing import Dict, List, Optional

import torch

import usp_hal
from usp_hal.integrations.sequence_mixers import layers_checked
from usp_hal.integrations.training.grads import watch
from usp_hal.parallel.comm import agree

from .batch import _OUTSIDE, DEFAULT_LAYOUT, PADDING_ATTR, SHARDED_ATTR, _brief, _packing
from .masks import TESTED_VERSIONS, MaskInfo, usp_mask

__all__ = ["ATTN_IMPLEMENTATION", "USPAttentionFunction", "register", "enable", "disable", "patched",
           "usp_attention_forward"]

log = logging.getLogger("usp_hal")

ATTN_IMPLEMENTATION = "usp_hal"


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
        from usp_hal.sequence.positions import check_layout
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
        """One small all-gather (``usp_hal.parallel.comm.agree``): every rank's error flag and ``extra``
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
        if problem is None and mesh.sp_size > 1 and not layers_checked(module):
            problem = _UNCHECKED
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
    from usp_hal.integrations.sequence_mixers import COVERED_MODEL_TYPES
    if cu is not None:
        return "a padding mask together with packed documents (cu_seq_lens_q/k)"
    kind = getattr(getattr(module, "config", None), "model_type", None)
    if kind in COVERED_MODEL_TYPES:
        return (f"a padding mask with model type {kind!r}: its recurrent or convolution layers would take the "
                "pads into the real tokens' state (transformers zeroes them with the attention_mask, which the "
                "key mask does not reach); pass batches without padding")
    return None


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


_DEFAULT: Optional[USPAttentionFunction] = None

_UNCHECKED = ("the layers of this model were never checked: call usp_hal.integrations.transformers.enable() (or "
              "register(..., enable=True)) before building the model (or before set_attn_implementation), so that "
              "layers which mix positions outside attention are refused or wired before its first sequence-parallel "
              "forward")


def usp_attention_forward(module, query, key, value, attention_mask=None, **kwargs):
    """The attention function behind ``attn_implementation="usp_hal"`` with the settings of the
    last :func:`register` call (default: the default mesh, the zigzag layout, ``attn_type="auto"``)."""
    return _DEFAULT(module, query, key, value, attention_mask, **kwargs)


def register(name: str = ATTN_IMPLEMENTATION, *, mesh=None, layout: str = DEFAULT_LAYOUT, attn_type="auto",
             rotation: str = "p2p", low_memory=False, recurrence: str = "auto", enable: bool = False) -> str:
    """Register usp-hal attention with transformers under ``name`` and return the name.

    ``mesh``: the sequence-parallel mesh (default: the default mesh at call time);
    ``layout``: how the sequence is sharded ("zigzag" balances causal work over a ring;
    ``shard_batch`` must use the same one, which every forward checks through position_ids);
    ``attn_type``/``rotation``/``low_memory``: as for :class:`usp_hal.LongContextAttention`
    (``low_memory=True``: a smaller peak per rank for some more time, see docs/performance.md).
    ``recurrence``: how the recurrences of covered hybrid layers (gated DeltaNet, KDA, Mamba2)
    cross the shards: ``"head_parallel"``, ``"state_passing"`` or ``"auto"`` (state passing
    when the ring degree is above 1 and the layer has it; see docs/hybrid.md).

    Importing this module registers nothing: this call registers the name, and only the name.
    It adds ``name`` to transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` and
    logs what it changed; :func:`patched` lists every change in place and :func:`disable`
    undoes them.  Registering a name again replaces its settings.

    A sequence-parallel forward also needs :func:`enable` (the check of the model's layers, the
    wiring of the covered hybrid layers, and sequence-parallel ``generate()``), called before
    the model is built: ``enable=True`` calls it here.  Without it, a sequence-parallel call
    of the model is refused on every rank, naming it.
    """
    global _DEFAULT
    _check_version()
    from transformers import AttentionInterface, AttentionMaskInterface

    from usp_hal.integrations import patching
    from usp_hal.integrations.sequence_mixers import set_recurrence
    set_recurrence(name, recurrence)        # a bad value fails at registration
    fn = USPAttentionFunction(mesh=mesh, layout=layout, attn_type=attn_type, rotation=rotation, low_memory=low_memory)
    _FUNCTIONS[name] = fn
    if enable:
        _enable()
    before = set(patching.applied())
    if name == ATTN_IMPLEMENTATION:
        _DEFAULT = fn
        patching.register(AttentionInterface, name, usp_attention_forward)
    else:
        patching.register(AttentionInterface, name, fn)
    patching.register(AttentionMaskInterface, name, usp_mask)
    _log_new(f"register({name!r})", before)
    return name


# attention implementation name -> its attention function (set by register): the names whose
# models generate() runs sequence-parallel and the layer check looks at
_FUNCTIONS: Dict[str, USPAttentionFunction] = {}
_ROUTE_ATTR = "_usp_hal_cache_route"      # usp_hal.integrations.cache.ROUTE_ATTR (not imported: no cost)


def enable() -> List[str]:
    """Make the process-wide changes to transformers this integration needs, once (calling it
    again changes nothing), and return every change in place (as :func:`patched` does):

    * ``transformers.generation.utils.GenerationMixin.generate``: generate() on a model whose
      attention is a registered usp-hal name runs sequence-parallel generation
      (:mod:`.generate`); other models run the original;
    * ``transformers.modeling_utils.PreTrainedModel.post_init`` and ``.set_attn_implementation``:
      models built or switched afterwards check their layers before their first
      sequence-parallel forward (:mod:`usp_hal.integrations.sequence_mixers`);
    * the per-head sequence functions in the modeling modules of the covered hybrid layers
      (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``,
      ``mamba2_chunk_scan``, ``mamba2_split_conv1d_scan_combined``): each calls the original,
      except while a wired layer runs.

    Call it before building the model (``register(..., enable=True)`` calls it): a model
    checks its layers through the ``post_init`` hook, and a sequence-parallel attention call of
    a model whose layers were never checked is refused.  What it changes is logged (logger
    ``usp_hal``, level INFO) and :func:`disable` restores the originals."""
    return _enable()


def _enable() -> List[str]:
    _check_version()
    from transformers.generation.utils import GenerationMixin

    from usp_hal.integrations import patching
    from usp_hal.integrations.sequence_mixers import install

    from .generate import sharded_generate_method
    before = set(patching.applied())
    patching.patch(GenerationMixin, "generate", lambda original: sharded_generate_method(original, _FUNCTIONS.get))
    install(_FUNCTIONS.get)     # models check their layers before their first sequence-parallel forward
    _log_new("enable()", before)
    return patching.applied()


def disable() -> List[str]:
    """Undo :func:`enable` and every :func:`register`: put back each replaced function, remove
    each registered name (or put back what transformers held under it) and forget the
    registered attention functions.  Returns what was undone (as :func:`patched` listed it).
    Models that hold a registered name keep it and fail at their next forward; switch their
    attention back first (``model.set_attn_implementation("sdpa")``)."""
    global _DEFAULT
    from usp_hal.integrations import patching
    from usp_hal.integrations.sequence_mixers import uninstall
    uninstall()
    restored = patching.restore_all()
    _FUNCTIONS.clear()
    _DEFAULT = None
    if restored:
        log.info("usp_hal.integrations.transformers.disable() restored: %s", ", ".join(restored))
    return restored


def patched() -> List[str]:
    """What :func:`enable` and :func:`register` changed in transformers and is in place now:
    ``"module.Class.function"`` or ``"module.function"`` of each replaced function and
    ``"module.Interface['name']"`` of each registered name, in the order made."""
    from usp_hal.integrations import patching
    return patching.applied()


def _log_new(what: str, before: set) -> None:
    from usp_hal.integrations import patching
    new = [p for p in patching.applied() if p not in before]
    if new:
        log.info("usp_hal.integrations.transformers.%s patched: %s", what, ", ".join(new))


def _check_version():
    import transformers
    from packaging.version import Version
    if Version(transformers.__version__) < Version("5.0"):
        raise ImportError(f"usp_hal.integrations.transformers needs transformers >= 5.0 (its mask interface); "
                          f"found {transformers.__version__}; tested with {', '.join(TESTED_VERSIONS)}")
