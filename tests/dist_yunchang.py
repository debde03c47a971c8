"""Rank functions for tests/test_yunchang_compat.py: yunchang's names on real gloo groups."""
import torch
import torch.distributed as dist

import usp_hal
from usp_hal.dispatch.reference import reference_attention, tolerance
from usp_hal.kernels import AttnType
from usp_hal.parallel import mesh as mesh_mod


def _inputs(B=2, S=16, H=4, D=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, H, D, generator=g).to(dtype) for _ in range(4)]      # q, k, v, dout


def _close(a, b, dtype, what):
    atol, rtol = tolerance(dtype)
    err = (a.double() - b.double()).abs().max().item()
    assert torch.allclose(a.double(), b.double(), atol=atol, rtol=rtol), f"{what}: max error {err}"
    return err


def extract_follows_placement(use_ulysses_low: bool):
    """EXTRACT_FUNC_DICT after set_seq_parallel_pg(2, 2, ..., use_ulysses_low) cuts the shard the
    attention expects (the one ``usp_hal.shard`` cuts from the mesh), for every yunchang key."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert usp_hal.set_seq_parallel_pg(2, 2, rank, world, use_ulysses_low=use_ulysses_low) is None
    mesh = usp_hal.get_default_mesh()
    x = torch.arange(2 * 16 * 3, dtype=torch.float32).view(2, 16, 3)
    out = {}
    for key, layout in (("basic", "basic"), ("zigzag", "zigzag"), ("strip", "stripe")):
        got = usp_hal.EXTRACT_FUNC_DICT[key](x, rank, world_size=world, rd=2, ud=2)
        out[key] = bool(torch.equal(got, usp_hal.shard(x, layout=layout, mesh=mesh)))
    return out


def ulysses_from_group(positional: bool):
    """UlyssesAttention(group, ...) on two groups of two ranks, no mesh set beforehand: out and
    gradients against the float64 reference of each group's sequence."""
    rank = dist.get_rank()
    mesh_mod._set_default(None)      # nothing set up before: the module works from its group alone
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    q, k, v, dout = _inputs(seed=rank // 2)
    if positional:
        attn = usp_hal.UlyssesAttention(group, 2, 1, False, AttnType.TORCH_MATH)
    else:
        attn = usp_hal.UlyssesAttention(sequence_process_group=group, attn_type=AttnType.TORCH_FLASH)
    me = rank % 2
    ql, kl, vl = (x.chunk(2, dim=1)[me].clone().requires_grad_() for x in (q, k, v))
    out = attn(ql, kl, vl, causal=True, return_attn_probs=True)
    assert isinstance(out, torch.Tensor), type(out)      # yunchang's return: the output alone
    out.backward(dout.chunk(2, dim=1)[me])
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    ref, _ = reference_attention(qd, kd, vd, causal=True)
    ref.backward(dout.double())
    errs = {"out": _close(out, ref.chunk(2, dim=1)[me], torch.float32, "out")}
    for name, mine, full in (("dq", ql, qd), ("dk", kl, kd), ("dv", vl, vd)):
        errs[name] = _close(mine.grad, full.grad.chunk(2, dim=1)[me], torch.float32, name)
    return errs


def ring_functions(fn_name: str, layout: str, packed: str = ""):
    """yunchang's ring functions over a ring of two ranks (two rings in a world of four):
    ``(out, lse, None)`` with return_attn_probs, out/lse/gradients against the reference."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    q, k, v, dout = _inputs(seed=10 + rank // 2)
    mesh = usp_hal.compat.mesh_of_group(group, "ring")
    ql, kl, vl = (usp_hal.shard(x, layout=layout, mesh=mesh).clone().requires_grad_() for x in (q, k, v))
    fn = getattr(usp_hal, fn_name)
    if packed == "qkv":
        qkv = torch.stack([ql, kl, vl], dim=2).detach().requires_grad_()
        res = fn(qkv, causal=True, return_attn_probs=True, group=group, attn_type=AttnType.TORCH_MATH)
    elif packed == "kv":
        kv = torch.stack([kl, vl], dim=2).detach().requires_grad_()
        res = fn(ql, kv, causal=True, return_attn_probs=True, group=group, attn_type=AttnType.TORCH_MATH)
    else:
        res = fn(ql, kl, vl, 0.0, None, True, (-1, -1), 0.0, None, False, True, group, AttnType.TORCH_MATH)
    assert isinstance(res, tuple) and len(res) == 3 and res[2] is None, type(res)
    out, lse, _ = res
    out.backward(usp_hal.shard(dout, layout=layout, mesh=mesh))
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    ref, ref_lse = reference_attention(qd, kd, vd, causal=True)
    ref.backward(dout.double())
    errs = {"out": _close(out, usp_hal.shard(ref, layout=layout, mesh=mesh), torch.float32, "out")}
    lse_ref = usp_hal.shard(ref_lse.transpose(1, 2), layout=layout, mesh=mesh).transpose(1, 2)
    errs["lse"] = _close(lse, lse_ref, torch.float32, "lse")
    grads = {"qkv": lambda: qkv.grad.unbind(2), "kv": lambda: (ql.grad, *kv.grad.unbind(2))}.get(
        packed, lambda: (ql.grad, kl.grad, vl.grad))()
    for name, mine, full in zip(("dq", "dk", "dv"), grads, (qd, kd, vd)):
        errs[name] = _close(mine, usp_hal.shard(full.grad, layout=layout, mesh=mesh), torch.float32, name)
    # without return_attn_probs: the output tensor alone, as yunchang's
    plain = fn(ql.detach(), kl.detach(), vl.detach(), causal=True, group=group, attn_type="sdpa") if not packed \
        else None
    if plain is not None:
        assert isinstance(plain, torch.Tensor)
        errs["plain"] = _close(plain, out.detach(), torch.float32, "plain")
    return errs


def ring_pytorch_returns_the_output():
    """ring_pytorch_attn_func: torch SDPA whatever attn_type says, the output alone (yunchang's
    RingAttentionFunc returns only it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, _ = _inputs(seed=3)
    mesh = usp_hal.compat.mesh_of_group(None, "ring")
    ql, kl, vl = (usp_hal.shard(x, layout="basic", mesh=mesh) for x in (q, k, v))
    out = usp_hal.ring_pytorch_attn_func(ql, kl, vl, causal=True, return_attn_probs=True, attn_type=AttnType.FA)
    assert isinstance(out, torch.Tensor)
    ref, _ = reference_attention(q.double(), k.double(), v.double(), causal=True)
    return _close(out, usp_hal.shard(ref, layout="basic", mesh=mesh), torch.float32, f"out rank {rank}/{world}")


def processor_on_a_ring():
    """On a ring of two: an output-only attn_processor (SPARSE_SAGE) is refused on every rank,
    naming the missing lse; a flash-style one (attn_type None: out and lse) runs and matches the
    reference.  The flash-style one is the processor the peer bench gives yunchang on CPU."""
    from usp_hal.harness.cases import yunchang_cpu_processor

    def output_only(q, k, v, is_causal=False, scale=None, tensor_layout="NHD"):
        return q
    q, k, v, _ = _inputs(seed=4)
    mesh = usp_hal.compat.mesh_of_group(None, "ring")
    ql, kl, vl = (usp_hal.shard(x, layout="basic", mesh=mesh) for x in (q, k, v))
    refused = None
    try:
        usp_hal.ring_flash_attn_func(ql, kl, vl, causal=True, attn_type=AttnType.SPARSE_SAGE,
                                     attn_processor=output_only)
    except Exception as exc:                  # the message is the result
        refused = f"{type(exc).__name__}: {exc}"
    out = usp_hal.ring_flash_attn_func(ql, kl, vl, causal=True, attn_type=None, attn_processor=yunchang_cpu_processor)
    ref, _ = reference_attention(q.double(), k.double(), v.double(), causal=True)
    return refused, _close(out, usp_hal.shard(ref, layout="basic", mesh=mesh), torch.float32, "flash-style processor")


def extract_refuses_degrees_against_the_mesh():
    """After set_seq_parallel_pg(ulysses 2, ring 1), EXTRACT_FUNC_DICT with the degrees swapped
    (rd=2, ud=1) would cut a ring-of-2 zigzag shard the attention does not expect: each rank
    raises, naming the mesh's degrees.  The mesh's own degrees still cut usp_hal.shard's shard."""
    rank, world = dist.get_rank(), dist.get_world_size()
    usp_hal.set_seq_parallel_pg(2, 1, rank, world)
    mesh = usp_hal.get_default_mesh()
    x = torch.arange(2 * 16 * 3, dtype=torch.float32).view(2, 16, 3)
    errors = []
    for key in ("basic", "zigzag", "strip"):
        try:
            usp_hal.EXTRACT_FUNC_DICT[key](x, rank, world_size=world, rd=2, ud=1)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    good = usp_hal.EXTRACT_FUNC_DICT["zigzag"](x, rank, world_size=world, rd=1, ud=2)
    return errors, bool(torch.equal(good, usp_hal.shard(x, layout="zigzag", mesh=mesh)))
