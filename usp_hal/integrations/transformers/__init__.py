"""usp-hal as a transformers attention implementation.

:func:`register` registers ``"usp_hal"`` (or the name given) in transformers'
``AttentionInterface`` (and its mask counterpart), and :func:`enable` makes the other changes a
model needs (``register(..., enable=True)`` does both), so a model whose attention goes through
that interface runs sequence-parallel (tested: Llama with GQA, Mistral with a sliding window)
with::

    import usp_hal.integrations.transformers as usp
    mesh = usp.init_distributed(ulysses_degree=2, ring_degree=1)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=usp.register(enable=True))
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

Importing this package changes nothing in transformers.  :func:`register` adds the attention
name (and its mask function) to transformers' interfaces, nothing else.  :func:`enable` (or
``register(..., enable=True)``) replaces ``GenerationMixin.generate`` (the sharded generate()
above), ``PreTrainedModel.post_init`` and ``set_attn_implementation`` (the check of a model's
layers, :mod:`usp_hal.integrations.sequence_mixers`) and the per-head functions of the covered
hybrid layers' modeling modules.  Call it before building the model: a sequence-parallel call
of a model whose layers were never checked is refused on every rank, naming it.  Both log what
they change; :func:`patched` lists what is in place (the gradient check's optimizer hook too)
and :func:`disable` restores the originals.

The modules: :mod:`.attention` (the attention function, :func:`register`, :func:`enable`,
:func:`disable`), :mod:`.masks` (what the model's mask function asks for), :mod:`.generate`
(sharded generate()), :mod:`.batch` (:func:`shard_batch`) and :mod:`.dynamic` (the per-batch
degree for a model: :func:`dynamic_degree`).
"""
from usp_hal.integrations import init_distributed, sync_gradients

from . import attention as _attention
from .attention import (
    ATTN_IMPLEMENTATION,
    USPAttentionFunction,
    disable,
    enable,
    patched,
    register,
    usp_attention_forward,
)
from .batch import DEFAULT_LAYOUT, IGNORE_INDEX, PADDING_ATTR, SHARDED_ATTR, Padding, shard_batch
from .dynamic import DYNAMIC_LAYOUT, calibrate_calls, dynamic_degree, model_shape, packing_problem
from .masks import TESTED_VERSIONS, MaskInfo, usp_mask

__all__ = ["ATTN_IMPLEMENTATION", "register", "enable", "disable", "patched", "shard_batch", "init_distributed",
           "sync_gradients", "usp_attention_forward", "usp_mask", "MaskInfo", "Padding", "USPAttentionFunction",
           "DEFAULT_LAYOUT", "IGNORE_INDEX", "SHARDED_ATTR", "PADDING_ATTR", "TESTED_VERSIONS", "DYNAMIC_LAYOUT",
           "dynamic_degree", "model_shape", "packing_problem", "calibrate_calls"]

# When this package was one module, code outside it read the registered attention functions
# as ``usp_hal.integrations.transformers._FUNCTIONS``: the same dict, not a copy.
_FUNCTIONS = _attention._FUNCTIONS
