"""Rank functions for hybrid models composed with the rest of usp-hal (tests/test_hybrid_compose.py):
the HF Trainer path (USPTrainer against the plain Trainer in one process) and data parallel x
sequence parallel (DDP over the dp dim of a DeviceMesh, against one process on both replicas'
batches), for a tiny ``nemotron_h`` (Mamba2 mixer: a depthwise conv and the SSD scan, beside
attention) built from its config."""
from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist

from tests.dist_dp_sp import _full, _wrap, one_process_steps
from tests.dist_trainer import RaggedRows, _common, _flat, _Losses, _reset_accelerate
from tests.hybrid_cases import VOCAB, tiny_hybrid


def trainer_run(model_type: str = "nemotron_h", U: int = 1, R: int = 2, steps: int = 3, bs: int = 2, S: int = 24,
                seed: int = 0, lr: float = 3e-3, layout: str = "zigzag", recurrence: str = "auto"):
    """``steps`` optimizer steps of USPTrainer (sp = U x R, dp = the rest of the pool's ranks) on a
    tiny hybrid; each rank's logged losses and grad norms, the wired layers' recurrence modes,
    and on rank 0 the final parameters."""
    from usp_hal.integrations import sequence_mixers as hybrid
    from usp_hal.integrations.training.trainer import USPTrainer, USPTrainingArguments

    dp = dist.get_world_size() // (U * R)
    model = tiny_hybrid(model_type, seed)
    data = RaggedRows(steps * bs * dp, S, seed, vocab=VOCAB)
    keep = _Losses.make()
    threads = torch.get_num_threads()      # accelerate's MULTI_CPU set-up may change it: the pool is shared
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = USPTrainingArguments(usp_ulysses_degree=U, usp_ring_degree=R, usp_layout=layout,
                                        usp_attn_type="sdpa", usp_recurrence=recurrence,
                                        per_device_train_batch_size=bs, **_common(tmp, steps, 1, lr, seed))
            trainer = USPTrainer(model=model, args=args, train_dataset=data, callbacks=[keep])
            trainer.train()
    finally:
        _reset_accelerate()
        torch.set_num_threads(threads)
    modes = sorted({m.__dict__[hybrid._WIRED][2] for m in model.modules() if hybrid._WIRED in m.__dict__})
    res = {"losses": keep.losses, "grad_norms": keep.grad_norms, "modes": modes, "dp": trainer.dp_size,
           "attn_after": model.config._attn_implementation}
    if dist.get_rank() == 0:
        res["params"] = _flat(model)
    return res


def trainer_reference(model_type: str = "nemotron_h", dp: int = 1, steps: int = 3, bs: int = 2, S: int = 24,
                      seed: int = 0, lr: float = 3e-3):
    """The plain Trainer in this process (no process group) on ``bs * dp`` rows per step."""
    from transformers import Trainer, TrainingArguments

    model = tiny_hybrid(model_type, seed)
    data = RaggedRows(steps * bs * dp, S, seed, vocab=VOCAB)
    keep = _Losses.make()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(per_device_train_batch_size=bs * dp, **_common(tmp, steps, 1, lr, seed))
            Trainer(model=model, args=args, train_dataset=data, callbacks=[keep]).train()
    finally:
        _reset_accelerate()
    return {"losses": keep.losses, "grad_norms": keep.grad_norms, "params": _flat(model),
            "start": _flat(tiny_hybrid(model_type, seed))}


# ----------------------------------------------------------------------------- dp x sp
_DM: dict = {}


def _ring_meshes():
    """A (2, 2) DeviceMesh ("dp", "ring") and the Ring-2 sequence-parallel mesh of its "ring"
    dim (built once per pool): Ring-2, so the recurrences run by state passing under "auto"."""
    if "dm" not in _DM:
        from torch.distributed.device_mesh import init_device_mesh

        import usp_hal
        dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ring"))
        _DM["dm"] = dm
        _DM["mesh"] = usp_hal.init_sequence_parallel(device_mesh=dm["ring"], set_default=False)
    return _DM["dm"], _DM["mesh"]


def dp_sp_training(model_type: str = "nemotron_h", runs=(("ddp", "auto"),), steps: int = 3, B: int = 2,
                   S: int = 24, seed: int = 0, lr: float = 2e-3):
    """dp 2 x Ring-2 on 4 ranks: each replica trains a tiny hybrid on its own batch, wrapped
    (``ddp``: DDP over the dp group; ``fsdp``: FSDP2's fully_shard over the dp sub-mesh), with
    ``sync_gradients`` summing over the sp ranks, for each ``(wrapper, recurrence)`` of ``runs``.
    Rank 0 compares with one process training on both batches at once (equal token counts):
    losses, the first step's gradients, the parameters after ``steps`` AdamW steps."""
    import copy

    from tests.integration_cases import _max_diff
    from usp_hal.integrations import sequence_mixers as hybrid
    from usp_hal.integrations import sync_gradients
    from usp_hal.integrations import transformers as usp

    dm, mesh = _ring_meshes()
    replica = dm.get_coordinate()[0]
    ref = tiny_hybrid(model_type, seed)
    ref.set_attn_implementation("sdpa")
    start = copy.deepcopy(ref)
    data = [torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed + 10 + i)) for i in range(2)]
    got = {}
    for wrapper, rec in runs:
        name = usp.register(f"usp_hal_hybrid_dp_sp_{rec}", mesh=mesh, layout="zigzag", attn_type="sdpa",
                            recurrence=rec, enable=True)
        model = copy.deepcopy(start)
        model.set_attn_implementation(name)
        wrapped = _wrap(model, wrapper, dm)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=lr)
        losses, grads = [], []
        for _ in range(steps):
            ids = data[replica]
            out = wrapped(**usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, "zigzag"))
            out.loss.backward()
            losses.append(float(sync_gradients(wrapped, mesh, out.loss)))
            if not grads:
                grads = [_full(p.grad).detach().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        modes = sorted({m.__dict__[hybrid._WIRED][2] for m in model.modules() if hybrid._WIRED in m.__dict__})
        got[f"{wrapper}-{rec}"] = dict(losses=losses, grads=grads, modes=modes,
                                       params=[_full(p).detach().clone() for p in model.parameters()])
    if dist.get_rank() != 0:
        return {k: {"losses": v["losses"], "modes": v["modes"]} for k, v in got.items()}
    ref_losses, ref_grads = one_process_steps(ref, torch.cat(data), steps, lr)
    res = {}
    for key, g in got.items():
        res[key] = dict(losses=g["losses"], modes=g["modes"], ref_losses=ref_losses,
                        loss_diff=max(abs(a - b) for a, b in zip(g["losses"], ref_losses)),
                        loss_change=ref_losses[0] - ref_losses[-1],
                        grad_rel=max(_max_diff(a, b) / (float(b.abs().max()) + 1e-12)
                                     for a, b in zip(g["grads"], ref_grads)),
                        param_diff=max(_max_diff(p, q) for p, q in zip(g["params"], ref.parameters())))
    return res
