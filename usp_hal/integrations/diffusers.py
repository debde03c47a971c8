"""usp-hal for diffusers models: one call makes a model sequence-parallel.

::

    import usp_hal.integrations.diffusers as usp
    mesh = usp.init_distributed(ulysses_degree=2, ring_degree=1)
    usp.parallelize(pipe.transformer, mesh)      # or any model with a context-parallel plan
    image = pipe(prompt).images[0]               # every rank passes the same inputs, gets the same output

:func:`parallelize` does two things:

1. **Attention.**  It registers a ``"usp_hal"`` attention backend with diffusers'
   ``dispatch_attention_fn`` and routes every attention module of the model to it while the
   model (or the module, when gradient checkpointing recomputes it) runs.  The backend calls
   :class:`usp_hal.LongContextAttention` on diffusers' ``[B, S_local, H, D]`` tensors
   (cross-attention to keys of another length, such as Wan's unsharded text, attends each
   rank's queries to the whole key sequence instead, see :func:`parallelize`), with its key
   mask (text padding) when it has one.  Key padding over the sharded joint sequence
   (Qwen-Image's text mask over ``[text; image]``) goes through usp-hal's mask support over
   global positions.  It refuses other attention masks (per query, per head, or a bias over
   the joint sequence; one that keeps every key is dropped) and ``is_causal``, on every
   rank; a module whose processor does not call
   ``dispatch_attention_fn`` raises instead of attending to this rank's tokens only.
2. **Sharding.**  It follows the model's declared context-parallel plan (``_cp_plan``): the
   inputs it names are split along their sequence dimension with :func:`usp_hal.shard` (the
   "basic" layout, any length: no divisibility needed) and the outputs it names are gathered
   back with :func:`usp_hal.unshard`, which is differentiable.  For Flux that is the image
   tokens, the text tokens and both RoPE id tensors, each split the same way, so every rank
   holds its share of the text tokens and its share of the image tokens with their own
   position ids.  Attention here is not causal, so the order of the keys does not matter and
   the concatenation ``[text share; image share]`` on each rank is a valid shard of the joint
   sequence.

The backend registry and the plans are diffusers internals: this module checks the installed
diffusers version against the tested ones and refuses to run on others.
"""
from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

import usp_hal

from . import init_distributed, sync_gradients
from .training.grads import watch

__all__ = ["BACKEND_NAME", "TESTED_VERSIONS", "VERIFIED_MODELS", "REFUSED_MODELS", "parallelize", "enable_attention",
           "usp_attention", "init_distributed", "sync_gradients"]

BACKEND_NAME = "usp_hal"
TESTED_VERSIONS = ("0.42.1",)
# transformers whose own _cp_plan is verified (output, input and parameter gradients against one
# process, tests/test_integration_diffusers*.py); parallelize refuses other plans unless asked
VERIFIED_MODELS = frozenset({"FluxTransformer2DModel", "WanTransformer3DModel", "QwenImageTransformer2DModel",
                             "LTXVideoTransformer3DModel", "Flux2Transformer2DModel", "ChronoEditTransformer3DModel",
                             "MiniMaxH3Transformer3DModel"})
# transformers whose own _cp_plan usp-hal cannot follow exactly, refused even with allow_unverified
REFUSED_MODELS = {
    "LTX2VideoTransformer3DModel": (
        "its context-parallel plan splits the video tokens and the video's text but not the audio stream "
        "(audio_hidden_states, audio_encoder_hidden_states): the audio self-attention and feed-forward would run "
        "whole on every rank (their parameter gradients counted once per rank), and the audio-video "
        "cross-attention pairs the whole audio with this rank's share of the video (a shape error)"),
    "HeliosTransformer3DModel": (
        "its context-parallel plan gathers the sequence after every attention and feed-forward module and splits "
        "it again before the next: the norms and modulation between them would run whole on every rank, so "
        "their parameter gradients would not sum to the gradient"),
}
LAYOUT = "basic"


def _check_version():
    import diffusers
    if diffusers.__version__ not in TESTED_VERSIONS:
        raise RuntimeError(
            f"usp_hal.integrations.diffusers hooks into diffusers' attention backend registry and context-parallel "
            f"plans, which are internal and change between releases; it is tested with diffusers "
            f"{', '.join(TESTED_VERSIONS)} and found {diffusers.__version__}. Install a tested version "
            f"(pip install 'diffusers=={TESTED_VERSIONS[-1]}'), or shard the inputs yourself with usp_hal.shard and "
            "call usp_hal.LongContextAttention from your own attention processor")


# ----------------------------------------------------------------------------- the backend
@dataclass
class _Context:
    mesh: Any
    attn: Any
    calls: int = 0
    #: set while an attention module runs that was called with keys of another input
    #: (``encoder_hidden_states``) and has no added (joint) key projection: cross-attention
    #: even when its local key and query lengths happen to be equal
    cross_hint: bool = False
    #: key-padding Masks by (batch, length, content): one per distinct padding, reused by
    #: every layer and step (the core caches the classification on the Mask)
    masks: "OrderedDict" = field(default_factory=OrderedDict)


_STACK: List[_Context] = []
_MASKS_KEPT = 8

# a mask's kind, agreed across ranks: none, one that keeps every key, key padding (the same
# keys excluded for every query and head: boolean, or additive 0 / <= _EXCLUDED), another
# key mask (a bias or per-head padding: applied exactly to whole keys, refused over the joint sequence)
NO_MASK, KEEPS_ALL, KEY_PADDING, KEY_BIAS = 0, 1, 2, 3
_EXCLUDED = -1000.0     # an additive value at or below this is an excluded key (exp() of it is 0)
_JOINT_BIAS = ("an attention mask over the sharded joint sequence (self-attention) that is not key padding (a bias "
               "with values other than 0 and large negatives, or padding that differs between heads) is not "
               "supported; key padding (a key excluded for every query, boolean or 0/-inf additive, such as "
               "Qwen-Image's text mask) is, and cross-attention to text takes any key mask")


def usp_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                  enable_gqa: bool = False, _parallel_config=None) -> torch.Tensor:
    """The ``"usp_hal"`` attention backend: ``[B, S_local, H, D]`` in and out, like diffusers'
    other backends.  Active only inside a model prepared by :func:`parallelize` or
    :func:`enable_attention`."""
    if not _STACK:
        raise RuntimeError("the usp_hal attention backend ran outside a model prepared with "
                           "usp_hal.integrations.diffusers.parallelize / enable_attention")
    ctx = _STACK[-1]
    if is_causal:
        raise ValueError("usp_hal attention (diffusers): is_causal=True is not supported: the shards of the "
                         "joint sequence are not in causal order")
    if _parallel_config is not None:
        raise ValueError("usp_hal attention (diffusers): diffusers' own context parallelism is enabled on this "
                         "model; use one of the two, not both")
    # this rank's mask kind, or why it is no key mask at all; agreed below with the lengths
    # (a shard of a text mask may keep everything on one rank and not on another)
    kind, problem = _mask_kind(attn_mask, query, key)
    ctx.calls += 1
    mesh = ctx.mesh
    rows = [[query.shape[1], key.shape[1], kind, int(ctx.cross_hint)]]
    if mesh.sp_size > 1:
        from usp_hal.parallel.comm import agree
        rows = agree(problem, mesh.metadata_group, what="usp_hal attention (diffusers)",
                     where=mesh.where("sequence-parallel"), values=rows[0], width=4, ranks=mesh.sp_ranks,
                     check=_mask_kinds_problem)
    elif problem:
        raise ValueError(f"usp_hal attention (diffusers): {problem}")
    elif _mask_kinds_problem(rows):
        raise ValueError(f"usp_hal attention (diffusers): {_mask_kinds_problem(rows)}")
    cross = any(q != k or hint for q, k, _, hint in rows)
    if all(r[2] in (NO_MASK, KEEPS_ALL) for r in rows):
        attn_mask = None        # no rank's mask excludes anything
    if cross and (mesh.sp_size > 1 or attn_mask is not None):
        out = _cross_attention(ctx, query, key, value, dropout_p, scale, attn_mask)
    elif attn_mask is not None:
        out = _padded_joint_attention(ctx, query, key, value, dropout_p, scale, attn_mask, [r[0] for r in rows])
    else:
        out = ctx.attn(query, key, value, dropout_p=dropout_p, softmax_scale=scale, causal=False)
    return watch(out, mesh, "diffusers parallelize()")


def _mask_kinds_problem(rows) -> Optional[str]:
    kinds = {r[2] for r in rows}
    if NO_MASK in kinds and len(kinds) > 1:
        return "an attention mask on some ranks and none on others"
    if KEY_BIAS in kinds and not any(q != k or hint for q, k, _, hint in rows):
        return _JOINT_BIAS
    return None


def _mask_kind(mask, query, key):
    """``(kind, problem)`` of this rank's mask: see NO_MASK ... KEY_BIAS; ``problem`` names
    a mask that selects anything but whole keys (one host read of three flags)."""
    if mask is None:
        return NO_MASK, None
    shape = tuple(getattr(mask, "shape", ()))
    heads = {1, query.shape[2], key.shape[2]}
    if (not isinstance(mask, torch.Tensor) or mask.dim() != 4 or shape[2] != 1 or shape[3] != key.shape[1]
            or shape[0] not in (1, query.shape[0]) or shape[1] not in heads):
        return KEY_BIAS, (
            f"an attention mask of shape {shape} for {query.shape[1]} queries and {key.shape[1]} keys on this rank: "
            "only key masks [B, H or 1, 1, S_keys] over this rank's keys (text padding, the same for every query) "
            "are supported, not masks over the whole joint sequence or per query")
    keep, excluded = _keep_excluded(mask)
    flags = torch.stack([keep.all(), (keep | excluded).all(), (keep.all(1) == keep.any(1)).all()]).tolist()
    if flags[0]:
        return KEEPS_ALL, None
    return (KEY_PADDING if flags[1] and flags[2] else KEY_BIAS), None


def _keep_excluded(mask: torch.Tensor):
    if mask.dtype == torch.bool:
        return mask, ~mask
    return mask == 0, mask <= _EXCLUDED


def _padded_joint_attention(ctx, query, key, value, dropout_p, scale, mask, lengths):
    """Self-attention over the sharded joint sequence with key padding (every rank passes a
    ``[B, H|1, 1, S_local]`` key mask of its own tokens, e.g. Qwen-Image's ``[text share;
    image share]``): through usp-hal's mask support, over global positions.

    The core places a rank's tokens at the positions the "basic" layout gives it, which
    need not be where the plan's split put them (the text and the image are split
    separately: 7 text and 21 image tokens on 2 ranks are 4+11 and 3+10, not 14 and 14).
    So every rank pads its q/k/v to the longest local length ``L`` (padding keys excluded,
    padding rows dropped after), making ``R*L`` tokens that the basic layout splits exactly as
    held; the key-keep vector is scattered to this rank's global positions and summed over
    the group, and the Mask over it is reused while the padding is the same."""
    mesh = ctx.mesh
    B, n = query.shape[0], query.shape[1]
    keep = _keep_excluded(mask)[0][:, 0, 0, :].expand(B, n)
    L = max(lengths)
    if n < L:
        query, key, value = (torch.cat([t, t.new_zeros(B, L - n, *t.shape[2:])], dim=1) for t in (query, key, value))
        keep = torch.cat([keep, keep.new_zeros(B, L - n)], dim=1)
    S = L * mesh.sp_size
    table = torch.zeros(B, S, dtype=torch.int32, device=keep.device)
    table[:, mesh.local_positions(S, LAYOUT, device=keep.device)] = keep.to(torch.int32)
    if mesh.sp_size > 1:
        import torch.distributed as dist
        dist.all_reduce(table, group=mesh.sp_group)
    out = ctx.attn(query, key, value, dropout_p=dropout_p, softmax_scale=scale, causal=False,
                   mask=_padding_mask(ctx, table.bool()))
    return out[:, :n]


def _padding_mask(ctx, keep: torch.Tensor):
    """A :class:`usp_hal.sequence.masks.Mask` keeping the keys where ``keep`` ``[B, S]`` is True, one
    per distinct ``keep`` (the last few kept; its tensor is never modified, so the core's
    classification of it stays valid)."""
    from usp_hal.sequence.masks import Mask
    rows = keep if bool((keep != keep[:1]).any()) else keep[:1]
    ident = (tuple(rows.shape), rows.cpu().numpy().tobytes())
    got = ctx.masks.get(ident)
    if got is None:
        table = rows.clone()

        def key_padding(b, h, q_idx, kv_idx, table=table):
            return table[b.to(table.device), kv_idx.to(table.device)].to(kv_idx.device)
        got = Mask.from_mod(key_padding, batch=table.shape[0] if table.shape[0] > 1 else None,
                            name="diffusers_key_padding")
        ctx.masks[ident] = got
        while len(ctx.masks) > _MASKS_KEPT:
            ctx.masks.popitem(last=False)
    ctx.masks.move_to_end(ident)
    return got


def _fingerprint(t: torch.Tensor) -> List[int]:
    """Two int64 words of a tensor's float64 sum and sum of squares (bit patterns): equal on
    every rank when the ranks computed the same tensor."""
    x = t.detach().double()
    pair = torch.stack([x.sum(), (x * x).sum()]).cpu()
    return [int(v) for v in pair.view(torch.int64).tolist()]


def _cross_attention(ctx, query, key, value, dropout_p, scale, mask=None):
    """Keys/values whose local length differs from the queries' on some rank: cross-attention
    (Wan's text, LTX-Video's text), which is not one sharded joint sequence.  Non-causal, so
    every query needs every key of the *whole* key sequence:

    * keys/values the same on every rank (replicated: the text is not in the plan, Wan):
      attend locally to them; the gradient each rank gets for them is its own queries' part
      (their sum over the ranks, e.g. through sync_gradients for the projections, is the
      gradient);
    * otherwise they are shards (LTX-Video's plan splits the text): gather them with
      ``unshard(reduce_grad=True)``, whose backward sums every rank's key/value gradient and
      hands each rank its own slice, then attend locally.

    Both are exact; which one is agreed on every rank (one small all-gather of fingerprints).
    A key mask (text padding, ``[B, H or 1, 1, S_keys]``) follows its keys: gathered with them
    when they are shards (LTX-Video's plan splits ``encoder_attention_mask`` as it splits the
    text), used as it is when they are replicated."""
    from usp_hal.parallel.comm import agree
    mesh = ctx.mesh
    rows = agree(None, mesh.metadata_group, what="usp_hal attention (diffusers): cross-attention check",
                 where=mesh.where("sequence-parallel"), values=[key.shape[1], *_fingerprint(key), *_fingerprint(value)],
                 width=5, ranks=mesh.sp_ranks)
    if any(r != rows[0] for r in rows):
        key = usp_hal.unshard(key, layout=LAYOUT, mesh=mesh, seq_dim=1, reduce_grad=True)
        value = usp_hal.unshard(value, layout=LAYOUT, mesh=mesh, seq_dim=1, reduce_grad=True)
        if mask is not None:
            mask = usp_hal.unshard(mask.detach(), layout=LAYOUT, mesh=mesh, seq_dim=3)
    return _local_attention(query, key, value, dropout_p, scale, mask)


def _local_attention(query, key, value, dropout_p, scale, mask=None):
    """This rank's queries against whole keys/values, ``[B, S, H, D]`` in and out: torch's
    scaled_dot_product_attention (usp-hal's kernels take equal query and key lengths; the
    keys here are the short text)."""
    gqa = {"enable_gqa": True} if key.shape[2] != query.shape[2] else {}
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask, dropout_p=dropout_p,
        scale=scale, **gqa)
    return out.transpose(1, 2)


def _register_backend():
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    if _AttentionBackendRegistry._backends.get(BACKEND_NAME) is not usp_attention:
        _AttentionBackendRegistry.register(BACKEND_NAME)(usp_attention)
    return _AttentionBackendRegistry


def _attention_modules(model: torch.nn.Module):
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (AttentionModuleMixin, Attention))]


# ----------------------------------------------------------------------------- hooks
@dataclass
class Handle:
    """What :func:`parallelize` / :func:`enable_attention` installed; ``remove()`` undoes it."""

    model: torch.nn.Module
    hooks: list = field(default_factory=list)
    processors: list = field(default_factory=list)

    def remove(self):
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        for proc, backend in self.processors:
            proc._attention_backend = backend
        self.processors.clear()
        if getattr(self.model, "_usp_hal_handle", None) is self:
            del self.model._usp_hal_handle


class _Activate:
    """Forward pre/post hooks that make ``"usp_hal"`` diffusers' active backend while a module runs."""

    def __init__(self, registry, ctx: _Context, check_calls_of: Optional[str] = None, module=None):
        self.registry = registry
        self.ctx = ctx
        self.check = check_calls_of
        self.saved: list = []
        # an attention module called with encoder_hidden_states attends to another input
        # (cross-attention) unless it projects it into a joint sequence (Flux, Qwen-Image)
        self.ehs_index: Optional[int] = None
        self.cross = False
        if module is not None:
            params = list(inspect.signature(module.forward).parameters)
            self.ehs_index = params.index("encoder_hidden_states") if "encoder_hidden_states" in params else None
            flag = getattr(module, "is_cross_attention", None)
            self.cross = bool(flag) if isinstance(flag, bool) else getattr(module, "add_k_proj", None) is None

    def pre(self, module, args, kwargs=None):
        self.saved.append((self.registry._active_backend, self.ctx.calls, self.ctx.cross_hint))
        self.registry.set_active_backend(BACKEND_NAME)
        _STACK.append(self.ctx)
        if self.ehs_index is not None:
            ehs = (kwargs or {}).get("encoder_hidden_states")
            if ehs is None and len(args) > self.ehs_index:
                ehs = args[self.ehs_index]
            self.ctx.cross_hint = self.cross and ehs is not None

    def post(self, module, args, *rest):
        output = rest[-1] if rest else None
        previous, calls, self.ctx.cross_hint = self.saved.pop()
        _STACK.pop()
        self.registry.set_active_backend(previous)
        if self.check is not None and output is not None and self.ctx.calls == calls:
            raise RuntimeError(
                f"attention module {self.check!r} ({type(module).__name__}, processor "
                f"{type(getattr(module, 'processor', None)).__name__}) ran without calling dispatch_attention_fn, so "
                "its attention covered this rank's tokens only; give it a processor that calls "
                "diffusers' dispatch_attention_fn")


def enable_attention(model: torch.nn.Module, mesh=None, *, attn_type="auto", rotation: str = "p2p") -> Handle:
    """Route every attention module of ``model`` to usp-hal attention (no input sharding:
    the caller passes this rank's share of the sequence).  :func:`parallelize` calls this."""
    _check_version()
    if getattr(model, "_usp_hal_handle", None) is not None:
        raise ValueError("this model is already prepared by usp_hal; call handle.remove() first")
    registry = _register_backend()
    mesh = mesh if mesh is not None else usp_hal.get_default_mesh()
    attn = usp_hal.LongContextAttention(attn_type=attn_type, ring_impl_type=LAYOUT, mesh=mesh, rotation=rotation)
    ctx = _Context(mesh, attn)
    modules = _attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no diffusers attention modules (Attention / "
                         "AttentionModuleMixin) to route to usp-hal")
    handle = Handle(model)
    seen = set()
    for name, m in modules:
        proc = getattr(m, "processor", None)
        if getattr(proc, "_parallel_config", None) is not None:
            raise ValueError(f"attention module {name!r} has diffusers' context parallelism enabled; use one of "
                             "the two, not both")
        if proc is not None and id(proc) not in seen and hasattr(proc, "_attention_backend"):
            seen.add(id(proc))
            # a processor with an explicit backend would bypass the active one
            handle.processors.append((proc, proc._attention_backend))
            proc._attention_backend = None
        act = _Activate(registry, ctx, check_calls_of=name, module=m)
        handle.hooks.append(m.register_forward_pre_hook(act.pre, with_kwargs=True))
        handle.hooks.append(m.register_forward_hook(act.post, always_call=True))
    top = _Activate(registry, ctx)
    handle.hooks.append(model.register_forward_pre_hook(top.pre, with_kwargs=True))
    handle.hooks.append(model.register_forward_hook(top.post, always_call=True))
    model._usp_hal_handle = handle  # type: ignore[assignment]
    return handle


def parallelize(model: torch.nn.Module, mesh=None, *, attn_type="auto", rotation: str = "p2p",
                plan: Optional[dict] = None, allow_unverified: bool = False) -> Handle:
    """Make ``model`` sequence-parallel over ``mesh`` (default: the default mesh).

    Every rank calls the model with the same full inputs and gets the same full output; each
    computes its share of the tokens.  The split follows ``plan`` (default: the model's
    ``_cp_plan``; a model whose plan usp-hal has not verified, see ``VERIFIED_MODELS``, is
    refused unless ``allow_unverified=True``).  Returns a handle whose ``remove()`` restores the
    model.

    Gradients after ``backward()`` of a loss on the output (the same loss on every rank):

    * parameter gradients are per-rank partials (each rank's tokens' part) until
      :func:`sync_gradients` (without ``loss``) sums them over the group; that sum is the
      gradient for every parameter used before the plan's gathered output (all of them in the
      verified models: the plan gathers the last projection).  An optimizer step without it
      raises (``UnsyncedGradientsError``);
    * input gradients (``hidden_states.grad``, ``encoder_hidden_states.grad``) are per-rank
      partials too, and nothing sums them: a sharded input's gradient is non-zero only in this
      rank's tokens, an input every rank holds whole (Wan's text) gets this rank's queries'
      part; their sum over the group (``dist.all_reduce(g, group=mesh.sp_group)``) is the
      single-process gradient.

    Cross-attention to keys of another length (Wan's and LTX-Video's text) runs each rank's
    queries against the whole key sequence: as it is when every rank holds the same keys,
    gathered (the gradient summed back) when they are shards.

    While the model runs, ``"usp_hal"`` is diffusers' active attention backend (process-wide
    state in diffusers' registry, restored afterwards): do not run other diffusers models
    concurrently in other threads of the same process."""
    _check_version()
    own_plan = plan is None
    plan = plan if plan is not None else getattr(type(model), "_cp_plan", None)
    if not plan:
        raise ValueError(f"{type(model).__name__} declares no context-parallel plan (_cp_plan); shard its inputs "
                         "yourself with usp_hal.shard, call enable_attention(model, mesh), and gather the output "
                         "with usp_hal.unshard")
    if own_plan and type(model).__name__ in REFUSED_MODELS:
        raise ValueError(f"usp_hal.integrations.diffusers.parallelize: {type(model).__name__} is not supported: "
                         f"{REFUSED_MODELS[type(model).__name__]}; run it on one process per sample, or pass a "
                         "plan= that splits every stream once and gathers at the output")
    if own_plan and type(model).__name__ not in VERIFIED_MODELS and not allow_unverified:
        raise ValueError(
            f"usp_hal.integrations.diffusers.parallelize: {type(model).__name__} declares a context-parallel plan "
            f"(modules {', '.join(repr(k) for k in list(plan)[:6])}{', ...' if len(plan) > 6 else ''}) that usp-hal "
            f"has not verified against single-process output and gradients (verified: "
            f"{', '.join(sorted(VERIFIED_MODELS))}); pass allow_unverified=True to run it anyway and compare with "
            "one process first")
    why = _plan_problem(model, plan)
    if why:
        raise ValueError(f"usp_hal.integrations.diffusers.parallelize: {type(model).__name__}: {why}")
    mesh = mesh if mesh is not None else usp_hal.get_default_mesh()
    handle = enable_attention(model, mesh, attn_type=attn_type, rotation=rotation)
    try:
        for path, spec in plan.items():
            for m in _submodules(model, path):
                handle.hooks.extend(_plan_hooks(m, path, spec, mesh))
    except Exception:
        handle.remove()
        raise
    return handle


def _plan_problem(model, plan: dict) -> Optional[str]:
    """Why usp-hal cannot follow ``plan`` on ``model`` exactly, or None.

    A module that splits its inputs and gathers its outputs (HeliosTransformer3DModel gathers
    after every attention and feed-forward module and splits again before the next) leaves
    the norms and modulation between them to run on the whole sequence on every rank: their
    parameters would then get the whole gradient on every rank, and summing over the ranks
    (sync_gradients) would count it once per rank."""
    from diffusers.models._modeling_parallel import ContextParallelOutput
    splits: dict = {}
    gathers: dict = {}
    for path, spec in plan.items():
        try:
            mods = _submodules(model, path)
        except ValueError as exc:
            return str(exc)
        is_gather = not isinstance(spec, dict)
        if isinstance(spec, (list, tuple)):
            is_gather = all(s is None or isinstance(s, ContextParallelOutput) for s in spec)
        for m in mods:
            (gathers if is_gather else splits).setdefault(id(m), path)
    both = [p for k, p in gathers.items() if k in splits]
    if both:
        return (f"its context-parallel plan gathers the sequence at module {both[0]!r} and splits it again there "
                f"({len(both)} such modules): the parts between them would run on the whole sequence on every rank, "
                "so parameter gradients would not sum to the gradient; usp-hal follows plans that split once and "
                "gather at the output")
    return None


def _submodules(model, path: str):
    if path == "":
        return [model]
    mods = [model]
    for atom in path.split("."):
        nxt: list = []
        for m in mods:
            if atom == "*":
                if not isinstance(m, torch.nn.ModuleList):
                    raise ValueError(f"plan path {path!r}: '*' must follow a ModuleList")
                nxt.extend(m)
            elif hasattr(m, atom):
                nxt.append(getattr(m, atom))
            else:
                raise ValueError(f"plan path {path!r}: {type(m).__name__} has no submodule {atom!r}")
        mods = nxt
    return mods


def _plan_hooks(module, path, spec, mesh):
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
    if isinstance(spec, dict):
        inputs = {k: v for k, v in spec.items() if not _split_output(v, ContextParallelInput)}
        outputs = {k: v for k, v in spec.items() if _split_output(v, ContextParallelInput)}
        hooks = []
        if inputs:
            hooks.append(module.register_forward_pre_hook(_SplitInputs(module, path, inputs, mesh), with_kwargs=True))
        if outputs:
            hooks.append(module.register_forward_hook(_SplitOutputs(path, outputs, mesh)))
        return hooks
    specs = [spec] if isinstance(spec, ContextParallelOutput) else list(spec)
    if not all(s is None or isinstance(s, ContextParallelOutput) for s in specs):
        raise ValueError(f"plan entry {path!r}: expected ContextParallelOutput(s), got {spec!r}")
    return [module.register_forward_hook(_GatherOutputs(path, specs, mesh))]


def _split_output(v, cls) -> bool:
    items = v if isinstance(v, (list, tuple)) else [v]
    if not all(isinstance(x, cls) for x in items):
        raise ValueError(f"unsupported context-parallel plan entry {v!r} (expected ContextParallelInput)")
    return isinstance(v, cls) and v.split_output


def _shard(x, cpi, what: str, mesh):
    if not isinstance(x, torch.Tensor):
        return x
    if cpi.expected_dims is not None and x.dim() != cpi.expected_dims:
        if x.dim() <= cpi.split_dim:
            # no sequence dim at all (Wan's 1-D per-sample timestep where the plan allows a
            # per-token [B, S] one): every token shares the value, nothing to split
            return x
        raise ValueError(f"{what}: expected a {cpi.expected_dims}-D tensor to split along dim {cpi.split_dim}, got "
                         f"shape {tuple(x.shape)} (the model's context-parallel plan cannot split it; pass it in the "
                         "documented shape, e.g. Flux's txt_ids/img_ids without a batch dimension)")
    from usp_hal.parallel.sharding import empty_rank_problem
    short = empty_rank_problem(mesh, LAYOUT, int(x.shape[cpi.split_dim]), what=what)
    if short:              # every rank passes the same global inputs: every rank raises here alike
        raise ValueError(short)
    return usp_hal.shard(x, layout=LAYOUT, mesh=mesh, seq_dim=cpi.split_dim)


class _SplitInputs:
    def __init__(self, module, path, spec, mesh):
        self.spec, self.mesh, self.path = spec, mesh, path
        self.params = list(inspect.signature(module.forward).parameters)

    def __call__(self, module, args, kwargs):
        args = list(args)
        for name, cpi in self.spec.items():
            if name in kwargs:
                kwargs[name] = self._apply(kwargs[name], cpi, name)
            elif name in self.params and self.params.index(name) < len(args):
                i = self.params.index(name)
                args[i] = self._apply(args[i], cpi, name)
        return tuple(args), kwargs

    def _apply(self, val, cpi, name):
        what = f"{self.path or 'model'}.{name}"
        if isinstance(val, (list, tuple)):
            cpis = cpi if isinstance(cpi, (list, tuple)) else [cpi] * len(val)
            if len(cpis) != len(val):
                raise ValueError(f"{what}: the plan has {len(cpis)} entries for {len(val)} inputs")
            return type(val)(_shard(x, c, f"{what}[{i}]", self.mesh) if not c.split_output else x
                             for i, (x, c) in enumerate(zip(val, cpis)))
        return _shard(val, cpi, what, self.mesh)


class _SplitOutputs:
    def __init__(self, path, spec, mesh):
        self.spec, self.mesh, self.path = spec, mesh, path

    def __call__(self, module, args, output):
        single = isinstance(output, torch.Tensor)
        outs = [output] if single else list(output)
        for index, cpi in self.spec.items():
            if not isinstance(index, int) or index >= len(outs):
                raise ValueError(f"plan entry {self.path!r}: output index {index!r} is out of range")
            outs[index] = _shard(outs[index], cpi, f"{self.path} output {index}", self.mesh)
        return outs[0] if single else type(output)(outs)


class _GatherOutputs:
    def __init__(self, path, specs, mesh):
        self.specs, self.mesh, self.path = specs, mesh, path

    def __call__(self, module, args, output):
        from usp_hal.parallel.comm import agree
        single = isinstance(output, torch.Tensor)
        outs = [output] if single else list(output)
        problem = None
        if len(outs) != len(self.specs):
            problem = f"plan entry {self.path!r}: {len(self.specs)} gather entries for {len(outs)} outputs"
        else:
            for i, cpo in enumerate(self.specs):
                if cpo is not None and cpo.expected_dims is not None and outs[i].dim() != cpo.expected_dims:
                    problem = f"{self.path} output {i}: expected {cpo.expected_dims} dims, got {tuple(outs[i].shape)}"
                    break
        # every rank's check before the gathers: a refused output on one rank raises on every rank
        if self.mesh.sp_size > 1:
            agree(problem, self.mesh.metadata_group, what="usp_hal (diffusers) cannot gather the outputs",
                  where=self.mesh.where("sequence-parallel"), ranks=self.mesh.sp_ranks)
        elif problem:
            raise ValueError(problem)
        for i, cpo in enumerate(self.specs):
            if cpo is not None:
                outs[i] = usp_hal.unshard(outs[i], layout=LAYOUT, mesh=self.mesh, seq_dim=cpo.gather_dim)
        return outs[0] if single else type(output)(outs)
