"""usp_hal.integrations.transformers on real gloo ranks: a tiny GQA Llama (hidden 128, 4 layers,
8 heads, 2 KV heads) from a config, sequence-parallel vs single-process in the same worker:
logits, 20 AdamW steps, refusals on every rank, and the runnable example."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests import integration_cases as cases  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.models]
ROOT = Path(__file__).resolve().parents[1]

LOGITS_TOL = 1e-5
LOSS_TOL = 1e-4

# (world, ulysses, ring, layout)
SPLITS = [(2, 2, 1, "zigzag"), (2, 1, 2, "zigzag"), (4, 2, 2, "zigzag")]


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"w{s[0]}-u{s[1]}r{s[2]}-{s[3]}")
def test_llama_logits_and_20_adamw_steps_match_single_process(pools, split):
    world, U, R, layout = split
    res = pools(world).run(cases.llama_training, timeout=240, U=U, R=R, layout=layout, steps=20, S=50)
    r0 = res[0]
    assert r0["logits_diff"] <= LOGITS_TOL, r0
    assert r0["loss_diff"] <= LOSS_TOL, r0
    # the comparison is not trivial: the model learned (the loss fell by a lot)
    assert r0["loss_change"] > 1.0, r0
    # every rank reports the same global loss
    for r in res[1:]:
        assert r["losses"] == r0["losses"]


@pytest.mark.parametrize("U,R", [(2, 1), (1, 2)])
def test_register_low_memory_trains_like_one_process(pools, U, R):
    """register(..., low_memory=True): the module the integration builds is low_memory, and
    20 AdamW steps match one process as the default module's do."""
    res = pools(2).run(cases.llama_training, timeout=240, U=U, R=R, layout="zigzag", steps=20, S=50, low_memory=True)
    r0 = res[0]
    assert all(r["module_low_memory"] != 0 for r in res), res
    assert r0["logits_diff"] <= LOGITS_TOL, r0
    assert r0["loss_diff"] <= LOSS_TOL, r0
    assert r0["loss_change"] > 1.0, r0


def test_register_refuses_a_bad_low_memory_value():
    from usp_hal.integrations import transformers as usp
    with pytest.raises(ValueError, match="low_memory"):
        usp.register("usp_hal_test_bad_low", low_memory="yes")


def test_llama_with_activation_checkpointing(pools):
    r = pools(2).run(cases.llama_checkpointing, timeout=120, U=1, R=2)[0]
    assert r["checkpointing"], r
    assert r["loss_diff"] <= LOSS_TOL, r
    assert r["grad_diff"] <= LOGITS_TOL, r


def test_labels_shifted_before_sharding_negative_control(pools):
    """shard_batch's loss equals single-process; shifting inside each shard (labels sharded
    first) does not: the loss comparison can fail."""
    for r in pools(2).run(cases.llama_label_control, timeout=120, U=1, R=2):
        assert r["right_diff"] <= LOSS_TOL, r
        assert r["wrong_diff"] > 100 * LOSS_TOL, r
        assert r["right_padding_diff"] <= LOSS_TOL, r


EXPECTED_REFUSALS = {
    "no_position_ids": "position_ids",
    "padding_mask_one_rank": "padding mask",
    "mask_4d": "4-D attention mask",
    "shard_batch_padding": "0 (padding) and 1 (token) only",
    "layout_mismatch": "'zigzag' layout",
    "different_batches": "different batches",
    "kv_cache": "generation is not supported yet",
    "attentions": "output_attentions",
    "unknown_attn_type": "no_such_kernel",
    "dropout": "dropout",
    "packed_disagree": "boundaries disagree",
    "packed_half": "only one of cu_seq_lens_q",
    "packed_without_boundaries": "pass their boundaries to shard_batch",
}


@pytest.mark.parametrize("split", [(1, 2), (2, 1)], ids=["u1r2", "u2r1"])
def test_refusals_on_every_rank(pools, split):
    U, R = split
    res = pools(2).run(cases.llama_refusals, timeout=120, U=U, R=R)
    expected = dict(EXPECTED_REFUSALS)
    if R == 1:      # with one ring rank every layout is the same contiguous split
        expected.pop("layout_mismatch")
    for rank, r in enumerate(res):
        if R == 1:
            assert r["layout_mismatch"] is None, r["layout_mismatch"]
        for case, needle in expected.items():
            assert r[case] is not None, f"rank {rank}: {case} was not refused"
            assert needle in r[case], f"rank {rank}: {case}: {r[case]}"
        assert r["ones_mask_ok"] is None, r["ones_mask_ok"]       # an all-ones mask is harmless
        assert r["packed_ok"] is None, r["packed_ok"]             # the same packed batch, complete
        assert r["after_refusals_diff"] <= LOGITS_TOL, r        # the group still works
    # the padding sat on rank 1 only, yet rank 0 raised too, naming rank 1
    assert "rank 1" in res[0]["padding_mask_one_rank"]


@pytest.mark.parametrize("split", [(2, 1, "zigzag"), (1, 2, "zigzag"), (1, 2, "basic")],
                         ids=["u2", "r2-zigzag", "r2-basic"])
def test_mistral_sliding_window(pools, split):
    U, R, layout = split
    r = pools(2).run(cases.mistral_window, timeout=120, U=U, R=R, layout=layout, S=40, window=8)[0]
    assert r["logits_diff"] <= LOGITS_TOL, r
    assert r["loss_diff"] <= LOSS_TOL, r
    assert r["grad_diff"] <= LOGITS_TOL, r
    assert r["window_effect"] > 1e-2, r          # the window changes the result: it was applied


def test_data_parallel_replicas_of_a_sequence_parallel_group(pools):
    res = pools(4).run(cases.llama_dp_training, timeout=240, U=2, R=1, steps=5)
    r0 = res[0]
    assert r0["loss_diff"] <= LOSS_TOL, r0
    for r in res[1:]:
        assert r["losses"] == r0["losses"]


# ----------------------------------------------------------------------------- the example
def test_example_adds_at_most_five_lines():
    added = cases.added_lines("llama_single.py", "llama_sp.py")
    assert len(added) <= 5, added
    assert all("# usp-hal" in ln for ln in added), added


def test_example_matches_single_process_example(pools):
    r = pools(2).run(cases.example_pair, timeout=240, sp="llama_sp", single="llama_single")[0]
    assert r["max_diff"] <= LOSS_TOL, r
    assert r["first"] - r["last"] > 1.0, r


# ----------------------------------------------------------------------------- single process
def test_import_usp_hal_loads_no_framework():
    code = ("import sys, usp_hal, usp_hal.integrations\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'diffusers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_mask_function_reports_what_transformers_asks_for():
    import torch
    from transformers import masking_utils as mu

    from usp_hal.integrations.transformers import MaskInfo, usp_mask

    assert usp_mask(mask_function=mu.causal_mask_function) == MaskInfo(causal=True)
    assert usp_mask(mask_function=mu.bidirectional_mask_function) == MaskInfo(causal=False)
    assert usp_mask(mask_function=mu.sliding_window_causal_mask_function(8)) == MaskInfo(sliding_window=8)
    pos = torch.tensor([[0, 1, 2, 9, 10, 11]])
    packed = mu.packed_sequence_compatibility_function(mu.causal_mask_function, pos, torch.zeros_like(pos))
    assert usp_mask(mask_function=packed) == MaskInfo(causal=True)    # sharded positions look "packed"
    assert usp_mask(mask_function=mu.causal_mask_function, attention_mask=torch.ones(2, 6, dtype=torch.bool)) == \
        MaskInfo(causal=True)
    refused = {
        "padding": usp_mask(mask_function=mu.causal_mask_function,
                            attention_mask=torch.tensor([[True, True, False]])),
        "union": usp_mask(mask_function=mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function)),
        "chunked": usp_mask(mask_function=mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))),
        "vmap overlay": usp_mask(mask_function=mu.causal_mask_function, use_vmap=True),
        "bidirectional window": usp_mask(mask_function=mu.sliding_window_bidirectional_mask_function(4)),
        "unknown": usp_mask(mask_function=lambda b, h, q, k: q >= k),
    }
    for what, info in refused.items():
        assert info.refused, what


def test_example_runs_with_the_spawn_helper():
    """python examples/spawn.py examples/llama_sp.py: 2 CPU ranks, losses equal on both."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "examples/spawn.py", "examples/llama_sp.py"], capture_output=True,
                         text=True, timeout=240, cwd=str(ROOT), env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    last = re.findall(r"step 19  loss (\d+\.\d{6})", out.stdout)     # one line per rank (maybe interleaved)
    assert len(last) == 2 and last[0] == last[1], out.stdout[-2000:]


PACKED = [(2, 2, 1, "zigzag", "cu_seqlens"), (2, 1, 2, "varlen_zigzag", "collator"),
          (2, 1, 2, "zigzag", "position_ids")]


@pytest.mark.parametrize("case", PACKED, ids=lambda c: f"w{c[0]}-u{c[1]}r{c[2]}-{c[3]}-{c[4]}")
def test_packed_documents_match_each_document_alone(pools, case):
    """Packed sequences through shard_batch (boundaries from cu_seqlens, the flattening
    collator's cu_seq_lens_q/k, or restarting position_ids): logits, loss and gradients equal
    each document run alone in one process; no label crosses a document boundary."""
    world, U, R, layout, source = case
    res = pools(world).run(cases.llama_packed, timeout=240, U=U, R=R, layout=layout, source=source)
    r0 = res[0]
    assert r0["num_items"] == r0["total"], r0
    assert r0["logits_diff"] <= LOGITS_TOL, r0
    assert r0["loss_diff"] <= LOSS_TOL, r0
    assert r0["grad_diff"] <= LOGITS_TOL and r0["grad_scale"] > 0, r0
    for r in res[1:]:
        assert r["loss"] == r0["loss"]
