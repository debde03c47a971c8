"""Functions that run on every rank of a WorkerPool for hybrid models (linear attention,
state-space and short-convolution layers) under the transformers integration: tiny models
from their configs, no downloads."""
from __future__ import annotations

import torch

from tests.dist_cases import error_of, get_mesh

VOCAB = 128


def tiny_hybrid(model_type: str, seed: int = 0):
    """A tiny randomly initialised causal LM of ``model_type`` with both kinds of layer."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, max_position_embeddings=256)
    extra = {
        "qwen3_next": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], head_dim=16,
                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                           linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1),
        "lfm2": dict(num_hidden_layers=2, full_attn_idxs=[1], block_ff_dim=96, block_auto_adjust_ff_dim=False),
        "mamba": dict(num_hidden_layers=2, state_size=4, expand=2),
        "nemotron_h": dict(layers_block_type=["mamba", "attention"], head_dim=16, ssm_state_size=8,
                           mamba_num_heads=6, mamba_head_dim=8, n_groups=3, expand=1, chunk_size=16,
                           conv_kernel=4),
        # KDA (6 heads, per-channel decay) + MLA attention (Dk = 8 + 8 != Dv = 12)
        "kimi_linear": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                            mlp_layer_types=["dense", "sparse"], kv_lora_rank=16, q_lora_rank=None,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, linear_head_dim=8,
                            linear_num_heads=6, moe_intermediate_size=32, num_local_experts=4,
                            num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    }[model_type]
    if model_type == "kimi_linear":
        common.update(num_key_value_heads=4)
    if model_type == "nemotron_h":
        common.update(hidden_size=48)
    if model_type == "mamba":
        common = dict(vocab_size=VOCAB, hidden_size=32)
    torch.manual_seed(seed)
    cfg = CONFIG_MAPPING[model_type](**common, **extra)
    return AutoModelForCausalLM.from_config(cfg)


def _olmo_hybrid(name):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    cfg = CONFIG_MAPPING["olmo_hybrid"](vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=96, num_hidden_layers=2, pad_token_id=0,
                                       layer_types=["linear_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(cfg)
    model.set_attn_implementation(name)
    return model


def hybrid_refusals(U=1, R=2, B=1, S=16, model_types=("mamba",)):
    """Uncovered hybrids under attn_implementation="usp_hal" are refused by name on every rank,
    before their first sharded forward, and in generate(); a covered one (qwen3_next) refuses
    generation, packed documents and a cache, and still runs afterwards."""
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    name = usp.register(f"usp_hal_hybrid_u{U}r{R}", mesh=mesh, layout="zigzag", attn_type="sdpa", enable=True)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    batch = usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, "zigzag")
    gen = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids")}
    res = {}
    for mt in model_types:
        model = tiny_hybrid(mt)
        model.set_attn_implementation(name)
        res[mt] = error_of(lambda m=model: m(**batch))
        res[mt + "_again"] = error_of(lambda m=model: m(**batch))          # refused every time, not only once
        res[mt + "_generate"] = error_of(lambda m=model: m.generate(**gen, max_new_tokens=2, do_sample=False))
    packed = usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, "zigzag", cu_seqlens=(0, 7, S))
    lfm2 = tiny_hybrid("lfm2")
    lfm2.set_attn_implementation(name)
    res["lfm2_packed"] = error_of(lambda: lfm2(**packed))          # a type not tested with documents
    res["bad_recurrence"] = error_of(lambda: usp.register("usp_hal_bad", mesh=mesh, recurrence="scan"))
    forced = usp.register(f"usp_hal_hybrid_u{U}r{R}_sp", mesh=mesh, layout="zigzag", attn_type="sdpa",
                          recurrence="state_passing", enable=True)
    from usp_hal.integrations import sequence_mixers as hybrid
    # a covered layer without a state-passing form: kimi_linear's KDA with its entry taken away
    # (every covered recurrence has one now); forcing state passing on it is refused, by layer
    hybrid.STATE_PASSING_LAYERS.discard("KimiLinearDeltaAttention")
    try:
        kimi = tiny_hybrid("kimi_linear")
        kimi.set_attn_implementation(forced)
        res["no_state_passing_form"] = error_of(lambda: kimi(**batch))
    finally:
        hybrid.STATE_PASSING_LAYERS.add("KimiLinearDeltaAttention")
    model = tiny_hybrid("qwen3_next")
    model.set_attn_implementation(name)
    res["qwen3_next_cache"] = error_of(lambda: model(**batch, use_cache=True))
    res["qwen3_next_generate"] = error_of(lambda: model.generate(**gen, max_new_tokens=2, do_sample=False))
    def run():
        out = model(**batch)
        out.loss.backward()
        usp.sync_gradients(model, mesh, out.loss)
    res["qwen3_next_runs"] = error_of(run)
    res["olmo_hybrid"] = error_of(lambda: _olmo_hybrid(name)(**batch))     # GDN layers, but an untested family
    return res


def unchecked_models_refused(U=1, R=2, B=1, S=16):
    """register() registers the attention name only: a sequence-parallel forward of a model whose
    layers were never checked (built without enable(): lfm2, whose short convolutions would
    each see only their rank's tokens) is refused on every rank, naming enable(); once enable()
    is on, a model built afterwards is checked (its convolutions wired) and runs."""
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    usp.disable()                  # the pool's ranks may hold an enable() of an earlier case
    name = usp.register(f"usp_hal_unchecked_u{U}r{R}", mesh=mesh, layout="zigzag", attn_type="sdpa")
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    batch = usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, "zigzag")
    res = {"patched": usp.patched()}
    model = tiny_hybrid("lfm2")
    model.set_attn_implementation(name)
    res["unchecked"] = error_of(lambda: model(**batch))
    usp.enable()
    model = tiny_hybrid("lfm2")
    model.set_attn_implementation(name)
    res["checked"] = error_of(lambda: model(**batch))
    return res


# ----------------------------------------------------------------------------- per-head operators
# Plain, step-by-step definitions (the truth the region is compared with, in float64).
def _resets(seqlen: int, cu, device):
    """Bool [S]: True at every document start (a recurrence starts from zero there)."""
    r = torch.zeros(seqlen, dtype=torch.bool, device=device)
    for start in (cu or (0,))[:-1] if cu else (0,):
        r[start] = True
    return r


def gdn(q, k, v, g, beta, cu_seqlens=None):
    """Gated delta rule: q/k [B, S, G, Dk], v [B, S, H, Dv], g (log decay, <= 0) and beta
    [B, S, H]; per head, state M [Dk, Dv]: M <- exp(g) M; M <- M + k (beta (v - M^T k))^T;
    out = M^T q.  The state restarts at every document of ``cu_seqlens``."""
    b, s, h, dv = v.shape
    rep = h // q.shape[2]
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    state = v.new_zeros(b, h, k.shape[-1], dv)
    starts = _resets(s, cu_seqlens, v.device)
    outs = []
    for t in range(s):
        if starts[t]:
            state = state * 0
        state = state * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", state, kt)
        state = state + torch.einsum("bhk,bhv->bhkv", kt, beta[:, t, :, None] * err)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, dim=1)


def ssd(x, dt, bm, cm, a_all, d_all, heads, cu_seqlens=None):
    """Mamba2's scan with diagonal (scalar per head) decay: x [B, S, H, P], dt [B, S, H] (> 0),
    B/C [B, S, G, N] grouped over heads; parameters A [H] (< 0), D [H] sliced to ``heads``.
    h <- exp(dt A) h + dt x B^T;  y = h C + D x."""
    a, d = a_all[heads.start:heads.stop], d_all[heads.start:heads.stop]
    b, s, h, p = x.shape
    rep = h // bm.shape[2]
    bm, cm = bm.repeat_interleave(rep, dim=2), cm.repeat_interleave(rep, dim=2)
    state = x.new_zeros(b, h, p, bm.shape[-1])
    starts = _resets(s, cu_seqlens, x.device)
    outs = []
    for t in range(s):
        if starts[t]:
            state = state * 0
        decay = (dt[:, t] * a).exp()
        state = state * decay[..., None, None] + torch.einsum("bh,bhp,bhn->bhpn", dt[:, t], x[:, t], bm[:, t])
        outs.append(torch.einsum("bhpn,bhn->bhp", state, cm[:, t]) + d[:, None] * x[:, t])
    return torch.stack(outs, dim=1)


def causal_conv(x, w_all, heads, cu_seqlens=None):
    """Depthwise causal convolution, channels grouped by head: x [B, S, H, D], weight
    [H, D, K] sliced to ``heads``: y_t = sum_j w[j] x_{t-K+1+j}, zero before each document."""
    w = w_all[heads.start:heads.stop]
    s, ksize = x.shape[1], w.shape[-1]
    doc = torch.zeros(s, dtype=torch.long, device=x.device)
    if cu_seqlens:
        for i in range(1, len(cu_seqlens) - 1):
            doc[cu_seqlens[i]:] += 1
    out = torch.zeros_like(x)
    for j in range(ksize):
        lag = ksize - 1 - j
        if lag >= s:
            continue
        shifted = torch.zeros_like(x)
        shifted[:, lag:] = x[:, :s - lag]
        same = torch.zeros(s, dtype=torch.bool, device=x.device)
        same[lag:] = doc[lag:] == doc[:s - lag]
        out = out + shifted * same[None, :, None, None] * w[None, None, :, :, j]
    return out


def _op_inputs(op: str, B: int, S: int, H: int, G: int, seed: int):
    """(tensors, grouped, params, fn-with-heads?) of a global problem, float64."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale)

    if op == "gdn":
        q, k = rnd(B, S, G, 4), rnd(B, S, G, 4)
        k = k / k.norm(dim=-1, keepdim=True)
        v = rnd(B, S, H, 3)
        g = -torch.rand(B, S, H, generator=gen, dtype=torch.float64) * 0.5
        beta = torch.rand(B, S, H, generator=gen, dtype=torch.float64)
        return [q, k, v, g, beta], (0, 1), [], False
    if op == "ssd":
        x = rnd(B, S, H, 3)
        dt = torch.rand(B, S, H, generator=gen, dtype=torch.float64) * 0.5 + 0.1
        bm, cm = rnd(B, S, G, 2), rnd(B, S, G, 2)
        a = -(torch.rand(H, generator=gen, dtype=torch.float64) + 0.5)
        d = rnd(H)
        return [x, dt, bm, cm], (2, 3), [a, d], True
    if op == "conv":
        return [rnd(B, S, H, 2)], (), [rnd(H, 2, 4)], True
    raise ValueError(op)


_OPS = {"gdn": gdn, "ssd": ssd, "conv": causal_conv}


def head_parallel_ops(U=1, R=2, layout="zigzag", cases=(), B=2, S=13, dtype="fp64", cu=None, mutate=None):
    """Each ``(op, H, G)`` of ``cases`` on sequence shards through ``usp_hal.head_parallel``
    against the same operator on the whole sequence in one process, in float64: the output
    and the gradients of every input and parameter (parameters: summed over the group).
    Returns, per case, the worst error relative to the dtype's tolerance (<= 1 passes)."""
    import usp_hal
    from tests.dist_cases import _err
    from usp_hal.mixers.head_parallel import head_parallel

    mesh = get_mesh(U, R)
    dt = {"fp64": torch.float64, "fp32": torch.float32}[dtype]
    res = {}
    for op, H, G in cases:
        tensors, grouped, params, with_heads = _op_inputs(op, B, S, H, G, seed=H * 7 + G)
        fn = _OPS[op]
        kw = {"cu_seqlens": cu} if cu is not None else {}

        def bound(*xs, heads=range(H), _fn=fn, _params=None, _default=params, **extra):
            ps = _default if _params is None else _params
            return _fn(*xs, *ps, heads, **extra) if ps else _fn(*xs, **extra)

        # the truth: the whole sequence, one process, float64
        ref_in = [t.clone().requires_grad_(True) for t in tensors]
        ref_params = [p.clone().requires_grad_(True) for p in params]
        ref_out = bound(*ref_in, _params=ref_params, **kw)
        dout = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
        (ref_out * dout).sum().backward()

        # sequence shards through the region, in dtype
        local = [usp_hal.shard(t, layout=layout, mesh=mesh, cu_seqlens=cu).to(dt).requires_grad_(True)
                 for t in tensors]
        mine = [p.clone().to(dt).requires_grad_(True) for p in params]

        def region_fn(*xs, heads=None, _mine=mine, _all=range(H), _bound=bound, **extra):
            if mutate == "drop_documents":
                extra.pop("cu_seqlens", None)
            return _bound(*xs, heads=heads if heads is not None else _all, _params=_mine, **extra)

        out = head_parallel(region_fn, *local, grouped=grouped, mesh=mesh, layout=layout, with_heads=with_heads,
                            cu_seqlens=cu)
        if mutate == "skip_region":       # what the model did before: each rank's shard on its own
            out = bound(*local, heads=range(H), _params=mine)
        ldout = usp_hal.shard(dout, layout=layout, mesh=mesh, cu_seqlens=cu).to(dt)
        (out * ldout).sum().backward()
        worst = _err(out, usp_hal.shard(ref_out.detach(), layout=layout, mesh=mesh, cu_seqlens=cu), dt)
        for x, r in zip(local, ref_in):
            worst = max(worst, _err(x.grad, usp_hal.shard(r.grad, layout=layout, mesh=mesh, cu_seqlens=cu), dt))
        for p, r in zip(mine, ref_params):
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)     # a rank without heads
            torch.distributed.all_reduce(grad, group=mesh.sp_group)
            worst = max(worst, _err(grad, r.grad, dt))
        res[f"{op}-H{H}-G{G}"] = worst
    return res


# ----------------------------------------------------------------------------- models vs one process
def _max_diff(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _reference_step(ref, ids, cu):
    """Logits and loss of one process: the whole rows, or each document of ``cu`` on its own
    (positions from 0, no label across a document end), the loss over every counted label."""
    if cu is None:
        out = ref(input_ids=ids, labels=ids)
        return out.logits, out.loss
    logits = torch.cat([ref(input_ids=ids[:, a:e]).logits for a, e in zip(cu[:-1], cu[1:])], dim=1)
    labels = torch.full_like(ids, -100)
    for a, e in zip(cu[:-1], cu[1:]):
        labels[:, a:e - 1] = ids[:, a + 1:e]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                             reduction="sum") / int((labels != -100).sum())
    return logits, loss


class _Mutant:
    """A defect put into the sequence-parallel path for one run (to show the comparison sees
    it): ``drop_state`` (state passing hands every piece a zero state), ``short_halo`` (the conv
    halo one token short), ``drop_documents`` (the layers' operators ignore document starts)."""

    def __init__(self, kind):
        self.kind, self.undo = kind, []

    def _patch(self, obj, name, value):
        self.undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def __enter__(self):
        import usp_hal.mixers.head_parallel as hp
        import usp_hal.mixers.state_passing as sp
        if self.kind == "drop_state":
            self._patch(sp, "_carry_in", lambda finals, plan, where, dv: [None] * len(plan))
        elif self.kind == "short_halo":
            conv = hp.halo_causal_conv
            self._patch(hp, "halo_causal_conv",
                        lambda x, w, b=None, **kw: conv(x, w, b, _halo_width=int(w.shape[-1]) - 2, **kw))
        elif self.kind == "drop_documents":
            for mod, name in ((hp, "halo_causal_conv"), (hp, "head_parallel"), (sp, "gated_delta_rule"),
                              (sp, "ssd")):
                fn = getattr(mod, name)
                self._patch(mod, name, lambda *a, _fn=fn, **kw: _fn(*a, **{**kw, "cu_seqlens": None}))
        elif self.kind is not None:
            raise ValueError(self.kind)
        return self

    def __exit__(self, *exc):
        for obj, name, value in reversed(self.undo):
            setattr(obj, name, value)


def hybrid_training(model_type="qwen3_next", U=2, R=1, layout="zigzag", steps=3, B=2, S=40, seed=0, lr=1e-3,
                    unwired=False, conv="auto", recurrences=("auto",), cu=None, mutants=(), dtype="fp32"):
    """Logits, loss, every gradient and ``steps`` AdamW steps of a tiny hybrid under
    attn_implementation="usp_hal", against the same model in one process (on rank 0), for each
    of ``recurrences`` (register(..., recurrence=)) and then each of ``mutants`` (see
    :class:`_Mutant`; run with the first recurrence, one step: compare their logits and
    gradients).  ``cu``: packed documents (global boundaries, through shard_batch); the one
    process then runs each document on its own.
    ``unwired``: run the hybrid layers on each rank's shard (the defect), to show the
    comparison fails then.  ``dtype``: of the model and of the one process ("fp32", "fp64",
    "bf16").  Returns ``{run name: results}``."""
    import copy

    import usp_hal
    from usp_hal.integrations import sequence_mixers as hybrid
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    dtypes = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}
    ref = tiny_hybrid(model_type, seed).to(dtypes[dtype])
    ref.set_attn_implementation("sdpa")
    start = copy.deepcopy(ref)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed + 1))
    batch = usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, layout, cu_seqlens=cu)
    find = hybrid.find_sequence_mixers
    hybrid.CONV_EXCHANGE = conv
    runs = [(rec, rec, None) for rec in recurrences] + [(m, recurrences[0], m) for m in mutants]
    out_all: dict = {}
    for run_name, rec, mutant in runs:
        name = usp.register(f"usp_hal_hybrid_u{U}r{R}_{layout}_{rec}", mesh=mesh, layout=layout, attn_type="sdpa",
                            recurrence=rec, enable=True)
        model = copy.deepcopy(start)
        model.set_attn_implementation(name)
        if unwired:             # neither wired nor refused: the layers run on each rank's shard
            hybrid.COVERED_MODEL_TYPES.discard(model_type)
            hybrid.find_sequence_mixers = lambda m, **kw: []
        try:
            with _Mutant(mutant):
                out = model(**batch)
                logits = usp_hal.unshard(out.logits.detach(), layout=layout, mesh=mesh, cu_seqlens=cu)
                out.loss.backward()
                loss0 = float(usp.sync_gradients(model, mesh, out.loss))
                grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                opt = torch.optim.AdamW(model.parameters(), lr=lr)
                opt.step()
                opt.zero_grad()
                losses = [loss0]
                for _ in range(steps - 1 if mutant is None else 0):      # a mutant: its first step is enough
                    out = model(**batch)
                    out.loss.backward()
                    losses.append(float(usp.sync_gradients(model, mesh, out.loss)))
                    opt.step()
                    opt.zero_grad()
        finally:
            if unwired:
                hybrid.COVERED_MODEL_TYPES.add(model_type)
                hybrid.find_sequence_mixers = find
        modes = {p: m.__dict__[hybrid._WIRED][2] for p, m in model.named_modules() if hybrid._WIRED in m.__dict__}
        out_all[run_name] = {"losses": losses, "modes": modes, "logits": logits, "grads": grads,
                             "params": [p.detach().clone() for p in model.parameters()],
                             "wired": [p for p, m in model.named_modules() if getattr(m, hybrid._COVERED, False)]}
    if mesh.sp_rank != 0:
        return {k: {"losses": v["losses"], "modes": v["modes"]} for k, v in out_all.items()}
    rlogits, rloss = _reference_step(ref, ids, cu)
    rloss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr)
    ropt.step()
    ropt.zero_grad()
    ref_losses = [rloss.item()]
    for _ in range(steps - 1):
        _, loss = _reference_step(ref, ids, cu)
        loss.backward()
        ref_losses.append(loss.item())
        ropt.step()
        ropt.zero_grad()
    res = {}
    for run_name, got in out_all.items():
        grads = got["grads"]
        gdiff = {n: _max_diff(grads.get(n, torch.zeros_like(g)), g) / (float(g.abs().max()) + 1e-12)
                 for n, g in ref_grads.items()}
        worst = max(gdiff, key=lambda n: gdiff[n])
        res[run_name] = dict(
            losses=got["losses"], modes=got["modes"], wired=got["wired"], logits_diff=_max_diff(got["logits"], rlogits),
            ref_losses=ref_losses, loss_diff=max(abs(a - b) for a, b in zip(got["losses"], ref_losses)),
            grad_rel=gdiff[worst], worst_grad=worst, n_grads=len(ref_grads), same_grads=set(grads) == set(ref_grads),
            param_diff=max(_max_diff(p, q) for p, q in zip(got["params"], ref.parameters())))
    return res


def halo_conv(U=1, R=2, layout="zigzag", B=2, S=19, C=3, K=4, cu=None, mutate=None, lengths=(19, 64, 256)):
    """usp_hal.mixers.head_parallel.halo_causal_conv on sequence shards against the depthwise causal conv on
    the whole sequence in float64 (output, input, weight and bias gradients), and the number of
    halo tokens each rank receives for each sequence length of ``lengths``."""
    import usp_hal
    from tests.dist_cases import _err
    from usp_hal.mixers.head_parallel import _halo_plan, halo_causal_conv

    mesh = get_mesh(U, R)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(B, S, C, generator=gen, dtype=torch.float64)
    w = torch.randn(C, K, generator=gen, dtype=torch.float64)
    bias = torch.randn(C, generator=gen, dtype=torch.float64)
    dout = torch.randn(B, S, C, generator=gen, dtype=torch.float64)
    rx, rw, rb = (t.clone().requires_grad_(True) for t in (x, w, bias))
    ref = causal_conv(rx.unsqueeze(-1), rw.unsqueeze(1), range(C), cu_seqlens=cu).squeeze(-1) + rb
    (ref * dout).sum().backward()

    def sh(t):
        return usp_hal.shard(t, layout=layout, mesh=mesh, cu_seqlens=cu)

    lx = sh(x).requires_grad_(True)
    lw, lb = w.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    width = {"short_halo": K - 2}.get(mutate)
    out = halo_causal_conv(lx, lw, lb, mesh=mesh, layout=layout, cu_seqlens=None if mutate == "drop_documents" else cu,
                           _halo_width=width)
    (out * sh(dout)).sum().backward()
    worst = max(_err(out, sh(ref.detach()), torch.float64), _err(lx.grad, sh(rx.grad), torch.float64))
    for p, r in ((lw, rw), (lb, rb)):
        g = p.grad.clone()
        torch.distributed.all_reduce(g, group=mesh.sp_group)
        worst = max(worst, _err(g, r.grad, torch.float64))
    halo_tokens = {n: sum(int(p.numel()) for p in _halo_plan(mesh, layout, n, None, K - 1)[1]) for n in lengths}
    return {"worst": worst, "halo_tokens": halo_tokens}
