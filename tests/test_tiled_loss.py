"""The tiled causal-LM loss (usp_hal.integrations.training.tiled_loss): the same loss and gradients as the
model's own loss, in float64, for any tile size; calls without labels or gradients untouched;
a model that transforms its logits or has another loss refused by name; and sequence-parallel
training with it matching one process (also through the Trainer: tests/test_trainer.py)."""
import copy

import pytest
import torch

pytest.importorskip("transformers")

from tests import integration_cases as cases  # noqa: E402
from usp_hal.integrations.training.tiled_loss import (  # noqa: E402
    TiledLogits,
    TiledLossError,
    disable_tiled_loss,
    enable_tiled_loss,
)

pytestmark = pytest.mark.models


def _tiny_llama(tie: bool):
    return cases.tiny_llama(0, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=96, tie_word_embeddings=tie).double()


def _loss_and_grads(model, **kw):
    model.zero_grad(set_to_none=True)
    out = model(**kw)
    out.loss.backward()
    return out, out.loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tie,chunk,counted", [
    (False, 1, "mean"), (False, 7, "mean"), (False, 100, "mean"), (True, 7, "mean"),
    (False, 7, "num_items_in_batch"), (True, 1, "num_items_in_batch"), (False, 7, "shift_labels"),
    (True, 100, "shift_labels")])
def test_tiled_loss_matches_the_models_own(tie, chunk, counted):
    """Loss and every parameter gradient against the untiled loss (float64 model; transformers'
    loss upcasts the logits to float32, so the loss agrees to float32 rounding and the gradients
    to float64's), with ignored labels, for tiles of 1 token, of sizes that do not divide the 37
    tokens, and of more than them."""
    model = _tiny_llama(tie)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cases.VOCAB, (2, 37), generator=g)
    labels = ids.clone()
    labels[0, :6] = -100
    labels[1, 20:23] = -100
    kw = {"input_ids": ids, "labels": labels}
    if counted == "num_items_in_batch":
        kw["num_items_in_batch"] = torch.tensor(61)
    elif counted == "shift_labels":      # already shifted labels (what shard_batch passes): no further shift
        kw["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    _, ref_loss, ref = _loss_and_grads(model, **kw)
    enable_tiled_loss(model, chunk)
    out, loss, got = _loss_and_grads(model, **kw)
    assert isinstance(out.logits, TiledLogits) and model._usp_tiled_loss.calls == 1
    assert abs(float(loss - ref_loss)) <= 2e-6 * float(ref_loss), (float(loss), float(ref_loss))
    for n, r in ref.items():
        assert float((got[n] - r).abs().max()) <= 1e-6 * float(r.abs().max()), n


def test_under_bf16_autocast_the_tiles_recompute_in_bf16():
    """Under torch.autocast(bfloat16), as the Trainer's bf16=True runs it: each tile's head runs
    in bf16 in the forward and again in the backward's recompute, so the loss is the untiled
    one and the gradients agree within bf16 rounding (the lm_head gradient is summed over tiles
    in float32 instead of inside one bf16 matmul)."""
    model = cases.tiny_llama(0)
    ids = torch.randint(0, cases.VOCAB, (2, 64), generator=torch.Generator().manual_seed(8))

    def run():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_loss, ref = run()
    enable_tiled_loss(model, 10)
    loss, got = run()
    assert model._usp_tiled_loss.calls == 1
    assert abs(float(loss - ref_loss)) <= 1e-5 * float(ref_loss)
    for n, r in ref.items():
        assert float((got[n] - r).abs().max()) <= 2e-2 * float(r.abs().max()), n


def test_each_tile_calls_the_head_module_with_its_hooks():
    """The tiles call the output head as a module, so its hooks run (an FSDP unit gathers its
    parameters in one): once for the model's own call (which gets the stand-in), then once per
    tile in the forward and once per tile in the backward's recompute."""
    model = _tiny_llama(False)
    seen = []
    model.lm_head.register_forward_pre_hook(lambda mod, args: seen.append(tuple(args[0].shape)))
    ids = torch.randint(0, cases.VOCAB, (1, 37), generator=torch.Generator().manual_seed(9))
    enable_tiled_loss(model, 10)
    out = model(input_ids=ids, labels=ids)
    assert seen == [(1, 37, 64), (1, 10, 64), (1, 10, 64), (1, 10, 64), (1, 7, 64)], seen
    out.loss.backward()
    assert sorted(seen[5:]) == sorted(seen[1:5]), seen


def test_calls_without_labels_or_gradients_are_untouched():
    model = _tiny_llama(False)
    ids = torch.randint(0, cases.VOCAB, (1, 19), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids)
    enable_tiled_loss(model, 4)
    with torch.no_grad():
        got = model(input_ids=ids, labels=ids)           # evaluation: real logits, the model's loss
        plain = model(input_ids=ids)                       # no labels: real logits
    assert torch.equal(got.logits, ref.logits) and torch.equal(plain.logits, ref.logits)
    assert torch.equal(got.loss, ref.loss)
    out = model(input_ids=ids)                             # gradients on, no labels: no loss, real logits
    assert torch.equal(out.logits.detach(), ref.logits) and out.loss is None
    assert model._usp_tiled_loss.calls == 0


def test_the_stand_in_logits_refuse_every_use_by_name():
    model = _tiny_llama(False)
    ids = torch.randint(0, cases.VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    enable_tiled_loss(model, 4)
    logits = model(input_ids=ids, labels=ids).logits
    for use in (lambda x: x.float(), lambda x: x * 2.0, lambda x: torch.tanh(x), lambda x: x[:, -1],
                lambda x: x.shape):
        with pytest.raises(TiledLossError, match="LlamaForCausalLM uses its logits"):
            use(logits)
    assert not hasattr(logits, "detach")                   # introspection sees no tensor method


def test_opt_which_makes_its_logits_contiguous_is_served():
    """OPT's forward calls ``logits.contiguous()`` between its head and its loss (refused on
    5edbecd): loss and gradients equal its own loss's, float64."""
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=cases.VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                     num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                     dropout=0.0, attention_dropout=0.0)).double()
    ids = torch.randint(0, cases.VOCAB, (2, 23), generator=torch.Generator().manual_seed(7))
    _, ref_loss, ref = _loss_and_grads(model, input_ids=ids, labels=ids)
    enable_tiled_loss(model, 5)
    _, loss, got = _loss_and_grads(model, input_ids=ids, labels=ids)
    assert model._usp_tiled_loss.calls == 1
    assert abs(float(loss - ref_loss)) <= 2e-6 * float(ref_loss), (float(loss), float(ref_loss))
    for n, r in ref.items():
        assert float((got[n] - r).abs().max()) <= 1e-6 * float(r.abs().max()), n


def test_a_model_that_transforms_its_logits_is_refused_by_name():
    """Gemma2 soft-caps its logits between the head and the loss: training it with the tiled
    loss would skip the cap, so its forward raises, naming the model and the operation."""
    model = cases.tiny_gemma2(0)
    assert model.config.final_logit_softcapping
    ids = torch.randint(0, cases.VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    enable_tiled_loss(model, 4)
    with pytest.raises(TiledLossError, match="Gemma2ForCausalLM uses its logits.*__truediv__"):
        model(input_ids=ids, labels=ids)
    with torch.no_grad():                                  # untouched without gradients
        assert model(input_ids=ids, labels=ids).logits.shape[-1] == model.config.vocab_size


def test_another_loss_or_no_head_is_refused_at_enable():
    model = _tiny_llama(False)
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    with pytest.raises(TypeError, match="LlamaForCausalLM's loss_function is '<lambda>'.*ForCausalLMLoss"):
        enable_tiled_loss(model)
    with pytest.raises(TypeError, match="no output head"):
        enable_tiled_loss(model.model)
    with pytest.raises(ValueError, match="chunk_tokens"):
        enable_tiled_loss(_tiny_llama(False), 0)


def test_the_trainer_argument_is_checked_when_made():
    pytest.importorskip("accelerate")
    from usp_hal.integrations.training.trainer import USPTrainingArguments
    for bad in (-1, True, "5"):
        with pytest.raises(ValueError, match="usp_tiled_loss"):
            USPTrainingArguments(output_dir="unused", report_to=[], use_cpu=True, usp_tiled_loss=bad)
    assert USPTrainingArguments(output_dir="unused", report_to=[], use_cpu=True, usp_tiled_loss=0).usp_tiled_loss == 0


def test_disable_restores_the_model():
    model = _tiny_llama(False)
    before = copy.deepcopy(model)
    ids = torch.randint(0, cases.VOCAB, (1, 11), generator=torch.Generator().manual_seed(7))
    enable_tiled_loss(model, 3)
    enable_tiled_loss(model, 5)                            # again: only the tile size changes
    assert model._usp_tiled_loss.chunk == 5
    disable_tiled_loss(model)
    assert "forward" not in vars(model.lm_head) and "_loss_function" not in vars(model)
    out = model(input_ids=ids, labels=ids)
    assert torch.equal(out.logits, before(input_ids=ids, labels=ids).logits)
    disable_tiled_loss(model)                              # a no-op now


@pytest.mark.multirank
@pytest.mark.parametrize("U,R", [(2, 1), (1, 2)])
def test_sequence_parallel_training_with_the_tiled_loss_matches_one_process(pools, U, R):
    """20 AdamW steps, each rank's loss in tiles of 7 of its 25 tokens, against one process with
    the model's own loss: the same bounds as the untiled integration test."""
    from tests.test_integration_transformers import LOSS_TOL
    res = pools(2).run(cases.llama_training, timeout=240, U=U, R=R, layout="zigzag", steps=20, S=50, tiled_loss=7)
    r0 = res[0]
    assert all(r["tiled"] for r in res), res
    assert r0["loss_diff"] <= LOSS_TOL, r0
    assert r0["loss_change"] > 1.0, r0


@pytest.mark.multirank
def test_fsdp2_dp2_sp2_with_the_tiled_loss_matches_one_process(pools, wrapper="fsdp"):
    """dp 2 (FSDP2 units per layer and the root; DDP is covered by the Trainer case) x
    Ulysses-2, 4 AdamW steps, each rank's loss in tiles of 5 of its 12 tokens: loss, first-step
    gradients and parameters against one process with the model's own loss, under the bounds of
    the untiled dp x sp test."""
    from tests import dist_dp_sp
    from tests.test_dp_sp import GRAD_TOL, LOSS_TOL, PARAM_TOL
    res = pools(4).run(dist_dp_sp.dp_sp_training, timeout=180, wrapper=wrapper, steps=4, tiled_loss=5)
    r0 = res[0]
    assert all(r["tiled_calls"] == 4 for r in res), res
    assert r0["loss_diff"] <= LOSS_TOL and r0["loss_change"] > 0.5, r0
    assert r0["grad_diff"] <= GRAD_TOL and r0["grad_scale"] > 1e-2, r0
    assert r0["param_diff"] <= PARAM_TOL, r0


@pytest.mark.multirank
def test_an_fsdp_head_unit_with_different_token_counts_per_rank(pools):
    """FSDP2 with the output head a unit of its own gathers its weight at every call: ranks with
    12 and 7 tokens (3 and 2 tiles of 4) call it equally often (the shorter one adds an empty
    tile), so neither waits on the other; loss and gradients equal the untiled ones.  Before,
    the ranks' head calls (and so their all-gathers) differed in number and both hung."""
    from tests import dist_dp_sp
    res = pools(2).run(dist_dp_sp.tiled_loss_sharded_head, timeout=90)
    # the stand-in call, then 3 tiles in the forward and 3 recomputed in the backward, on both
    assert [r["head_calls"] for r in res] == [7, 7], res
    for r in res:
        assert r["tiled_calls"] == 1 and r["loss"] > 1.0, r
        assert r["loss_diff"] <= 1e-5 * r["loss"], r
        assert r["grad_diff"] <= 1e-5 and r["grad_scale"] > 1e-3, r


@pytest.mark.multirank
def test_a_refusal_on_one_rank_reaches_every_rank_of_an_fsdp_head(pools):
    """One rank's labels do not fit its tokens: it refuses, and the other rank, which would
    otherwise wait in the head's collectives, raises too, naming the other rank."""
    from tests import dist_dp_sp
    res = pools(2).run(dist_dp_sp.tiled_loss_refused_on_one_rank, timeout=90)
    assert "labels have shape (1, 9), its hidden states (1, 10)" in res[1], res
    assert res[0] is not None and "another rank of the output head's mesh refused" in res[0], res
