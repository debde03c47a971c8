"""fla's gated DeltaNet and KDA kernels as the per-rank kernel of usp-hal's state passing
(usp_hal.integrations.fla.gated_delta_rule) on every rank of a WorkerPool, against the float64
recurrence over the whole sequence, per document (tests/test_fla_state_passing.py)."""
from __future__ import annotations

import torch

import usp_hal
from tests.dist_cases import get_mesh
from tests.dist_kda import delta_rule_problem
from tests.dist_state_passing import _errors, _mutated


def fla_case(U=1, R=2, layout="zigzag", S=26, op="gdn", kernel="naive_chunk_gated_delta_rule", cu=None,
             device="cpu", mutation=None, seed=0, kernel_kwargs=None, H=3, Hk=None):
    """{name: worst error / tolerance} of the output and the gradients of q, k, v, g, beta on
    this rank (fp32 tolerances: fla's kernels compute in fp32).  ``op``: "gdn" (``g [B, T, H]``)
    or "kda" (``g [B, T, H, dk]``).  ``device="cuda"``: the rank's tensors on cuda:0 (gloo
    stages them through host memory), for fla's Triton kernels.  ``H`` value heads, ``Hk``
    q/k heads (GVA when fewer).  ``kernel``: a name or a callable (see :func:`gva_wrapper`)."""
    from usp_hal.integrations import fla as usp_fla
    if device == "cuda":
        torch.cuda.set_device(0)
    mesh = get_mesh(U, R)
    if kernel == "gva_wrapper":
        kernel = gva_wrapper
    glob, dout, ref_in, ref = delta_rule_problem(seed, S, cu, B=2, H=H, dk=16, dv=16, per_channel=op == "kda", Hk=Hk)

    def sh(t):
        return usp_hal.shard(t, layout=layout, mesh=mesh, cu_seqlens=cu)
    loc = {n: sh(t).to(device).requires_grad_() for n, t in glob.items()}
    calls = []
    orig = usp_fla.kernel

    def counted(name, **kw):          # count the pieces that fla's kernel ran
        run = orig(name, **kw)

        def wrapped(*a, **k):
            calls.append(a[0].shape[1])
            return run(*a, **k)
        return wrapped
    usp_fla.kernel = counted
    undo = _mutated(mutation) if mutation else (lambda: None)
    try:
        out = usp_fla.gated_delta_rule(loc["q"], loc["k"], loc["v"], loc["g"], loc["beta"], mesh=mesh,
                                       layout=layout, cu_seqlens=cu, kernel=kernel, **(kernel_kwargs or {}))
        out.backward(sh(dout).to(device))
    finally:
        undo()
        usp_fla.kernel = orig
    res = _errors(out.cpu(), ref, {n: _Cpu(t) for n, t in loc.items()}, ref_in, sh, "fp32")
    res["kernel_calls"] = -len(calls)      # <= 1 (negative) so _within passes; the test reads it
    return res


class _Cpu:
    """A tensor's gradient on the CPU (for the comparison)."""

    def __init__(self, t):
        self.grad = t.grad.cpu()


def gva_wrapper(q, k, v, g, beta, **kw):
    """A user's own kernel (a callable): GVA's q/k heads repeated over the value heads, then
    fla's naive chunk kernel."""
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule
    q, k = (t.repeat_interleave(v.shape[2] // k.shape[2], dim=2) for t in (q, k))
    return naive_chunk_gated_delta_rule(q, k, v, g, beta, **kw)


def other_wrapper(q, k, v, g, beta, **kw):
    """Another callable (the same recurrence by fla's recurrent kernel): a different kernel."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    return naive_recurrent_gated_delta_rule(q, k, v, beta, g, **kw)


# per case: (rank 0's call, rank 1's call) as (kernel, keywords); None: the case's usual one
MISMATCHES = {
    "scale": (("naive_chunk_gated_delta_rule", {}), ("naive_chunk_gated_delta_rule", {"scale": 0.2})),
    "kernel": (("naive_chunk_gated_delta_rule", {}), ("naive_recurrent_gated_delta_rule", {})),
    "callable": (("gva_wrapper", {}), ("other_wrapper", {})),
    "chunk_size": (("naive_chunk_gated_delta_rule", {"chunk_size": 16}),
                   ("naive_chunk_gated_delta_rule", {"chunk_size": 64})),
    "unknown_keyword": (("naive_chunk_gated_delta_rule", {}), ("naive_chunk_gated_delta_rule", {"use_foo": True})),
    "unknown_kernel": (("naive_chunk_gated_delta_rule", {}), ("chunk_gla", {})),
    "refused_keyword": (("naive_chunk_gated_delta_rule", {}), ("naive_chunk_gated_delta_rule", {"cp_context": 1})),
    "triton_on_cpu": (("chunk_gated_delta_rule", {}), ("chunk_gated_delta_rule", {})),
    "gva_heads": (("naive_chunk_gated_delta_rule", {}), ("naive_chunk_gated_delta_rule", {})),
}


def fla_refusal(case: str, S: int = 26) -> dict:
    """A call the ranks make differently (or that some rank cannot run) on 2 ranks (ring 2,
    zigzag): {"error": type name, "message": text, "seconds": time to the error}; or
    {"out": worst error / tolerance of the output} when no rank raised (the silent case)."""
    import time

    import torch.distributed as dist

    from usp_hal.integrations import fla as usp_fla
    mesh = get_mesh(1, 2)
    names = {"gva_wrapper": gva_wrapper, "other_wrapper": other_wrapper}
    kern, kw = MISMATCHES[case][dist.get_rank()]
    kern = names.get(kern, kern)
    if case == "gva_heads":          # 3 value heads, 2 q/k heads: not a multiple (no reference for it)
        gen = torch.Generator().manual_seed(0)
        glob = {n: torch.randn(2, S, *shape, generator=gen) for n, shape in
                (("q", (2, 16)), ("k", (2, 16)), ("v", (3, 16)), ("g", (3,)), ("beta", (3,)))}
        ref = None
    else:
        glob, _, _, ref = delta_rule_problem(0, S, None, B=2, H=3, dk=16, dv=16, per_channel=False)

    def sh(t):
        return usp_hal.shard(t, layout="zigzag", mesh=mesh)
    import fla.ops.gated_delta_rule.naive  # noqa: F401  (imported before the clock starts, on both ranks)
    dist.barrier()
    t0 = time.monotonic()
    try:
        out = usp_fla.gated_delta_rule(*(sh(glob[n]) for n in ("q", "k", "v", "g", "beta")), mesh=mesh,
                                       layout="zigzag", kernel=kern, **kw)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}
    from tests.dist_state_passing import TOL, _worst
    return {"out": _worst(out, sh(ref.detach()), TOL["fp32"]) if ref is not None else float("nan")}
