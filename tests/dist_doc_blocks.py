"""The doc blocks that run on a pool's gloo ranks (tests/test_doc_blocks.py): each block's own
text, executed in a namespace that holds only what the block names without defining (a tiny
model, the inputs, a mesh the surrounding prose speaks of).  Every rank runs the same code."""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from tests.doc_blocks import code

VOCAB = 256


def _tiny_llama_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=128)


def _ids(n: int, seed: int = 0):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _global(*shape, seed: int = 0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------- preludes: what the prose supplies
def _head_parallel():
    import usp_hal
    from tests.dist_cases import get_mesh
    mesh = get_mesh(2, 1)
    B, S, H, G, D = 1, 24, 4, 2, 8
    full = {name: _global(B, S, G if name in "qk" else H, D, seed=i) for i, name in enumerate("qkv")}
    gates = {name: _global(B, S, H, seed=10 + i) for i, name in enumerate(("g", "beta"))}
    shard = {n: usp_hal.shard(t, layout="zigzag", mesh=mesh) for n, t in {**full, **gates}.items()}

    def fn(q, k, v, g, beta):       # a per-head operator over the whole sequence: a causal running sum
        return torch.cumsum(v * torch.sigmoid(beta)[..., None], dim=1) + g[..., None]
    return {"usp_hal": usp_hal, "torch": torch, "fn": fn, "mesh": mesh, **shard}


def _varlen():
    from tests.dist_cases import get_mesh
    mesh = get_mesh(1, 2)
    Q, K, V = (_global(1, 4096, 2, 16, seed=i) for i in range(3))
    return {"mesh": mesh, "Q": Q, "K": K, "V": V}


def _dynamic_degree():
    from transformers import AutoModelForCausalLM
    rows = [[300, 120, 70, 6], [250, 90, 12]]          # each rank's sequences (the block names its own)
    lengths = [n for row in rows for n in row]         # the gathered batch, in rank order
    seqs = [_ids(n, seed=i) for i, n in enumerate(lengths)]

    def batch_of(job):
        ids = torch.cat([seqs[i] for i in job.seqs], 1)
        return {"input_ids": ids, "labels": ids}
    torch.manual_seed(0)                               # the model the block builds: the same weights on every rank
    return {"AutoModelForCausalLM": AutoModelForCausalLM, "config": _tiny_llama_config(),
            "my_lengths": rows[dist.get_rank()], "batch_of": batch_of,
            "labels_in_the_global_batch": sum(n - 1 for n in lengths)}


def _fsdp():
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)                        # the same weights on every rank
    replica = dist.get_rank() // 2               # dp 2 x sp 2: ranks 0, 1 are replica 0
    return {"torch": torch, "AutoModelForCausalLM": AutoModelForCausalLM, "config": _tiny_llama_config(),
            "replica_loader": iter([_ids(48, seed=replica)])}


def _trainer():
    os.chdir(tempfile.mkdtemp(prefix="usp_doc_trainer_"))      # the script's output_dir="out"
    return {}


def _diffusers():
    from tests import diffusers_cases as dc
    pipe, _, _ = dc._flux_pipe()
    return {"pipe": pipe}


def _diffusers_training():
    from tests import diffusers_cases as dc
    transformer = dc.tiny_wan(0)
    inputs = dc.wan_inputs()
    target = _global(*inputs["hidden_states"].shape, seed=7)
    return {"torch": torch, "transformer": transformer, "latents": inputs["hidden_states"], "t": inputs["timestep"],
            "text": inputs["encoder_hidden_states"], "target": target,
            "opt": torch.optim.SGD(transformer.parameters(), lr=1e-3)}


def _tiled_loss():
    from transformers import AutoModelForCausalLM

    import usp_hal.integrations.transformers as usp
    mesh = usp.init_distributed(ulysses_degree=2, ring_degree=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_llama_config(), attn_implementation=usp.register(enable=True))
    return {"usp": usp, "mesh": mesh, "model": model, "ids": _ids(40)}


def _serving_cache():
    from usp_hal.sequence.positions import local_positions
    U = R = 2
    rank = dist.get_rank()
    ring_rank, ulysses_rank = divmod(rank, U)           # the mesh's default placement (Ulysses ranks adjacent)
    B, S, H, Hkv, D, n = 1, 24, 4, 2, 16, 2
    pos = local_positions("zigzag", S, R, U, ring_rank, ulysses_rank)
    prompt = [_global(B, S, h, D, seed=i, dtype=torch.bfloat16) for i, h in enumerate((H, Hkv, Hkv))]
    new = [_global(B, n, h, D, seed=10 + i, dtype=torch.bfloat16) for i, h in enumerate((H, Hkv, Hkv))]
    q, k, v = (t[:, pos] for t in prompt)
    return {"torch": torch, "L": 2, "B": B, "H": H, "Hkv": Hkv, "D": D, "dev": "cpu", "layer": 0,
            "q": q, "k": k, "v": v, "q_new": new[0], "k_new": new[1], "v_new": new[2]}


def _serving_generate():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    words = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}},
                                       unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", padding_side="left")
    torch.manual_seed(0)                        # the model the block builds: the same weights on every rank
    return {"AutoModelForCausalLM": AutoModelForCausalLM, "config": _tiny_llama_config(), "prompt": _ids(12),
            "tokenizer": tokenizer, "prompts": ["w5 w9 w11 w40", "w7 w3 w200 w17 w8 w9 w10"]}


PRELUDES = {
    "quickstart-transformers": dict, "quickstart-fsdp": _fsdp, "quickstart-trainer": _trainer,
    "quickstart-diffusers": _diffusers, "quickstart-diffusers-training": _diffusers_training,
    "quickstart-tiled-loss": _tiled_loss, "serving-cache": _serving_cache, "serving-generate": _serving_generate,
    "varlen": _varlen, "head-parallel": _head_parallel, "dynamic-degree": _dynamic_degree,
}


def _summary(ns: dict) -> dict:
    """The tensors a block leaves under these names (shape, all finite, sum), and its schedule."""
    out = {}
    for name in ("loss", "out", "full", "new_tokens"):
        value = ns.get(name)
        if isinstance(value, torch.Tensor):
            out[name] = {"shape": list(value.shape), "finite": bool(torch.isfinite(value.float()).all()),
                         "sum": float(value.float().sum())}
    if "sched" in ns:
        out["sched"] = repr(ns["sched"])
    return out


def run_blocks(block_ids) -> dict:
    """The blocks' own text, one after another in one namespace, after their preludes."""
    ns: dict = {"__name__": "__doc_block__"}
    for block_id in block_ids:
        ns.update(PRELUDES.get(block_id, dict)())
        exec(compile(code(block_id), f"<doc block {block_id}>", "exec"), ns)
    return _summary(ns)
