"""Hugging Face export of every norm placement, in-process (no training): a tiny megapost model with its
norm gains, DyT alphas and embedding scale moved off their init is exported by ``checkpoint.hf.export``
(what tools/convert_to_hf.py calls), loaded by transformers' real ``AutoModelForCausalLM`` with
``trust_remote_code=True``, and gives megapost's logits, also for a left-padded batch; ``--load-hf``
reads the export back into the same megapost model. Old configs (``norm_position`` only) still load;
a config whose rules were edited is refused in one line.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from megapost.checkpoint.hf import HFReader, export, model_flags_from_hf
from megapost.checkpoint.specs import full_shapes
from megapost.config.errors import ConfigError
from megapost.model import LlamaModel, ModelConfig
from megapost.model.placements import PLACEMENTS

transformers = pytest.importorskip("transformers")

CASES = {p: {"norm_position": p} for p in PLACEMENTS}
CASES["mix"]["mix_post_fraction"] = 0.5  # layers 1-2 Post-Norm, 3-4 Pre-Norm, final norm
CASES.update({
    "post-qk-norm": {"norm_position": "post", "qk_norm": True},
    "pre-qk-norm": {"norm_position": "pre", "qk_norm": True},  # not a Llama any more: remote code
    "dyt-alpha": {"norm_position": "dyt", "dyt_alpha_init": (0.5, 0.1)},
    "hybrid-gqa-prefix": {"norm_position": "hybrid", "num_query_groups": 2, "prefix_alpha": 0.3},
})
TOKENS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64, 11, 300, 2, 8],
                       [9, 33, 120, 4, 77, 18, 401, 6, 2, 0, 0, 0]])
PAD = 3  # row 1 holds 9 real tokens, left-padded to 12


def _model(vocab: int, **placement) -> tuple[LlamaModel, ModelConfig]:
    cfg = ModelConfig(vocab_size=vocab, num_layers=4, hidden_size=32, ffn_hidden_size=64,
                      num_attention_heads=4, seq_length=32, seed=7, **placement)
    cfg = ModelConfig(**json.loads(json.dumps(asdict(cfg))))  # as convert_to_hf reads it from a checkpoint
    model = LlamaModel(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    moved = 0
    with torch.no_grad():  # every norm gain, DyT alpha and the embedding scale away from its init
        for name, p in model.named_parameters():
            if "norm" in name or name == "embedding.scale":
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=gen))
                moved += 1
    assert moved >= 2
    return model, cfg


def _export(model: LlamaModel, cfg: ModelConfig, tokenizer: str, out: Path) -> Path:
    export(model.state_dict(), cfg, tokenizer, str(out))
    return out


def _load_hf(out: Path) -> torch.nn.Module:
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return hf.eval()


def _assert_same_logits(model: LlamaModel, hf: torch.nn.Module) -> None:
    with torch.no_grad():
        ours, theirs = model(TOKENS), hf(TOKENS).logits
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
        real = TOKENS[1:, :-PAD]
        padded = torch.cat([torch.zeros(1, PAD, dtype=TOKENS.dtype), real], 1)
        mask = torch.cat([torch.zeros(1, PAD, dtype=torch.long), torch.ones_like(real)], 1)
        batch = hf(torch.cat([TOKENS[:1], padded]), attention_mask=torch.cat([torch.ones_like(mask), mask]))
        theirs = batch.logits[1:, PAD:]
        ours = model(real)
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
        assert torch.allclose(batch.logits[:1], model(TOKENS[:1]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_export_equals_megapost_and_imports_back(tiny_data, tmp_path, case) -> None:
    from megapost.config.arguments import parse_args
    from megapost.config.model_config import model_config_from_args
    from megapost.train.prepare import apply_hf_flags

    model, cfg = _model(tiny_data.vocab_size, **CASES[case])
    out = _export(model, cfg, tiny_data.tokenizer_model, tmp_path / f"hf-{case}")
    config = json.loads((out / "config.json").read_text())
    hf = _load_hf(out)
    llama = case == "pre"
    assert (type(hf).__name__ == "LlamaForCausalLM") == llama
    if not llama:  # the rules are in config.json, as megapost's table gives them
        assert config["layer_rules"] == [{"attention": asdict(a), "mlp": asdict(f)}
                                         for a, f in (cfg.rules(n) for n in range(1, cfg.num_layers + 1))]
        assert config["final_norm"] == cfg.final_norm and config["norm_kind"] == cfg.norm_kind
        names = {n for n, _ in hf.named_parameters()}
        assert ("model.layers.0.self_attn.v_norm.weight" in names) == (cfg.norm_position == "hybrid")
        assert ("model.layers.0.post_attention_layernorm.weight" in names) == (cfg.norm_position != "hybrid")
        assert ("model.layers.0.attn_output_layernorm.weight" in names) == (cfg.norm_position == "sandwich")
        assert ("model.norm.alpha" in names) == ("model.embed_scale" in names) == (cfg.norm_kind == "dyt")
    _assert_same_logits(model, hf)

    # --load-hf: the flags rebuild this model and every tensor reads back under its megapost name
    args = parse_args(["--load-hf", str(out), "--tokenizer-model", tiny_data.tokenizer_model])
    apply_hf_flags(args)
    back_cfg = model_config_from_args(args, tiny_data.vocab_size)
    not_in_export = ("seq_length", "init_variance", "init_method_std", "scaled_output_init",
                     "sublayer_init_multiplier", "seed")
    assert back_cfg == replace(cfg, dyt_alpha_init=tuple(cfg.dyt_alpha_init),
                               **{k: getattr(back_cfg, k) for k in not_in_export})
    reader = HFReader(str(out))
    back = LlamaModel(back_cfg).eval()
    back.load_state_dict({name: reader.read(name, None, 0, None) for name in full_shapes(back_cfg)})
    with torch.no_grad():
        assert torch.equal(back(TOKENS), model(TOKENS))


@pytest.mark.parametrize("placement, extra", [("post", {}), ("pre", {"prefix_alpha": 0.3})])
def test_configs_without_rules_still_load(tiny_data, tmp_path, placement, extra) -> None:
    """A config.json written before the rules were exported (norm_position only) gets post/pre's."""
    model, cfg = _model(tiny_data.vocab_size, norm_position=placement, **extra)
    out = _export(model, cfg, tiny_data.tokenizer_model, tmp_path / f"old-{placement}")
    config = json.loads((out / "config.json").read_text())
    for key in ("layer_rules", "final_norm", "norm_kind", "embedding_scale", "qk_norm", "dyt_alpha_init"):
        del config[key]
    (out / "config.json").write_text(json.dumps(config))
    _assert_same_logits(model, _load_hf(out))


def test_edited_rules_are_refused(tiny_data, tmp_path) -> None:
    model, cfg = _model(tiny_data.vocab_size, norm_position="sandwich")
    out = _export(model, cfg, tiny_data.tokenizer_model, tmp_path / "edited")
    config = json.loads((out / "config.json").read_text())
    config["layer_rules"][1]["mlp"]["output_norm"] = False
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        model_flags_from_hf(str(out))
    message = str(e.value.code)
    assert message == (f"error: --load-hf {out}: config.json's layer_rules differ from what megapost's "
                       "--norm-position sandwich gives; megapost imports only layouts of its own placement "
                       "table")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("case", ["dyt", "hybrid-gqa-prefix"])
def test_load_hf_megapost_export_round_trip_tp2(tiny_data, tmp_path, case) -> None:
    """megapost -> HF -> ``--load-hf`` at TP=2 (one step at lr 0) -> HF: identical tensors."""
    import subprocess
    import sys

    from launch_utils import REPO, pretrain, tiny_model_flags
    from safetensors.torch import load_file

    model, cfg = _model(tiny_data.vocab_size, **CASES[case])
    src = _export(model, cfg, tiny_data.tokenizer_model, tmp_path / "src")
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    model_flags = {f: None for f in ("--num-layers", "--hidden-size", "--ffn-hidden-size",
                                     "--num-attention-heads")}  # from the export's config.json
    flags = tiny_model_flags(tiny_data, **{"--load-hf": src, "--train-iters": 1, "--lr": 0, "--save": ckpt,
                                           "--tensor-model-parallel-size": 2, "--zero-stage": 1,
                                           "--peak-tflops": 1, **model_flags})
    out = pretrain(flags, nprocs=2, timeout=900)
    assert f"loaded the weights of {src}" in out.stdout and f"norm={cfg.norm_position}" in out.stdout
    cmd = [sys.executable, "tools/convert_to_hf.py", "--load", str(ckpt), "--output", str(back)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    original = load_file(str(src / "model.safetensors"))
    round_trip = load_file(str(back / "model.safetensors"))
    assert original.keys() == round_trip.keys()
    assert all(torch.equal(original[k], round_trip[k]) for k in original)
    assert json.loads((back / "config.json").read_text())["layer_rules"] == \
        json.loads((src / "config.json").read_text())["layer_rules"]


def test_missing_tensor_is_named(tiny_data, tmp_path) -> None:
    """A Llama directory lacks what ``--qk-norm`` would read: one line naming the tensor."""
    model, cfg = _model(tiny_data.vocab_size, norm_position="pre")
    out = _export(model, cfg, tiny_data.tokenizer_model, tmp_path / "llama")
    with pytest.raises(ConfigError) as e:
        HFReader(str(out)).shape("layers.0.attention.q_norm.weight")
    missing = "model.layers.0.self_attn.q_norm.weight"
    assert str(e.value.code) == f"error: --load-hf {out}: tensor {missing} is missing"
