"""torchtitan 0.3.0 with usp-hal as its attention (usp_hal.integrations.torchtitan.apply_usp):
torchtitan's own Llama3 definition, initialiser, TP (``Module.parallelize``) and FSDP2
(``apply_fsdp_to_decoder``), on 4 gloo ranks as dp_shard 2 x sp 2 and tp 2 x sp 2, 3 AdamW steps
against the same model unmodified in one process (loss, grad norm, params).  The negative
control leaves torchtitan's attention on each rank's tokens.  Also what apply_usp refuses, and
why torchtitan's trainer itself cannot start on a CPU-only machine."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")
# its parallelize code imports torchtitan.distributed.minimal_async_ep.kernels, which imports triton
pytest.importorskip("triton")

from tests import dist_torchtitan  # noqa: E402

pytestmark = [pytest.mark.models, pytest.mark.optional_pkg]

LOSS_TOL = 1e-5
NORM_TOL = 1e-5       # relative
PARAM_TOL = 1e-4

CASES = {"dp_shard2_sp2": dict(dp_shard=2, tp=1, cp=2), "tp2_sp2": dict(dp_shard=1, tp=2, cp=2)}


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(CASES))
def test_torchtitan_llama_matches_one_process(pools, case):
    kw = CASES[case]
    res = pools(4).run(dist_torchtitan.titan_train, timeout=300, **kw)
    r0 = res[0]
    assert all(r["losses"] == r0["losses"] for r in res), [r["losses"] for r in res]
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], r0["ref_losses"]))
    norm_diff = max(abs(a - b) / b for a, b in zip(r0["norms"], r0["ref_norms"]))
    assert loss_diff <= LOSS_TOL, (r0["losses"], r0["ref_losses"])
    assert norm_diff <= NORM_TOL, (r0["norms"], r0["ref_norms"])
    assert r0["param_diff"] <= PARAM_TOL, r0["param_diff"]
    assert r0["moved"] > 20 * PARAM_TOL, r0["moved"]          # it trained: the comparison is not trivial
    print(f"{case}: loss diff {loss_diff:.1e}, grad-norm rel diff {norm_diff:.1e}, param diff {r0['param_diff']:.1e}")
    # every layer's attention went through usp-hal on every step, with the heads TP left this rank
    layers = dist_torchtitan.LAYERS
    assert all(r["layers"] == layers and r["usp_calls"] == 3 * layers for r in res), res
    assert all(r["heads_seen"] == [dist_torchtitan.HEADS // kw["tp"]] for r in res), [r["heads_seen"] for r in res]
    assert all(r["param_kinds"] == ["DTensor"] for r in res)    # FSDP2 (and TP) sharded every parameter


@pytest.mark.multirank
def test_torchtitan_attention_left_local_differs(pools):
    res = pools(4).run(dist_torchtitan.titan_train, timeout=300, use_usp=False, **CASES["dp_shard2_sp2"])
    r0 = res[0]
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], r0["ref_losses"]))
    assert loss_diff > 100 * LOSS_TOL and r0["param_diff"] > 10 * PARAM_TOL, (loss_diff, r0["param_diff"])


def _llama():
    return dist_torchtitan.build(0)


def test_apply_usp_refuses_layers_by_name():
    from torchtitan.models.common.attention import VarlenAttention

    from usp_hal.integrations.torchtitan import apply_usp
    from usp_hal.parallel.mesh import SequenceParallelMesh
    model = _llama()
    model.layers["1"].attention.inner_attention = VarlenAttention(VarlenAttention.Config())
    with pytest.raises(NotImplementedError, match=r"layers\.1: VarlenAttention"):
        apply_usp(model, SequenceParallelMesh(1, 1, 0, 1, True, (0,), (0,), (0,)))
    assert "forward" not in vars(model.layers["0"].attention.inner_attention)     # nothing was replaced


def test_apply_usp_refuses_masks_and_missing_positions():
    from usp_hal.integrations.torchtitan import apply_usp
    from usp_hal.parallel.mesh import SequenceParallelMesh
    model = _llama()
    assert apply_usp(model, SequenceParallelMesh(1, 1, 0, 1, True, (0,), (0,), (0,))) == dist_torchtitan.LAYERS
    ids = torch.randint(0, dist_torchtitan.V, (1, 8))
    with pytest.raises(NotImplementedError, match="call the model with attention_masks=None"):
        model(ids, attention_masks=object())
    two = _llama()
    apply_usp(two, SequenceParallelMesh(1, 2, 0, 1, True, (0, 1), (0,), (0, 1)))   # sp 2: positions needed
    with pytest.raises(ValueError, match="without positions="):
        two(ids)


def test_torchtitan_trainer_cannot_start_without_cuda():
    """torchtitan/tools/utils.py: ``device_type = _get_available_device_type() or "cuda"``; the
    Trainer then calls ``device_module.set_device(self.device)`` (trainer.py, before building
    its meshes), and torch.cuda.set_device fails on a CPU-only torch.  This is why the tests
    drive torchtitan's model and parallelize functions directly."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: torchtitan's trainer picks cuda there")
    from torchtitan.tools import utils
    assert utils.device_type == "cuda" and utils.device_module is torch.cuda
    with pytest.raises((AttributeError, RuntimeError), match="_cuda_setDevice|Torch not compiled with CUDA"):
        utils.device_module.set_device(torch.device("cuda", 0))


@pytest.mark.multirank
def test_torchtitan_gptoss_attention_with_sinks_matches_one_process(pools):
    """torchtitan's gpt-oss attention (sinks, a sliding-window layer and a full one, GQA) through
    apply_usp on Ulysses 2 x Ring 2, float64: output, input gradient and every parameter's
    gradient (sinks included) against one process."""
    res = pools(4).run(dist_torchtitan.gptoss_case, timeout=300, U=2, R=2)
    r0 = res[0]
    assert all(r["layers"] == 2 for r in res)
    assert r0["math_vs_flex"] < 1e-12, r0          # the reference's forward is torchtitan's flex one
    assert max(r0["out"], r0["dx"], r0["dparams"], r0["dsinks"]) < 1e-10, r0
    assert r0["sinks_grad_size"] > 1e-3, r0        # the sinks take part


def test_apply_usp_refuses_an_unknown_out_transform():
    from usp_hal.integrations.torchtitan import apply_usp
    from usp_hal.parallel.mesh import SequenceParallelMesh
    model = _llama()
    apply_usp(model, SequenceParallelMesh(1, 1, 0, 1, True, (0,), (0,), (0,)))
    q = torch.randn(1, 4, dist_torchtitan.HEADS, 16)
    inner = model.layers["0"].attention.inner_attention
    with pytest.raises(NotImplementedError, match="gradient of the lse"):
        inner(q, q, q, out_transform=lambda out, lse: out)


# ----------------------------------------------------------------------------- packed documents
PACKED = {"u2": dict(dp_shard=1, cp=2, ring=False, layout="zigzag"),
          "r2": dict(dp_shard=1, cp=2, ring=True, layout="varlen_zigzag"),
          "dp2_r2": dict(dp_shard=2, cp=2, ring=True, layout="varlen_zigzag")}


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(PACKED))
def test_torchtitan_packed_documents_match_one_process(pools, case):
    """torchtitan's packed documents (per-document positions, as its text dataloader makes
    them; each row its own documents, a one-token one among them) through prepare_inputs and
    apply_usp, FSDP2 over dp_shard x cp: 3 AdamW steps against the same model in one process
    running every document alone: loss, grad norm, params.  That reference is what
    torchtitan's own document masks compute (its FlexAttention with get_attention_masks,
    forward, checked on rank 0)."""
    kw = PACKED[case]
    res = pools(kw["dp_shard"] * kw["cp"]).run(dist_torchtitan.titan_train_packed, timeout=300, **kw)
    r0 = res[0]
    assert all(r["losses"] == r0["losses"] for r in res), [r["losses"] for r in res]
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], r0["ref_losses"]))
    norm_diff = max(abs(a - b) / b for a, b in zip(r0["norms"], r0["ref_norms"]))
    assert loss_diff <= LOSS_TOL, (r0["losses"], r0["ref_losses"])
    assert norm_diff <= NORM_TOL, (r0["norms"], r0["ref_norms"])
    assert r0["param_diff"] <= PARAM_TOL, r0["param_diff"]
    assert r0["moved"] > 20 * PARAM_TOL, r0["moved"]
    assert r0["titan_masks"] < 1e-5, r0["titan_masks"]          # torchtitan's document masks = documents alone
    print(f"{case}: loss diff {loss_diff:.1e}, grad-norm rel diff {norm_diff:.1e}, param diff {r0['param_diff']:.1e}")
    # the rows were packed into one stream of documents, and every attention call was told them
    assert all(r["local_shape"][0] == 1 and r["documents"] >= 6 for r in res), res
    assert sum(r["local_shape"][1] for r in res) == kw["dp_shard"] * 2 * 24, res
    assert all(r["cu_passed"] and r["usp_calls"] == 3 * dist_torchtitan.LAYERS for r in res), res


@pytest.mark.multirank
def test_torchtitan_packed_documents_ignored_differs(pools):
    """The attention not told the documents (zigzag keeps the lengths of the sharded stream)."""
    res = pools(2).run(dist_torchtitan.titan_train_packed, timeout=300, mutation="ignore_documents",
                       **{**PACKED["r2"], "layout": "zigzag"})
    r0 = res[0]
    loss_diff = max(abs(a - b) for a, b in zip(r0["losses"], r0["ref_losses"]))
    assert loss_diff > 100 * LOSS_TOL and r0["param_diff"] > 10 * PARAM_TOL, (loss_diff, r0["param_diff"])


REFUSALS = {
    # case: what every rank's error says
    "basic_layout": ["rank(s) [0, 1] passed other positions than the 'zigzag' layout", "prepare_inputs"],
    "one_rank_without_positions": ["rank 1", "without positions="],
    "titan_varlen_metadata": ["attention_masks=VarlenMetadata", "prepare_inputs", "attention_masks=None"],
    "titan_block_mask": ["attention_masks=BlockMask", "prepare_inputs"],
    "different_batches": ["passed different batches to prepare_inputs"],
    "not_per_document_positions": ["not per-document positions at index 5"],
    "documents_other_layout": ["not the 'varlen_zigzag' layout's", "prepare_inputs"],
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(REFUSALS))
def test_apply_usp_refuses_on_every_rank_in_seconds(pools, case):
    """Tokens and positions sharded with another layout than apply_usp's (usp_hal.shard's
    default ``basic`` against apply_usp's ``zigzag``: before, an output 0.43 off with no error),
    one rank without positions, torchtitan's own masks, different batches on the ranks of a
    group, positions that are not per-document: every rank raises the same error before any
    block runs (FSDP2 included), in seconds."""
    res = pools(2).run(dist_torchtitan.titan_refusal, timeout=120, case=case)
    assert all("error" in r for r in res), res
    assert res[0]["message"] == res[1]["message"] and res[0]["error"] == res[1]["error"], res
    assert all(r["seconds"] < 20 for r in res), [r["seconds"] for r in res]
    for needle in REFUSALS[case]:
        assert needle in res[0]["message"], (needle, res[0]["message"])


def test_prepare_inputs_packs_rows_into_documents():
    """One process (a 1 x 1 mesh): the boundaries come from torchtitan's per-document
    positions, the rows become one stream, every row starting a document."""
    from usp_hal.integrations.torchtitan import ShardedBatch, apply_usp, prepare_inputs
    from usp_hal.parallel.mesh import SequenceParallelMesh
    model = _llama()
    apply_usp(model, SequenceParallelMesh(1, 1, 0, 1, True, (0,), (0,), (0,)), layout="varlen_zigzag")
    ids, labels, positions = dist_torchtitan.packed_batches(1, 2, 10, 3)[0]
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    tok, lab, extra = prepare_inputs(model, ids, labels, positions)
    batch = extra["attention_masks"]
    assert isinstance(batch, ShardedBatch) and batch.layout == "varlen_zigzag" and batch.seqlen == 20
    assert batch.cu_seqlens == (0, 3, 5, 9, 10, 16, 20) and batch.problem is None
    assert torch.equal(tok, ids.reshape(1, 20)) and torch.equal(lab, labels.reshape(1, 20))
    assert torch.equal(extra["positions"], positions.reshape(1, 20))
    assert model(tok, **extra).shape == (1, 20, dist_torchtitan.V)
    # one sequence per row: rows kept, no documents
    tok, _, extra = prepare_inputs(model, ids, labels, torch.arange(10))
    assert tok.shape == (2, 10) and extra["attention_masks"].cu_seqlens is None
    bad = prepare_inputs(model, ids, labels, positions + 1)[2]["attention_masks"]
    assert "start at 1" in bad.problem
    with pytest.raises(ValueError, match="prepare_inputs refused this batch"):
        model(tok, positions=extra["positions"], attention_masks=bad)
    with pytest.raises(TypeError, match="apply_usp"):
        prepare_inputs(_llama(), ids)
