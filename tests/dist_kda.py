"""KDA (Kimi delta attention: the gated delta rule with a decay per key channel) by state
passing (usp_hal.mixers.state_passing.gated_delta_rule with ``g [B, T, H, dk]``) on every rank of a
WorkerPool, against the float64 recurrence over the whole sequence, per document."""
from __future__ import annotations

from typing import Optional

import torch

import usp_hal
from tests.dist_cases import get_mesh
from tests.dist_state_passing import _docs_reference, _errors, _mutated
from usp_hal.mixers import state_passing as sp


def delta_rule_problem(seed: int, S: int, cu, B: int, H: int, dk: int, dv: int, per_channel: bool,
                       Hk: Optional[int] = None):
    """One delta-rule case: the global inputs (``g`` a decay per key channel with
    ``per_channel``, KDA's, else per head, the gated delta rule's), ``dout``, and the float64
    reference per document of ``cu`` backpropagated from ``dout``: (glob, dout, ref_in, ref).
    ``H`` value heads; ``Hk`` q/k heads (default ``H``; fewer: GVA, value head j reads q/k
    head j // (H / Hk) in the reference)."""
    gen = torch.Generator().manual_seed(seed)
    gshape = (B, S, H, dk) if per_channel else (B, S, H)
    Hk = H if Hk is None else Hk
    glob = {"q": torch.randn(B, S, Hk, dk, generator=gen),
            "k": torch.nn.functional.normalize(torch.randn(B, S, Hk, dk, generator=gen), dim=-1),
            "v": torch.randn(B, S, H, dv, generator=gen),
            "g": -torch.rand(*gshape, generator=gen) * 0.5,
            "beta": torch.rand(B, S, H, generator=gen)}
    dout = torch.randn(B, S, H, dv, generator=gen)
    ref_in = {n: t.double().requires_grad_() for n, t in glob.items()}
    ref = _docs_reference(lambda *xs: sp.delta_rule_reference(*xs)[0], cu, S,
                          *(ref_in[n] for n in ("q", "k", "v", "g", "beta")))
    ref.backward(dout.double())
    return glob, dout, ref_in, ref


def kda_case(U=1, R=2, layout="zigzag", S=26, dtype="fp64", cu=None, kernel="reference", mutation=None, seed=0):
    """{name: worst error / tolerance} of the output and the gradients of q, k, v, g, beta on
    this rank.  ``kernel``: "reference" (:func:`usp_hal.mixers.state_passing.delta_rule_reference`, in
    ``dtype``) or "transformers" (``chunk_kimi_delta_attention``, fp32 inside, chunks of 4)."""
    mesh = get_mesh(U, R)
    dt = {"fp64": torch.float64, "fp32": torch.float32}[dtype]
    glob, dout, ref_in, ref = delta_rule_problem(seed, S, cu, B=2, H=3, dk=4, dv=5, per_channel=True)

    def sh(t):
        return usp_hal.shard(t, layout=layout, mesh=mesh, cu_seqlens=cu)
    loc = {n: sh(t).to(dt).requires_grad_() for n, t in glob.items()}
    kern, extra = None, {}
    if kernel == "transformers":
        from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
        kern, extra = chunk_kimi_delta_attention, {"chunk_size": 4}
    undo = _mutated(mutation) if mutation else (lambda: None)
    try:
        out = sp.gated_delta_rule(loc["q"], loc["k"], loc["v"], loc["g"], loc["beta"], mesh=mesh, layout=layout,
                                  cu_seqlens=cu, kernel=kern, **extra)
        out.backward(sh(dout).to(dt))
    finally:
        undo()
    return _errors(out, ref, loc, ref_in, sh, dtype)
