"""Rank-side function for tests/test_hybrid_compile.py: a tiny hybrid model under
torch.compile with attn_implementation="usp_hal", against the same model eager in one process."""
from __future__ import annotations

import copy

import torch

from tests.dist_cases import get_mesh
from tests.hybrid_cases import VOCAB, tiny_hybrid


def compiled_hybrid(model_type="qwen3_next", U=1, R=2, backend="aot_eager", recurrence="auto", B=2, S=40):
    """Logits, loss and every gradient of ``torch.compile(model)`` (one forward+backward),
    against one process; the modes the hybrid layers ran in."""
    import usp_hal
    from usp_hal.integrations import sequence_mixers as hybrid
    from usp_hal.integrations import transformers as usp

    torch._dynamo.reset()
    mesh = get_mesh(U, R)
    ref = tiny_hybrid(model_type, 0)
    ref.set_attn_implementation("sdpa")
    model = copy.deepcopy(ref)
    name = usp.register(f"usp_hal_compiled_u{U}r{R}_{recurrence}", mesh=mesh, layout="zigzag", attn_type="sdpa",
                        recurrence=recurrence, enable=True)
    model.set_attn_implementation(name)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    batch = usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, "zigzag")
    out = torch.compile(model, backend=backend)(**batch)
    out.loss.backward()
    loss = float(usp.sync_gradients(model, mesh, out.loss))
    logits = usp_hal.unshard(out.logits.detach(), layout="zigzag", mesh=mesh)
    modes = sorted({m.__dict__[hybrid._WIRED][2] for m in model.modules() if hybrid._WIRED in m.__dict__})
    r = ref(input_ids=ids, labels=ids)
    r.loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    got = dict(model.named_parameters())
    rel = max(float((got[n].grad - g).abs().max()) / (float(g.abs().max()) + 1e-12) for n, g in grads.items())
    return {"logits": float((logits - r.logits.detach()).abs().max()), "loss": abs(loss - float(r.loss)),
            "grad_rel": rel, "modes": modes}

