"""Rank functions for tests/test_users.py: what users of the integrations do next (mixed
precision, calls outside the group, gradient bookkeeping, sampling in generate()).  Each
builds its inputs from a seed on every rank and computes the single-process reference in the
same worker."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import usp_hal
from tests.dist_cases import error_of, get_mesh
from tests.integration_cases import VOCAB, tiny_llama


def _max_diff(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


# ----------------------------------------------------------------------------- autocast
def autocast_core(U=1, R=2, B=1, S=24, H=4, D=16, seed=0):
    """q, k float32 and v bfloat16 (as after RoPE under autocast), attention under
    ``torch.autocast("cpu", bfloat16)``: sequence-parallel vs torch's SDPA in one process
    under the same autocast, and both vs float64."""
    mesh = get_mesh(U, R)
    g = torch.Generator().manual_seed(seed)
    q32, k32 = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, H, D, generator=g)
    v16 = torch.randn(B, S, H, D, generator=g).bfloat16()
    dout = torch.randn(B, S, H, D, generator=g)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type="zigzag", mesh=mesh)

    def sh(x):
        return usp_hal.shard(x, layout="zigzag", mesh=mesh).detach().requires_grad_()

    q, k, v = sh(q32), sh(k32), sh(v16)
    with torch.autocast("cpu", torch.bfloat16):
        out = attn(q, k, v, causal=True)
    out.float().backward(usp_hal.shard(dout, layout="zigzag", mesh=mesh))
    full = [usp_hal.unshard(t, layout="zigzag", mesh=mesh) for t in (out, q.grad, k.grad, v.grad)]
    res = {"dtypes": [str(t.dtype) for t in (out, q.grad, k.grad, v.grad)]}
    if mesh.sp_rank != 0:
        return res
    rq, rk, rv = (t.clone().requires_grad_() for t in (q32, k32, v16))
    with torch.autocast("cpu", torch.bfloat16):
        ref = torch.nn.functional.scaled_dot_product_attention(rq.transpose(1, 2), rk.transpose(1, 2),
                                                               rv.transpose(1, 2), is_causal=True).transpose(1, 2)
    ref.float().backward(dout)
    xq, xk, xv = (t.double().requires_grad_() for t in (q32.bfloat16(), k32.bfloat16(), v16))
    exact = torch.nn.functional.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2),
                                                             xv.transpose(1, 2), is_causal=True).transpose(1, 2)
    exact.backward(dout.double())
    res.update(ref_dtypes=[str(t.dtype) for t in (ref, rq.grad, rk.grad, rv.grad)],
               diffs=[_max_diff(a, b) for a, b in zip(full, (ref, rq.grad, rk.grad, rv.grad))],
               ref_vs_exact=[_max_diff(a, b) for a, b in zip((ref, rq.grad, rk.grad, rv.grad),
                                                            (exact, xq.grad, xk.grad, xv.grad))],
               sp_vs_exact=[_max_diff(a, b) for a, b in zip(full, (exact, xq.grad, xk.grad, xv.grad))])
    return res


def autocast_llama(U=1, R=2, steps=3, B=2, S=32, seed=0, lr=1e-3):
    """A custom training loop under ``torch.autocast("cpu", bfloat16)`` (tiny GQA Llama,
    AdamW): sequence-parallel vs one process under the same autocast; the one-process float32
    loop gives the size of bf16's own effect."""
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    name = usp.register(f"usp_hal_test_autocast_u{U}r{R}", mesh=mesh, attn_type="sdpa", enable=True)
    base = tiny_llama(seed, num_hidden_layers=2)
    g = torch.Generator().manual_seed(seed + 7)
    data = [torch.randint(0, VOCAB, (B, S), generator=g) for _ in range(steps)]

    def run(model, sp: bool, autocast: bool):
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        losses, grads = [], None
        for ids in data:
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                if sp:
                    out = model(**usp.shard_batch({"input_ids": ids, "labels": ids}, mesh))
                else:
                    out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            loss = usp.sync_gradients(model, mesh, out.loss) if sp else out.loss.detach()
            losses.append(float(loss))
            if grads is None:
                grads = torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        return losses, grads

    model = copy.deepcopy(base)
    model.set_attn_implementation(name)
    losses, grads = run(model, True, True)
    res = {"losses": losses}
    if mesh.sp_rank != 0:
        return res
    ref_losses, ref_grads = run(copy.deepcopy(base), False, True)
    fp32_losses, fp32_grads = run(copy.deepcopy(base), False, False)
    res.update(ref_losses=ref_losses, fp32_losses=fp32_losses,
               grad_rel=float((grads - ref_grads).norm() / ref_grads.norm()),
               bf16_effect=float((fp32_grads - ref_grads).norm() / ref_grads.norm()))
    return res


# ----------------------------------------------------------------------------- outside the group
def rank0_alone(U=1, R=2, B=2, S=24, seed=0, timeout=20.0):
    """Sequence-parallel training steps, then evaluation (a forward and a generate()) on rank 0
    alone, as a user would: it must return or raise within seconds, not wait in a collective
    (the mesh's groups time out after ``timeout`` seconds).  Then one more step on both ranks:
    the group still works and matches one process."""
    import time

    from usp_hal.integrations import transformers as usp

    mesh = usp_hal.init_sequence_parallel(U, R, set_default=False, timeout=timeout)
    name = usp.register(f"usp_hal_test_alone_u{U}r{R}", mesh=mesh, attn_type="sdpa", enable=True)
    base = tiny_llama(seed, num_hidden_layers=2)
    model = copy.deepcopy(base)
    model.set_attn_implementation(name)
    g = torch.Generator().manual_seed(seed + 3)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    out = model(**usp.shard_batch({"input_ids": ids, "labels": ids}, mesh))
    out.loss.backward()
    usp.sync_gradients(model, mesh, out.loss)
    model.zero_grad()
    res = {}
    if mesh.sp_rank == 0:
        model.eval()
        t0 = time.perf_counter()
        with torch.no_grad():
            res["forward"] = error_of(lambda: model(input_ids=ids, labels=ids))
            res["generate"] = error_of(lambda: model.generate(ids, max_new_tokens=2, do_sample=False))
        res["seconds"] = time.perf_counter() - t0
        model.train()
    with torch.no_grad():     # the group still works: both ranks, one sequence-parallel forward
        local = model(**usp.shard_batch({"input_ids": ids}, mesh)).logits
        ref = base(input_ids=ids).logits
    res["after_diff"] = _max_diff(usp_hal.unshard(local, layout="zigzag", mesh=mesh), ref)
    return res


# ----------------------------------------------------------------------------- gradient bookkeeping
def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.detach().double().reshape(-1) for p in model.parameters() if p.grad is not None])


def sync_twice(U=1, R=2, B=2, S=24, seed=0):
    """sync_gradients called twice, or once per micro-batch, is refused on every rank (the
    gradients stay those of one sync); zeroing in place between steps is not refused."""
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    name = usp.register(f"usp_hal_test_sync_u{U}r{R}", mesh=mesh, attn_type="sdpa", enable=True)
    base = tiny_llama(seed, num_hidden_layers=2)
    model = copy.deepcopy(base)
    model.set_attn_implementation(name)
    g = torch.Generator().manual_seed(seed + 11)
    a, b = (torch.randint(0, VOCAB, (B, S), generator=g) for _ in range(2))

    def step(ids):
        out = model(**usp.shard_batch({"input_ids": ids, "labels": ids}, mesh))
        out.loss.backward()
        return out.loss

    res = {}
    loss = step(a)
    usp.sync_gradients(model, mesh, loss)
    once = _grads(model)
    res["twice"] = error_of(lambda: usp.sync_gradients(model, mesh, loss))
    res["twice_unchanged"] = _max_diff(_grads(model), once)
    loss = step(b)                               # a second micro-batch on top of synced gradients
    res["per_micro_batch"] = error_of(lambda: usp.sync_gradients(model, mesh, loss))
    model.zero_grad(set_to_none=False)           # zeroed in place: a new step, not refused
    loss = step(b)
    res["zeroed_in_place"] = error_of(lambda: usp.sync_gradients(model, mesh, loss))
    zeroed = _grads(model)
    model.zero_grad()
    loss = step(b)
    res["set_to_none"] = error_of(lambda: usp.sync_gradients(model, mesh, loss))
    if mesh.sp_rank == 0:
        ref = copy.deepcopy(base)
        for ids, want in ((a, once), (b, zeroed)):
            ref.zero_grad()
            ref(input_ids=ids, labels=ids).loss.backward()
            res.setdefault("ref_diffs", []).append(_max_diff(_grads(ref), want))
    return res


def dp_sp_unequal_labels(U=2, R=1, B=2, S=24, seed=0, lr=1e-3, steps=2):
    """dp x sp custom loop (plain module, sync_gradients) where the replicas hold different
    numbers of labels (prompt-masked rows): with ``shard_batch(..., dp_group=mesh.dp_group)``
    loss and gradients equal one process on both batches together; without it they do not."""
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    replica = dist.get_rank() // mesh.sp_size
    name = usp.register(f"usp_hal_test_dpsp_u{U}r{R}", mesh=mesh, attn_type="sdpa", enable=True)
    base = tiny_llama(seed, num_hidden_layers=2)
    g = torch.Generator().manual_seed(seed + 21)
    data = []
    for i in range(mesh.dp_degree):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        labels = ids.clone()
        labels[:, : 4 + 9 * i] = -100            # replica i: a longer prompt, fewer labels
        data.append((ids, labels))

    def run(dp_group):
        model = copy.deepcopy(base)
        model.set_attn_implementation(name)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        losses, first = [], None
        ids, labels = data[replica]
        for _ in range(steps):
            out = model(**usp.shard_batch({"input_ids": ids, "labels": labels}, mesh, dp_group=dp_group))
            out.loss.backward()
            losses.append(float(usp.sync_gradients(model, mesh, out.loss)))
            if first is None:
                first = _grads(model)
            opt.step()
            opt.zero_grad()
        return losses, first

    losses, grads = run(mesh.dp_group)
    plain_losses, plain_grads = run(None)
    res = {"losses": losses}
    if dist.get_rank() != 0:
        return res
    ref = copy.deepcopy(base)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    ids = torch.cat([d[0] for d in data])
    labels = torch.cat([d[1] for d in data])
    ref_losses, ref_grads = [], None
    for _ in range(steps):
        out = ref(input_ids=ids, labels=labels)
        out.loss.backward()
        ref_losses.append(float(out.loss.detach()))
        if ref_grads is None:
            ref_grads = _grads(ref)
        opt.step()
        opt.zero_grad()
    res.update(ref_losses=ref_losses, plain_losses=plain_losses,
               loss_diff=max(abs(x - y) for x, y in zip(losses, ref_losses)),
               grad_diff=_max_diff(grads, ref_grads), grad_scale=float(ref_grads.abs().max()),
               plain_loss_diff=max(abs(x - y) for x, y in zip(plain_losses, ref_losses)),
               plain_grad_diff=_max_diff(plain_grads, ref_grads))
    return res


# ----------------------------------------------------------------------------- generate()
class _StopOnRank:
    """A stopping criterion that stops every row at step ``step``, on one rank only."""

    def __init__(self, rank: int, at_length: int):
        self.rank, self.at_length = rank, at_length

    def __call__(self, input_ids, scores, **kwargs):
        stop = dist.get_rank() == self.rank and input_ids.shape[1] >= self.at_length
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool)


def generate_sampling(U=1, R=2, B=2, S=15, new=8, seed=0):
    """Sampled generate() (temperature, top-k, top-p) on every rank, each rank seeded
    differently except rank 0, which is seeded like the one process it is compared with; then
    the decisions the ranks must take together: a criterion that stops on one rank, max_time,
    and a max_new_tokens that differs on one rank."""
    from transformers import StoppingCriteriaList

    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    name = usp.register(f"usp_hal_test_sample_u{U}r{R}", mesh=mesh, attn_type="sdpa", enable=True)
    ref = tiny_llama(seed, num_hidden_layers=2).eval()
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    prompt = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed + 5))
    kw = dict(max_new_tokens=new, do_sample=True, temperature=0.7, top_k=50, top_p=0.9, pad_token_id=0)
    rank = dist.get_rank()
    res = {}
    with torch.no_grad():
        torch.manual_seed(1234 if rank == 0 else 99 + rank)
        out = model.generate(**usp.shard_batch({"input_ids": prompt}, mesh), **kw)
        res["tokens"] = out[:, -new:].tolist()
        batch = usp.shard_batch({"input_ids": prompt}, mesh)
        local = batch["input_ids"].shape[1]
        stop = StoppingCriteriaList([_StopOnRank(1, local + 3)])      # 3 new tokens, on rank 1 only
        out = model.generate(**batch, stopping_criteria=stop, **dict(kw, do_sample=False))
        res["stopped_new"] = out.shape[1] - local
        out = model.generate(**usp.shard_batch({"input_ids": prompt}, mesh), max_time=0.0,
                             **dict(kw, do_sample=False))
        res["max_time_new"] = out.shape[1] - local
        res["different_max_new"] = error_of(lambda: model.generate(
            **usp.shard_batch({"input_ids": prompt}, mesh), **dict(kw, max_new_tokens=new + rank)))
        res["after"] = model.generate(**usp.shard_batch({"input_ids": prompt}, mesh),
                                      **dict(kw, do_sample=False))[:, -new:].tolist()
        if rank == 0:
            torch.manual_seed(1234)
            res["ref_tokens"] = ref.generate(prompt, **kw)[:, -new:].tolist()
            torch.manual_seed(77)
            res["other_seed"] = ref.generate(prompt, **kw)[:, -new:].tolist()
            res["ref_greedy"] = ref.generate(prompt, **dict(kw, do_sample=False))[:, -new:].tolist()
    return res


# ----------------------------------------------------------------------------- messages
def refusal_messages(U=1, R=2):
    """The agreement's refusal text (what the integrations raise): a reason every rank shares,
    and reasons that differ."""
    from usp_hal.parallel.comm import agree

    mesh = get_mesh(U, R)
    rank = mesh.sp_rank

    def text(problem):
        return error_of(lambda: agree(problem, mesh.metadata_group, what="the call", ranks=mesh.sp_ranks))

    return {"same": text("a padding mask"), "different": text(f"reason {rank}"),
            "one": text("only here" if rank == 1 else None)}
