"""``generate()`` on a sequence-parallel model: what :func:`enable` puts in place of
``GenerationMixin.generate`` (:func:`sharded_generate_method`) runs the prefill as the USP call
on each rank's shard of the prompt, fills a :class:`usp_hal.integrations.cache.ShardedCache`,
and decodes every new token on every rank through it (see the package doc); models whose
attention is not registered by :func:`~usp_hal.integrations.transformers.register` run the
original."""
from __future__ import annotations

import functools
from typing import Optional

import torch

import usp_hal
from usp_hal.parallel.comm import agree

from .batch import _OUTSIDE, PADDING_ATTR, SHARDED_ATTR
from .masks import _DIRECT_PADDING


def sharded_generate_method(original, lookup):
    """What :func:`~usp_hal.integrations.transformers.enable` puts in place of
    ``GenerationMixin.generate`` (``original``): ``generate()`` on a model whose attention is
    one of ours (``lookup(name)`` gives its registered attention function, None for other
    names) runs sequence-parallel generation (:func:`_sharded_generate`); other models run the
    original."""

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        impl = getattr(getattr(self, "config", None), "_attn_implementation", None)
        fn = lookup(impl)
        if fn is not None:
            return _sharded_generate(original, self, fn, args, kwargs)
        return original(self, *args, **kwargs)
    return generate


def _generation_problem(model, ids, kwargs, cache_cls) -> Optional[str]:
    """Why this generate() call cannot run sequence-parallel (None when it can)."""
    gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)

    def opt(name, default=None):
        return kwargs[name] if name in kwargs else getattr(gc, name, default)

    from usp_hal.integrations.sequence_mixers import generation_problem
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


def _sharded_generate(original, model, fn, args, kwargs):
    """generate() on the sequence-parallel model: the prompt is this rank's shard (from
    :func:`shard_batch`); the prefill is the USP call, filling a
    :class:`~usp_hal.integrations.cache.ShardedCache`; the next-token logits of the prompt's last
    position reach every rank (one all-reduce); every decode step runs the new token on every
    rank and attends through the cache.  Returns what generate returns (this rank's prompt
    shard followed by the generated tokens, which are the same on every rank)."""
    import torch.distributed as dist

    from usp_hal.integrations.cache import ShardedCache
    from usp_hal.parallel.comm import collective
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

    from usp_hal.parallel.comm import collective
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
        from usp_hal.parallel.comm import digest_ints
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
