"""Hugging Face interchange with the real ``transformers`` classes (tiny configs, no mocks):

* export: a Pre-Norm checkpoint is a ``LlamaForCausalLM`` with megapost's logits; a Post-Norm one with
  the prefix-averaging term loads with ``trust_remote_code=True`` in a process that cannot import
  megapost, with megapost's logits, and its ``generate()`` (with and without left padding) gives
  megapost's greedy continuation; the tokenizer loads with ``AutoTokenizer``;
* import: ``--load-hf`` at TP=2 starts from a HF Llama's weights (megapost's step-0 logits equal HF's)
  and exporting that step-0 checkpoint gives back identical tensors; configs megapost cannot represent
  are refused in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_utils import REPO, pretrain, tiny_model_flags
from safetensors.torch import load_file, save_file

from megapost.checkpoint.reader import ShardIndex
from megapost.config.errors import ConfigError
from megapost.model import LlamaModel, ModelConfig

TOKENS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64, 11, 300, 2, 8]])


def _megapost_model(ckpt: Path) -> tuple[LlamaModel, ModelConfig]:
    index = ShardIndex(str(ckpt / (ckpt / "latest").read_text().strip()))
    cfg = ModelConfig(**index.header["model_config"])
    model = LlamaModel(cfg)
    model.load_state_dict(index.full())
    return model.eval(), cfg


def _convert(ckpt: Path, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "tools/convert_to_hf.py", "--load", str(ckpt), "--output", str(out)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def _train_and_export(data, tmp: Path, name: str, **flags) -> tuple[Path, LlamaModel]:
    ckpt, out = tmp / f"{name}-ckpt", tmp / f"{name}-hf"
    pretrain(tiny_model_flags(data, **{"--train-iters": 2, "--save": ckpt, "--zero-stage": 0,
                                       "--peak-tflops": 1, **flags}))
    proc = _convert(ckpt, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, _megapost_model(ckpt)[0]


def _greedy(model: LlamaModel, tokens: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        with torch.no_grad():
            nxt = model(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens


@pytest.mark.integration
def test_export_prenorm_is_llama(tiny_data, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    out, model = _train_and_export(tiny_data, tmp_path, "pre", **{"--norm-position": "pre"})
    assert {"config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json",
            "generation_config.json"} <= set(os.listdir(out))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf) is LlamaForCausalLM
    with torch.no_grad():
        ours, theirs = model(TOKENS), hf(TOKENS).logits
    diff = (ours - theirs).abs().max().item()
    print("pre-norm export max |logit diff|", diff)
    assert diff <= 1e-5
    generated = hf.generate(TOKENS, max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, _greedy(model, TOKENS, 4))
    tok = AutoTokenizer.from_pretrained(out)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tiny_data.tokenizer_model)
    text = tiny_data.texts[0][:80]
    assert tok(text).input_ids == [sp.bos_id(), *sp.encode(text)]


REMOTE_CHECK = """
import sys
sys.modules["megapost"] = None  # as on a machine without megapost: any import of it fails
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
hf_dir, io = sys.argv[1], sys.argv[2]
tokens = load_file(io + "/in.safetensors")["tokens"]
model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True, dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(tokens).logits
gen = model.generate(tokens, max_new_tokens=4, do_sample=False)
pad = torch.zeros(1, 3, dtype=tokens.dtype)  # left padding, masked out
mask = torch.cat([pad, torch.ones_like(tokens)], 1)
padded = model.generate(torch.cat([pad, tokens], 1), attention_mask=mask, max_new_tokens=4, do_sample=False)
save_file({"logits": logits, "gen": gen, "padded": padded[:, 3:].contiguous()}, io + "/out.safetensors")
print(type(model).__name__)
"""


@pytest.mark.integration
def test_export_postnorm_remote_code(tiny_data, tmp_path) -> None:
    out, model = _train_and_export(tiny_data, tmp_path, "post", **{"--norm-position": "post",
                                                                   "--prefix-alpha": 0.3})
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "megapost" and "AutoModelForCausalLM" in config["auto_map"]
    save_file({"tokens": TOKENS}, str(tmp_path / "in.safetensors"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")
    proc = subprocess.run([sys.executable, "-c", REMOTE_CHECK, str(out), str(tmp_path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MegapostForCausalLM" in proc.stdout
    result = load_file(str(tmp_path / "out.safetensors"))
    with torch.no_grad():
        ours = model(TOKENS)
    diff = (ours - result["logits"]).abs().max().item()
    print("post-norm (prefix-alpha 0.3) export max |logit diff|", diff)
    assert diff <= 1e-5
    expected = _greedy(model, TOKENS, 4)
    assert torch.equal(result["gen"], expected) and torch.equal(result["padded"], expected)


def _tiny_hf_llama(path: Path, vocab: int, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, **overrides)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # non-trivial norm gains
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.mark.integration
@pytest.mark.parametrize("engine", [["--zero-stage", "1"], ["--use-distributed-optimizer"]],
                         ids=["deepspeed-zero1", "native"])
def test_import_hf_at_tp2_and_round_trip(tiny_data, tmp_path, engine: list[str]) -> None:
    """On DeepSpeed's engine and on the native one (its write_state and rebuild_weights)."""
    from transformers import LlamaForCausalLM

    src = _tiny_hf_llama(tmp_path / "src", vocab=512)
    ckpt = tmp_path / "ckpt"
    # one step at lr 0 (Adam and weight decay then leave every weight bit for bit): the saved
    # checkpoint holds the step-0 model
    flags = tiny_model_flags(tiny_data, **{"--load-hf": src, "--train-iters": 1, "--lr": 0, "--save": ckpt,
                                           "--tensor-model-parallel-size": 2,
                                           "--peak-tflops": 1, "--num-layers": None, "--hidden-size": None,
                                           "--ffn-hidden-size": None, "--num-attention-heads": None})
    out = pretrain([*flags, *engine], nprocs=2, timeout=900)
    assert f"loaded the weights of {src}" in out.stdout
    model, cfg = _megapost_model(ckpt)
    assert cfg.norm_position == "pre" and cfg.num_layers == 2
    hf = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (model(TOKENS) - hf(TOKENS).logits).abs().max().item()
    print("import step-0 max |logit diff|", diff)
    assert diff <= 1e-5
    back = tmp_path / "back"
    proc = _convert(ckpt, back)
    assert proc.returncode == 0, proc.stderr[-3000:]
    original = load_file(str(src / "model.safetensors"))
    round_trip = load_file(str(back / "model.safetensors"))
    assert original.keys() == round_trip.keys()
    assert all(torch.equal(original[k], round_trip[k]) for k in original)


@pytest.mark.parametrize("overrides, what", [
    ({"attention_bias": True}, "attention biases"),
    ({"tie_word_embeddings": True}, "tied embeddings"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "RoPE scaling"),
])
def test_unrepresentable_hf_configs_are_refused(tmp_path, overrides, what) -> None:
    from megapost.checkpoint.hf import model_flags_from_hf

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "tie_word_embeddings": False, **overrides}))
    with pytest.raises(ConfigError) as e:
        model_flags_from_hf(str(tmp_path))
    message = str(e.value.code)
    assert message.startswith(f"error: --load-hf {tmp_path}") and what in message and "\n" not in message
