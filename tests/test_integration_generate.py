"""generate() on a model with usp-hal attention is refused up front, naming generation."""
import pytest

pytest.importorskip("transformers")


def test_generate_is_refused_as_not_supported_yet():
    import torch

    from tests.integration_cases import tiny_llama
    from usp_hal.integrations import transformers as usp

    name = usp.register("usp_hal_test_generate")
    model = tiny_llama(0, num_hidden_layers=1)
    model.set_attn_implementation(name)
    with pytest.raises(NotImplementedError, match="generation is not supported yet"):
        model.generate(torch.randint(0, 8, (1, 6)), max_new_tokens=2, do_sample=False)
    model.set_attn_implementation("sdpa")       # other implementations still generate
    assert model.generate(torch.randint(0, 8, (1, 6)), max_new_tokens=2, do_sample=False).shape == (1, 8)
