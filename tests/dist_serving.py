"""Functions that run on every rank of a WorkerPool (see tests/mp.py) for the sharded KV
cache (usp_hal.serving): decode steps against float64 attention over the whole cache, the
USP prefill feeding the cache, and the refusals that must be raised on every rank."""
from __future__ import annotations

import torch

import usp_hal
from tests.dist_cases import error_of
from usp_hal.dispatch.reference import reference_attention, tolerance
from usp_hal.serving import ShardedKVCache

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}

# option sets of the decode cases: (label, decode keywords; "alibi" -> random slopes)
OPTIONS = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(4, 0)),
    "softcap_alibi": dict(causal=True, softcap=3.0, alibi=True),
    "full": dict(causal=False),
}


SOFTCAP_BACKEND = "test_reference_softcap"


def register_softcap_backend() -> str:
    """A contract-test backend: float64 reference math behind the kernel contract, declaring
    softcap, window, ALiBi and key offsets.  No CPU kernel of the registry has softcap, so
    this proves the decode path (placement, block plan, merge) with softcap, not a kernel."""
    from usp_hal.dispatch.backend import AttentionBackend

    class ReferenceSoftcap(AttentionBackend):
        NAME = SOFTCAP_BACKEND
        SUPPORTED_DEVICES = frozenset({"cpu"})
        SUPPORTED_DTYPES = frozenset({torch.float64, torch.float32, torch.bfloat16})
        SUPPORTS_WINDOW = SUPPORTS_SOFTCAP = SUPPORTS_ALIBI = SUPPORTS_KEY_OFFSET = True
        HAS_BACKWARD = False

        def kernel_forward(self, q, k, v, call):
            out, lse = reference_attention(q, k, v, softmax_scale=call.scale, causal=call.causal, window=call.window,
                                           softcap=call.softcap, alibi_slopes=call.alibi_slopes,
                                           key_offset=call.key_offset)
            mdt = torch.float64 if q.dtype == torch.float64 else torch.float32
            return out.to(q.dtype), lse.to(mdt)

    if SOFTCAP_BACKEND not in usp_hal.list_backends():
        usp_hal.register_backend(SOFTCAP_BACKEND, ReferenceSoftcap)
    return SOFTCAP_BACKEND


def _mesh(U: int, R: int):
    from tests.dist_cases import get_mesh
    return get_mesh(U, R)


def worst(got: torch.Tensor, ref: torch.Tensor, dtype, lse: bool = False) -> float:
    """max |got - ref| / (atol + rtol |ref|) (<= 1 passes); -inf where both are -inf counts 0,
    -inf on one side only counts as a failure (inf)."""
    atol, rtol = tolerance(dtype, lse=lse)
    g, r = got.detach().double(), ref.detach().double()
    both = torch.isinf(g) & torch.isinf(r) & (g == r)
    one = torch.isinf(g) ^ torch.isinf(r)
    if bool(one.any()) or bool(torch.isnan(g).any()):
        return float("inf")
    err = ((g - r).abs() / (atol + rtol * r.abs())).masked_fill(both, 0.0)
    return float(err.max()) if err.numel() else 0.0


def _tokens(g, B, n, H, Hkv, D, dt):
    return (torch.randn(B, n, H, D, generator=g).to(dt), torch.randn(B, n, Hkv, D, generator=g).to(dt),
            torch.randn(B, n, Hkv, D, generator=g).to(dt))


def _steps_against_reference(cache, ks, vs, steps, opts, g, H, Hkv, D, dt, slopes):
    """Run decode steps of ``steps`` new tokens each; compare out and lse with float64
    attention over every sequence's whole cache (its global K/V ``ks[b]``/``vs[b]``)."""
    B = cache.batch_size
    errs = {"out": 0.0, "lse": 0.0}
    prints = []
    for n in steps:
        q, k, v = _tokens(g, B, n, H, Hkv, D, dt)
        starts = cache.lengths()
        out, lse = cache.decode(0, q, k, v, return_lse=True, alibi_slopes=slopes, **opts)
        prints.append(float(out.double().sum()) + float(lse.masked_fill(torch.isinf(lse), 0).double().sum()))
        for b in range(B):
            ks[b] = torch.cat([ks[b], k[b]])
            vs[b] = torch.cat([vs[b], v[b]])
            sl = None if slopes is None else slopes
            ro, rl = reference_attention(q[b:b + 1], ks[b][None], vs[b][None], key_offset=-starts[b],
                                         alibi_slopes=sl, causal=opts.get("causal", False),
                                         window=opts.get("window_size", (-1, -1)), softcap=opts.get("softcap", 0.0))
            errs["out"] = max(errs["out"], worst(out[b:b + 1], ro, dt))
            errs["lse"] = max(errs["lse"], worst(lse[b:b + 1], rl, dt, lse=True))
    return errs, prints


def decode_case(U=1, R=1, dtype="fp64", options=("causal",), H=6, Hkv=3, D=8, lengths=(13, 5, 7, 0),
                placements=("zigzag", "basic", -1, "zigzag"), steps=(1, 2, 3, 1), block_size=3, seed=0,
                softcap_backend=None):
    """A cache loaded with uneven sequences (one of them wholly on the last ring rank, one
    empty), then decode steps: out/lse against float64 attention over the whole cache, for
    each option set.  Also returns the placement (tokens per ring rank) for the balance check
    and a fingerprint of the outputs (equal on every rank)."""
    mesh = _mesh(U, R)
    dt = DTYPES[dtype]
    res: dict = {"errors": {}, "prints": {}, "counts": {}, "local": {}, "positions": {}}
    for label in options:
        opts = dict(OPTIONS[label])
        g = torch.Generator().manual_seed(seed)
        slopes = (torch.rand(H, generator=g) * 0.5) if opts.pop("alibi", False) else None
        B, S = len(lengths), max(lengths)
        K = torch.randn(B, S, Hkv, D, generator=g).to(dt)
        V = torch.randn(B, S, Hkv, D, generator=g).to(dt)
        attn_type = (softcap_backend or register_softcap_backend()) if opts.get("softcap") else "sdpa"
        cache = ShardedKVCache(mesh, num_layers=1, batch_size=B, num_heads=H, num_kv_heads=Hkv, head_dim=D,
                               dtype=dt, block_size=block_size, attn_type=attn_type)
        place = [R - 1 if p == -1 else p for p in placements]
        cache.load(0, K, V, list(lengths), placement=place)
        ks = [K[b, :lengths[b]] for b in range(B)]
        vs = [V[b, :lengths[b]] for b in range(B)]
        errs, prints = _steps_against_reference(cache, ks, vs, steps, opts, g, H, Hkv, D, dt, slopes)
        res["errors"][label] = errs
        res["prints"][label] = prints
        res["counts"][label] = cache.ring_counts()
        res["local"][label] = cache.local_lengths()
        res["positions"][label] = [cache.local_positions(0, b) for b in range(B)]
    return res


def prefill_case(U=1, R=1, dtype="fp32", layout="zigzag", B=2, S=11, H=4, Hkv=2, D=8, steps=(1, 1, 2),
                 window=(-1, -1), block_size=2, seed=1):
    """The USP call on the sharded prompt fills the cache (prefill output against float64),
    then decode steps against float64 attention over the whole cache."""
    mesh = _mesh(U, R)
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, D, generator=g).to(dt) for h in (H, Hkv, Hkv))
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type=layout, mesh=mesh)
    cache = ShardedKVCache(mesh, num_layers=1, batch_size=B, num_heads=H, num_kv_heads=Hkv, head_dim=D, dtype=dt,
                           block_size=block_size, attn_type="sdpa")
    sh = [usp_hal.shard(x, layout=layout, mesh=mesh) for x in (q, k, v)]
    out = cache.prefill(0, attn, *sh, causal=True, window_size=window)
    full = usp_hal.unshard(out, layout=layout, mesh=mesh)
    ro, _ = reference_attention(q, k, v, causal=True, window=window)
    res = {"prefill": worst(full, ro, dt), "prompt_stored": cache.local_lengths()}
    opts = dict(causal=True, window_size=window)
    ks, vs = [k[b] for b in range(B)], [v[b] for b in range(B)]
    res["errors"], res["prints"] = _steps_against_reference(cache, ks, vs, steps, opts, g, H, Hkv, D, dt, None)
    res.update(stored=cache.local_lengths(), counts=cache.ring_counts(), capacity_bytes=cache.memory_bytes(),
               used_bytes=cache.used_bytes(),
               block_bytes=B * block_size * cache.local_heads[1] * 2 * D * torch.empty((), dtype=dt).element_size())
    return res


def refusal_case(U=1, R=2, H=4, Hkv=2, D=8):
    """Bad decode calls, each refused on every rank together (a rank that went on alone would
    wait in the data all-gather and the case would time out); then a good call still works."""
    import torch.distributed as dist
    mesh = _mesh(U, R)
    rank = dist.get_rank()
    dt = torch.float64
    B, S = 2, 6
    g = torch.Generator().manual_seed(5)
    K, V = torch.randn(B, S, Hkv, D, generator=g, dtype=dt), torch.randn(B, S, Hkv, D, generator=g, dtype=dt)

    def fresh(check_inputs=False):
        c = ShardedKVCache(mesh, num_layers=2, batch_size=B, num_heads=H, num_kv_heads=Hkv, head_dim=D, dtype=dt,
                           block_size=2, attn_type="sdpa", check_inputs=check_inputs)
        c.load(0, K, V, [S, 3])
        return c

    q, k, v = _tokens(g, B, 1, H, Hkv, D, dt)
    res = {}
    other = _mesh(R, U) if U != R else _mesh(1, 1)
    res["wrong_mesh"] = error_of(lambda: fresh().decode(0, q, k, v, mesh=other))
    c = fresh()
    if rank == 1:
        c.layers[0].local[1] -= 1          # this rank lost a token the others believe it holds
    res["length_differs"] = error_of(lambda: c.decode(0, q, k, v))
    c = fresh()
    if rank == 0:
        c.layers[0].total[0] += 1          # this rank believes the sequence is longer
    res["table_differs"] = error_of(lambda: c.decode(0, q, k, v))
    # q, k and v the same on every rank: the caller's contract, verified with check_inputs=True
    res["new_keys_differ"] = error_of(lambda: fresh(True).decode(0, q, k + rank, v))
    res["options_differ"] = error_of(lambda: fresh().decode(0, q, k, v, window_size=(rank + 1, 0)))
    res["heads_mismatch"] = error_of(lambda: fresh().decode(0, q[:, :, :H - 1] if rank == 0 else q, k, v))
    res["softcap_on_sdpa"] = error_of(lambda: fresh().decode(0, q, k, v, softcap=5.0))
    res["needs_grad"] = error_of(lambda: fresh().decode(0, q.clone().requires_grad_(), k, v))
    res["layer_out_of_range"] = error_of(lambda: fresh().decode(5, q, k, v))
    res["empty_layer_ok"] = error_of(lambda: fresh().decode(1, q, k, v))     # nothing cached: only the new token
    res["prefill_twice"] = error_of(lambda: fresh().load(0, K, V, [S, 3]))
    # verify="step": layer 0 agrees, layer 1 checks itself against it; a rank whose layer 1 lost a
    # token flags it in the data all-gather, and every rank raises
    c = ShardedKVCache(mesh, num_layers=2, batch_size=B, num_heads=H, num_kv_heads=Hkv, head_dim=D, dtype=dt,
                       block_size=2, attn_type="sdpa", verify="step")
    c.load(0, K, V, [S, 3])
    c.load(1, K, V, [S, 3])
    res["step_layer0_ok"] = error_of(lambda: c.decode(0, q, k, v))
    res["step_layer1_ok"] = error_of(lambda: c.decode(1, q, k, v))
    res["step_layer0_again_ok"] = error_of(lambda: c.decode(0, q, k, v))
    if rank == 1:
        c.layers[1].local[0] -= 1
    res["step_layer1_differs"] = error_of(lambda: c.decode(1, q, k, v))
    c = fresh()
    out = c.decode(0, q, k, v)
    ro, _ = reference_attention(q[:1], torch.cat([K[0], k[0]])[None], torch.cat([V[0], v[0]])[None], causal=True,
                                key_offset=-S)
    res["after_refusals"] = worst(out[:1], ro, dt)
    return res


# ----------------------------------------------------------------------------- transformers generate()
def tiny_mistral(seed: int = 0, window: int = 8):
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(seed)
    model = MistralForCausalLM(MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                             max_position_embeddings=128, sliding_window=window))
    model.set_attn_implementation("sdpa")
    return model


def generate_case(U=1, R=1, arch="llama", B=2, S=23, new=6, seed=0, block_size=4):
    """Greedy generate() of a tiny random model, sequence-parallel (the prompt sharded by
    shard_batch, a ShardedCache) against a single process: the tokens and their logits."""
    import copy

    import torch.distributed as dist

    from tests.integration_cases import tiny_llama
    from usp_hal.integrations import transformers as usp
    from usp_hal.integrations.cache import ShardedCache

    mesh = _mesh(U, R)
    name = usp.register(f"usp_hal_test_generate_u{U}r{R}", mesh=mesh, layout="zigzag", attn_type="sdpa", enable=True)
    ref = tiny_llama(seed) if arch == "llama" else tiny_mistral(seed)
    ref.eval()
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    prompt = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(seed + 11))
    cache = ShardedCache(model.config, mesh=mesh, block_size=block_size)
    kw = dict(max_new_tokens=new, do_sample=False, return_dict_in_generate=True, output_logits=True,
              pad_token_id=0)
    with torch.no_grad():
        out = model.generate(**usp.shard_batch({"input_ids": prompt}, mesh), past_key_values=cache, **kw)
    gen = out.sequences[:, -new:]
    logits = torch.stack(out.logits, 1)
    res = {"tokens": gen.tolist(), "lengths": cache.core.lengths(0), "counts": cache.core.ring_counts(0),
           "memory": cache.memory_bytes(), "logits_sum": float(logits.double().sum())}
    if (dist.get_rank() if dist.is_initialized() else 0) != 0:
        return res
    with torch.no_grad():
        want = ref.generate(prompt, **kw)
    ref_logits = torch.stack(want.logits, 1)
    res.update(ref_tokens=want.sequences[:, S:].tolist(),
               logits_diff=float((logits.double() - ref_logits.double()).abs().max()),
               logits_scale=float(ref_logits.abs().max()))
    return res


def generate_refusals(U=1, R=2, seed=0):
    """generate() calls the sequence-parallel path refuses, on every rank together."""
    from tests.integration_cases import tiny_llama
    from usp_hal.integrations import transformers as usp

    mesh = _mesh(U, R)
    name = usp.register(f"usp_hal_test_generate_u{U}r{R}", mesh=mesh, layout="zigzag", attn_type="sdpa", enable=True)
    model = tiny_llama(seed, num_hidden_layers=1)
    model.set_attn_implementation(name)
    model.eval()
    prompt = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    batch = usp.shard_batch({"input_ids": prompt}, mesh)
    res = {}
    with torch.no_grad():
        pad = torch.ones_like(batch["input_ids"])
        pad[0, 0] = 0
        res["padding"] = error_of(lambda: model.generate(**batch, attention_mask=pad, max_new_tokens=2))
        right = torch.ones(1, 10, dtype=torch.long)
        right[0, -3:] = 0
        res["right_padding"] = error_of(lambda: model.generate(
            **usp.shard_batch({"input_ids": prompt, "attention_mask": right}, mesh), max_new_tokens=2))
        res["empty_row"] = error_of(lambda: model.generate(
            **usp.shard_batch({"input_ids": prompt, "attention_mask": torch.zeros_like(right)}, mesh),
            max_new_tokens=2))
        res["beams"] = error_of(lambda: model.generate(**batch, max_new_tokens=2, num_beams=2))
        res["no_positions"] = error_of(lambda: model.generate(input_ids=batch["input_ids"], max_new_tokens=2))
        res["no_max_new_tokens"] = error_of(lambda: model.generate(**batch, max_length=30))
        res["no_cache"] = error_of(lambda: model.generate(**batch, max_new_tokens=2, use_cache=False))
        from transformers import GenerationConfig
        res["no_cache_config"] = error_of(lambda: model.generate(
            **batch, generation_config=GenerationConfig(max_new_tokens=2, use_cache=False)))
        res["ok"] = error_of(lambda: model.generate(**batch, max_new_tokens=2, do_sample=False, pad_token_id=0))
    return res


# ----------------------------------------------------------------------------- left padding
def _keep(pads, S):
    """``[B, S]`` bool: row b's first ``pads[b]`` positions are padding."""
    return torch.arange(S).view(1, -1) >= torch.tensor(pads).view(-1, 1)


def padded_prefill_case(U=1, R=1, dtype="fp64", layout="zigzag", pads=(0, 4, 9), S=13, H=4, Hkv=2, D=8,
                        steps=(1, 2, 1), window=(-1, -1), block_size=2, seed=2):
    """Left-padded rows: the prefill with the padding as a key mask (over global positions,
    per row), then decode steps with ``key_start`` (the keys before it are padding), each
    against float64 attention with the padding mask over the whole cache."""
    from usp_hal.sequence.masks import Mask
    mesh = _mesh(U, R)
    dt = DTYPES[dtype]
    B = len(pads)
    keep = _keep(pads, S)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, D, generator=g).to(dt) for h in (H, Hkv, Hkv))
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type=layout, mesh=mesh)
    cache = ShardedKVCache(mesh, num_layers=1, batch_size=B, num_heads=H, num_kv_heads=Hkv, head_dim=D, dtype=dt,
                           block_size=block_size, attn_type="sdpa")
    mask = Mask.from_mod(lambda b, h, qi, kv: keep[b, kv], batch=B)
    sh = [usp_hal.shard(x, layout=layout, mesh=mesh) for x in (q, k, v)]
    out = cache.prefill(0, attn, *sh, causal=True, window_size=window, mask=mask)
    full = usp_hal.unshard(out, layout=layout, mesh=mesh)
    ro, _ = reference_attention(q, k, v, causal=True, window=window, mask=keep[:, None, None, :])
    res = {"prefill": worst(full, ro, dt), "pad_rows_zero": all(float(full[b, :p].abs().max()) == 0.0
                                                                 for b, p in enumerate(pads) if p)}
    errs = {"out": 0.0, "lse": 0.0}
    ks, vs = [k[b] for b in range(B)], [v[b] for b in range(B)]
    prints = []
    for n in steps:
        qn, kn, vn = _tokens(g, B, n, H, Hkv, D, dt)
        starts = cache.lengths()
        o, lse = cache.decode(0, qn, kn, vn, return_lse=True, causal=True, window_size=window, key_start=list(pads))
        prints.append(float(o.double().sum()))
        for b in range(B):
            ks[b], vs[b] = torch.cat([ks[b], kn[b]]), torch.cat([vs[b], vn[b]])
            p = pads[b]
            ro, rl = reference_attention(qn[b:b + 1], ks[b][None, p:], vs[b][None, p:], key_offset=p - starts[b],
                                         causal=True, window=window)
            errs["out"] = max(errs["out"], worst(o[b:b + 1], ro, dt))
            errs["lse"] = max(errs["lse"], worst(lse[b:b + 1], rl, dt, lse=True))
    res.update(errors=errs, prints=prints, lengths=cache.lengths())
    return res


def _left_padded(pads, S, seed):
    """A prompt of ``len(pads)`` rows, row b left-padded with ``pads[b]`` pad tokens (id 0),
    and its attention_mask."""
    keep = _keep(pads, S)
    ids = torch.randint(1, 256, (len(pads), S), generator=torch.Generator().manual_seed(seed + 11))
    return ids.masked_fill(~keep, 0), keep.long()


def padded_generate_case(U=1, R=1, arch="llama", pads=(0, 5, 12), S=19, new=5, seed=0, block_size=4):
    """Greedy generate() of a batch of left-padded prompts (different lengths): the global
    attention_mask goes to shard_batch with the prompt; the tokens and their logits against
    one process's ``generate(input_ids, attention_mask=mask)``."""
    import copy

    import torch.distributed as dist

    from tests.integration_cases import tiny_llama
    from usp_hal.integrations import transformers as usp
    from usp_hal.integrations.cache import ShardedCache

    mesh = _mesh(U, R)
    name = usp.register(f"usp_hal_test_generate_u{U}r{R}", mesh=mesh, layout="zigzag", attn_type="sdpa", enable=True)
    ref = tiny_llama(seed, num_hidden_layers=2) if arch == "llama" else tiny_mistral(seed)
    ref.eval()
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    prompt, mask = _left_padded(pads, S, seed)
    cache = ShardedCache(model.config, mesh=mesh, block_size=block_size)
    kw = dict(max_new_tokens=new, do_sample=False, return_dict_in_generate=True, output_logits=True,
              pad_token_id=0)
    with torch.no_grad():
        out = model.generate(**usp.shard_batch({"input_ids": prompt, "attention_mask": mask}, mesh),
                             past_key_values=cache, **kw)
    gen = out.sequences[:, -new:]
    logits = torch.stack(out.logits, 1)
    res = {"tokens": gen.tolist(), "lengths": cache.core.lengths(0), "logits_sum": float(logits.double().sum())}
    if (dist.get_rank() if dist.is_initialized() else 0) != 0:
        return res
    with torch.no_grad():
        want = ref.generate(prompt, attention_mask=mask, **kw)
        # the control: the same prompt with the padding attended (an all-ones mask)
        unpadded = ref.generate(prompt, attention_mask=torch.ones_like(mask), **kw)
    ref_logits = torch.stack(want.logits, 1)
    res.update(ref_tokens=want.sequences[:, S:].tolist(), unmasked_tokens=unpadded.sequences[:, S:].tolist(),
               logits_diff=float((logits.double() - ref_logits.double()).abs().max()),
               unmasked_diff=float((torch.stack(unpadded.logits, 1).double() - ref_logits.double()).abs().max()),
               logits_scale=float(ref_logits.abs().max()))
    return res


def padded_forward_case(U=1, R=1, S=21, seed=0):
    """A model forward with labels on a padded batch (row 0 whole, row 1 left-padded, row 2
    right-padded) through shard_batch with its attention_mask, against one process's forward
    with that mask: the logits at the real tokens, the loss and every parameter's gradient.
    The pads' labels are -100, and so is the label of the first real token after a left
    padding (it is predicted from a pad, whose output transformers' own kernels disagree on)."""
    import copy

    from tests.integration_cases import tiny_llama
    from usp_hal.integrations import transformers as usp

    mesh = _mesh(U, R)
    name = usp.register(f"usp_hal_test_generate_u{U}r{R}", mesh=mesh, layout="zigzag", attn_type="sdpa", enable=True)
    ref = tiny_llama(seed, num_hidden_layers=2)
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    ids = torch.randint(1, 256, (3, S), generator=torch.Generator().manual_seed(seed + 5))
    mask = torch.ones(3, S, dtype=torch.long)
    mask[1, :6] = 0
    mask[2, -5:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 6] = -100
    batch = usp.shard_batch({"input_ids": ids, "attention_mask": mask, "labels": labels}, mesh)
    out = model(**batch)
    out.loss.backward()
    loss = float(usp.sync_gradients(model, mesh, out.loss))
    logits = usp_hal.unshard(out.logits.detach(), layout="zigzag", mesh=mesh)
    res = {"loss": loss}
    if mesh.sp_rank != 0:
        return res
    o = ref(input_ids=ids, attention_mask=mask, labels=labels)
    o.loss.backward()
    real = mask.bool()
    with torch.no_grad():
        unmasked = ref(input_ids=ids).logits      # the control: the pads attended
    d = lambda a, b: float((a.detach().double() - b.detach().double()).abs().max())  # noqa: E731
    res.update(loss_diff=abs(loss - float(o.loss.detach())), logits_diff=d(logits[real], o.logits[real]),
               logits_scale=float(o.logits.detach().abs().max()), unmasked_diff=d(unmasked[real], o.logits[real]),
               grad_diff=max(d(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())),
               grad_scale=max(float(q.grad.abs().max()) for q in ref.parameters()))
    return res


def dynamic_padding_case(U=1, R=1, lengths=(24, 18, 30), seed=0):
    """Batches padded to their own longest row, as DataCollatorWithPadding gives them (right
    padding; the lengths shrink, then grow), through one model with the usp_hal attention:
    each step's loss, logits at the real tokens and gradients against one process's forward
    with that batch's attention_mask."""
    import copy

    from tests.integration_cases import tiny_llama
    from usp_hal.integrations import transformers as usp

    mesh = _mesh(U, R)
    name = usp.register(f"usp_hal_test_generate_u{U}r{R}", mesh=mesh, layout="zigzag", attn_type="sdpa", enable=True)
    ref = tiny_llama(seed, num_hidden_layers=2)
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    g = torch.Generator().manual_seed(seed + 7)
    steps = []
    for S in lengths:
        ids = torch.randint(1, 256, (2, S), generator=g)
        mask = torch.ones(2, S, dtype=torch.long)
        mask[1, S - 3 - int(torch.randint(0, 4, (1,), generator=g)):] = 0      # row 1 shorter: right pads
        ids = ids.masked_fill(mask == 0, 0)
        labels = ids.masked_fill(mask == 0, -100)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        batch = usp.shard_batch({"input_ids": ids, "attention_mask": mask, "labels": labels}, mesh)
        out = model(**batch)
        out.loss.backward()
        loss = float(usp.sync_gradients(model, mesh, out.loss))
        logits = usp_hal.unshard(out.logits.detach(), layout="zigzag", mesh=mesh)
        step = {"S": S, "loss": loss}
        if mesh.sp_rank == 0:
            o = ref(input_ids=ids, attention_mask=mask, labels=labels)
            o.loss.backward()
            real = mask.bool()
            d = lambda a, b: float((a.detach().double() - b.detach().double()).abs().max())  # noqa: E731
            step.update(loss_diff=abs(loss - float(o.loss.detach())), logits_diff=d(logits[real], o.logits[real]),
                        logits_scale=float(o.logits.detach().abs().max()),
                        grad_diff=max(d(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())),
                        grad_scale=max(float(q.grad.abs().max()) for q in ref.parameters()))
        steps.append(step)
    return steps
