"""megapost-export-hf prints the exact from_pretrained line: trust_remote_code=True for every export that
is not LlamaForCausalLM (Post-Norm and the other placements, QK-norm, prefix averaging)."""

from __future__ import annotations

from megapost.checkpoint.hf_command import from_pretrained_line
from megapost.model import ModelConfig


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=64, num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                       seq_length=16, seed=1, **kw)


def test_post_norm_needs_trust_remote_code() -> None:
    assert (from_pretrained_line(_cfg(norm_position="post"), "hf/post")
            == "AutoModelForCausalLM.from_pretrained('hf/post', trust_remote_code=True)")
    assert (from_pretrained_line(_cfg(norm_position="pre", qk_norm=True), "hf/qk")
            == "AutoModelForCausalLM.from_pretrained('hf/qk', trust_remote_code=True)")


def test_plain_pre_norm_is_llama() -> None:
    assert (from_pretrained_line(_cfg(norm_position="pre"), "hf/pre")
            == "AutoModelForCausalLM.from_pretrained('hf/pre')")
