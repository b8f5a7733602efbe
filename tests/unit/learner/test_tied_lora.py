"""A LoRA that would untie a tied head from its embedding is refused when the learner starts (learner.engine).

vLLM serves a model with ``tie_word_embeddings`` with one tensor as its head and its input embedding; a LoRA on
either one changes only one of the two uses in the learner, so no published version could be its policy.
"""

from __future__ import annotations

import pytest


def tiny(tied: bool):
    import transformers

    config = transformers.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                      tie_word_embeddings=tied)
    return transformers.Qwen3ForCausalLM(config)


@pytest.mark.parametrize(("targets", "module"), [(["q_proj", "lm_head"], "lm_head"),
                                                 (["embed_tokens"], "model.embed_tokens")])
def test_lora_on_the_head_or_embedding_of_a_tied_model_is_refused(targets, module):
    from learner.engine import tied_lora_refusal

    why = tied_lora_refusal(tiny(tied=True), targets)
    assert why is not None and f"adapts {module}," in why and "tie_word_embeddings" in why


def test_lora_elsewhere_or_on_an_untied_head_is_accepted():
    from learner.engine import tied_lora_refusal

    assert tied_lora_refusal(tiny(tied=True), ["q_proj", "k_proj", "v_proj", "o_proj"]) is None
    assert tied_lora_refusal(tiny(tied=False), ["lm_head", "embed_tokens"]) is None
