"""Export without the trainer (fast): grouped-query attention reaches ``num_key_value_heads`` for
Pre-Norm (``LlamaForCausalLM``) and Post-Norm (remote code), and a sharded export loads the same."""

from __future__ import annotations

import pytest
import torch

from megapost.checkpoint.hf import export
from megapost.model import LlamaModel, ModelConfig

transformers = pytest.importorskip("transformers")
TOKENS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64, 11, 300, 2, 8]])


def _model(norm: str, groups: int) -> tuple[LlamaModel, ModelConfig]:
    cfg = ModelConfig(vocab_size=512, num_layers=2, hidden_size=64, ffn_hidden_size=128,
                      num_attention_heads=4, num_query_groups=groups, seq_length=32, norm_position=norm,
                      init_variance="paper", seed=3)
    return LlamaModel(cfg).eval(), cfg


@pytest.mark.parametrize("norm, groups, shard_bytes", [("pre", 2, None), ("pre", 1, 200_000),
                                                       ("post", 2, None)])
def test_gqa_export_equals_megapost(tiny_data, tmp_path, norm, groups, shard_bytes) -> None:
    model, cfg = _model(norm, groups)
    out = tmp_path / "hf"
    kw = {"max_shard_bytes": shard_bytes} if shard_bytes else {}
    export(model.state_dict(), cfg, tiny_data.tokenizer_model, str(out), **kw)
    assert transformers.AutoConfig.from_pretrained(out, trust_remote_code=True).num_key_value_heads == groups
    if shard_bytes:
        assert (out / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                                           torch_dtype=torch.float32).eval()
    assert (type(hf).__name__ == "LlamaForCausalLM") == (norm == "pre")
    with torch.no_grad():
        ours, theirs = model(TOKENS), hf(TOKENS).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
