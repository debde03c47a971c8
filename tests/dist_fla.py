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
             device="cpu", mutation=None, seed=0, kernel_kwargs=None):
    """{name: worst error / tolerance} of the output and the gradients of q, k, v, g, beta on
    this rank (fp32 tolerances: fla's kernels compute in fp32).  ``op``: "gdn" (``g [B, T, H]``)
    or "kda" (``g [B, T, H, dk]``).  ``device="cuda"``: the rank's tensors on cuda:0 (gloo
    stages them through host memory), for fla's Triton kernels."""
    from usp_hal.integrations import fla as usp_fla
    if device == "cuda":
        torch.cuda.set_device(0)
    mesh = get_mesh(U, R)
    glob, dout, ref_in, ref = delta_rule_problem(seed, S, cu, B=2, H=3, dk=16, dv=16, per_channel=op == "kda")

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
