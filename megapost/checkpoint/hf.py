"""Hugging Face ``transformers`` interchange: export a megapost model directory, import a Llama one.

Export: Pre-Norm without extras (no prefix-averaging term, no QK-norm) is exactly ``LlamaForCausalLM``;
every other model (any other placement of ``megapost.model.placements``, ``--qk-norm``, or
``prefix_alpha != 0``) gets the self-contained ``megapost/hf_remote`` files copied into the directory
(``trust_remote_code=True``), and its config.json carries the per-layer sublayer rules computed here
from megapost's placement table, so the remote code runs one generic formula. Parameter names are
Llama's in both (plus names for the modules Llama lacks: ``to_hf_name``). Import reads a Llama
directory's safetensors (or a megapost export's, any placement), each rank only its slices.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megapost.config.errors import ConfigError
from megapost.engine import Engine
from megapost.model import ModelConfig
from megapost.utils.atomic import give_default_mode

REMOTE = Path(__file__).parent / "hf_remote"
REMOTE_FILES = ("configuration_megapost.py", "modeling_megapost.py")
MAX_SHARD_BYTES = 5 * 1024**3

_LAYER = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
          "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj", "mlp.w1": "mlp.gate_proj",
          "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
          "mlp_norm": "post_attention_layernorm", "attention_out_norm": "attn_output_layernorm",
          "mlp_out_norm": "mlp_output_layernorm", "attention.q_norm": "self_attn.q_norm",
          "attention.k_norm": "self_attn.k_norm", "attention.v_norm": "self_attn.v_norm"}
_TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "embedding.scale": "model.embed_scale", "head.final_norm.weight": "model.norm.weight",
        "head.final_norm.alpha": "model.norm.alpha", "head.lm_head.weight": "lm_head.weight"}


def to_hf_name(name: str) -> str:
    """``LlamaModel`` parameter name -> Hugging Face name: Llama's, and for the modules Llama lacks
    ``attn_output_layernorm`` / ``mlp_output_layernorm`` (sandwich output norms), ``self_attn.q_norm``
    / ``k_norm`` / ``v_norm`` (head norms), ``<norm>.alpha`` (DyT) and ``model.embed_scale`` (DyT)."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|alpha)", name)
    if not m or m.group(2) not in _LAYER:
        raise KeyError(f"no Hugging Face name for {name}")
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


def num_kv_heads(cfg: Any) -> int:
    return getattr(cfg, "num_query_groups", None) or cfg.num_attention_heads


def uses_llama(cfg: ModelConfig) -> bool:
    """Whether ``LlamaForCausalLM`` computes this model (Pre-Norm without extras)."""
    return cfg.norm_position == "pre" and not cfg.prefix_alpha and not cfg.qk_norm


def remote_layout(cfg: ModelConfig) -> dict[str, Any]:
    """The norm placement as the remote code reads it: every layer's (attention, mlp) rules from
    megapost's table, the norm kind, the final norm, QK-norm and the embedding scale."""
    rules = [cfg.rules(n) for n in range(1, cfg.num_layers + 1)]
    return {"layer_rules": [{"attention": asdict(attn), "mlp": asdict(mlp)} for attn, mlp in rules],
            "norm_kind": cfg.norm_kind, "final_norm": cfg.final_norm, "qk_norm": cfg.qk_norm,
            "embedding_scale": cfg.embedding_scale, "dyt_alpha_init": list(cfg.dyt_alpha_init)}


def hf_config(cfg: ModelConfig, bos: int, eos: int) -> dict[str, Any]:
    common = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": num_kv_heads(cfg), "max_position_embeddings": cfg.seq_length,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": False, "bos_token_id": bos, "eos_token_id": eos,
        "torch_dtype": "float32", "megapost_config": asdict(cfg),
    }
    if uses_llama(cfg):
        return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                "head_dim": cfg.head_dim, "attention_bias": False, "mlp_bias": False,
                "attention_dropout": 0.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                "rope_theta": cfg.rope_theta, "use_cache": True}  # rope_theta: for transformers 4.x
    return {**common, "architectures": ["MegapostForCausalLM"], "model_type": "megapost",
            "norm_position": cfg.norm_position, "prefix_alpha": cfg.prefix_alpha, **remote_layout(cfg),
            "rope_theta": cfg.rope_theta,
            "use_cache": False, "auto_map": {"AutoConfig": "configuration_megapost.MegapostConfig",
                                             "AutoModelForCausalLM": "modeling_megapost.MegapostForCausalLM"}}


def write_tokenizer(tokenizer_model: str, out: Path) -> tuple[int, int]:
    """The SentencePiece model as a Llama tokenizer; returns (bos, eos) ids."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tokenizer_model)
    shutil.copyfile(tokenizer_model, out / "tokenizer.model")
    bos, eos, unk = sp.bos_id(), sp.eos_id(), sp.unk_id()

    def piece(i: int) -> str | None:
        return sp.id_to_piece(i) if i >= 0 else None

    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": piece(bos), "eos_token": piece(eos),
              "unk_token": piece(unk), "pad_token": None, "add_bos_token": bos >= 0, "add_eos_token": False,
              "legacy": False, "model_max_length": 1 << 30}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return bos, eos


def _write_weights(tensors: dict[str, torch.Tensor], out: Path, max_bytes: int) -> None:
    """model.safetensors, or model-XXXXX-of-YYYYY.safetensors plus the index above ``max_bytes``."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def export(full: dict[str, torch.Tensor], cfg: ModelConfig, tokenizer_model: str, output: str,
           max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write the ``transformers`` directory ``output`` atomically (a temp directory, then rename)."""
    final = Path(output)
    if final.exists():
        raise ConfigError(f"--output {output} exists; remove it or choose another directory")
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        bos, eos = write_tokenizer(tokenizer_model, tmp)
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, bos, eos), indent=1))
        generation = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False,
                      "use_cache": uses_llama(cfg)}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=1))
        if not uses_llama(cfg):
            for name in REMOTE_FILES:
                shutil.copyfile(REMOTE / name, tmp / name)
        _write_weights({to_hf_name(n): t.float() for n, t in full.items()}, tmp, max_shard_bytes)
        for path in tmp.iterdir():  # safetensors writes 0600: every file as open() would make it (0644)
            give_default_mode(path)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------- import


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--load-hf {hf_dir}: no config.json; pass a Hugging Face model directory")
    with open(path) as f:
        return json.load(f)


def model_flags_from_hf(hf_dir: str) -> dict[str, Any]:
    """megapost model flags (argparse dests) for a Hugging Face Llama config or a megapost export's;
    refuses, in one line, what megapost's model cannot represent."""
    c = read_hf_config(hf_dir)
    where = f"--load-hf {hf_dir}"
    if c.get("model_type") not in ("llama", "megapost"):
        raise ConfigError(f"{where}: model_type {c.get('model_type')!r} is not 'llama' or 'megapost'; only "
                          "Llama checkpoints and megapost exports can be imported")
    rope = c.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", "default") if rope else (c.get("rope_scaling") or {}).get("rope_type",
                                                                                                "default")
    problems = [
        (c.get("attention_bias", False), "attention biases (attention_bias=true)"),
        (c.get("mlp_bias", False), "MLP biases (mlp_bias=true)"),
        (c.get("tie_word_embeddings", False), "tied embeddings (tie_word_embeddings=true)"),
        (c.get("rope_scaling") not in (None, {}) or rope_type != "default", f"RoPE scaling ({rope_type})"),
        (c.get("hidden_act", "silu") != "silu",
         f"activation {c.get('hidden_act')!r} (megapost has SwiGLU/silu)"),
        (c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
         != c["hidden_size"] // c["num_attention_heads"], "head_dim != hidden_size / num_attention_heads"),
    ]
    kv = c.get("num_key_value_heads") or c["num_attention_heads"]
    if kv != c["num_attention_heads"]:
        problems.append((not _has_gqa(), f"grouped-query attention ({kv} K/V heads)"))
    bad = [what for flag, what in problems if flag]
    if bad:
        raise ConfigError(f"{where}: megapost cannot represent {', '.join(bad)}; import a plain Llama "
                          "(no biases, untied embeddings, default RoPE, silu)")
    flags = {"num_layers": c["num_hidden_layers"], "hidden_size": c["hidden_size"],
             "ffn_hidden_size": c["intermediate_size"], "num_attention_heads": c["num_attention_heads"],
             "norm_position": "pre", "norm_eps": c.get("rms_norm_eps", 1e-6),
             "rope_theta": float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
             "hf_vocab_size": c["vocab_size"]}
    if kv != c["num_attention_heads"]:
        flags["num_query_groups"] = kv
    if c["model_type"] == "megapost":
        flags.update(_placement_flags(c, where))
    return flags


_PLACEMENT_FLAGS = ("norm_position", "mix_post_fraction", "dyt_alpha_init", "qk_norm", "prefix_alpha")


def _placement_flags(c: dict[str, Any], where: str) -> dict[str, Any]:
    """A megapost export's placement flags; its explicit layout must be what megapost's table gives."""
    mp = c.get("megapost_config") or {"norm_position": c.get("norm_position"),
                                      "prefix_alpha": c.get("prefix_alpha", 0.0)}
    flags = {k: mp[k] for k in _PLACEMENT_FLAGS if k in mp}
    if "dyt_alpha_init" in flags:
        flags["dyt_alpha_init"] = tuple(flags["dyt_alpha_init"])
    try:
        cfg = ModelConfig(vocab_size=c["vocab_size"], num_layers=c["num_hidden_layers"],
                          hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
                          **flags)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: config.json's megapost placement is not one megapost builds ({e}); "
                          "re-export the model with tools/convert_to_hf.py") from None
    if "layer_rules" in c:
        ours = remote_layout(cfg)
        differ = [k for k in ours if k != "dyt_alpha_init" and _jsonish(c.get(k)) != _jsonish(ours[k])]
        if differ:
            raise ConfigError(f"{where}: config.json's {', '.join(differ)} differ from what megapost's "
                              f"--norm-position {cfg.norm_position} gives; megapost imports only layouts "
                              "of its own placement table")
    return flags


def _jsonish(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _has_gqa() -> bool:
    return "num_query_groups" in getattr(ModelConfig, "__dataclass_fields__", {})


class HFReader:
    """Slices of the tensors of a Hugging Face safetensors directory (single file or sharded)."""

    def __init__(self, hf_dir: str) -> None:
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                self.files = {n: os.path.join(hf_dir, p) for n, p in json.load(f)["weight_map"].items()}
        elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
            path = os.path.join(hf_dir, "model.safetensors")
            with safe_open(path, framework="pt") as f:
                self.files = {n: path for n in f.keys()}
        else:
            raise ConfigError(f"--load-hf {hf_dir}: no model.safetensors or model.safetensors.index.json "
                              "(pickled .bin weights are not read: save the model with safetensors)")
        self.hf_dir = hf_dir

    def _key(self, name: str) -> str:
        key = to_hf_name(name)
        if key not in self.files:
            raise ConfigError(f"--load-hf {self.hf_dir}: tensor {key} is missing")
        return key

    def read(self, name: str, dim: int | None, start: int, stop: int | None) -> torch.Tensor:
        key = self._key(name)
        with safe_open(self.files[key], framework="pt") as f:
            sl = f.get_slice(key)
            if dim is None:
                return sl[:]
            index = [slice(None)] * len(sl.get_shape())
            index[dim] = slice(start, stop)
            return sl[tuple(index)]

    def shape(self, name: str) -> tuple[int, ...]:
        key = self._key(name)
        with safe_open(self.files[key], framework="pt") as f:
            return tuple(f.get_slice(key).get_shape())


def load_hf_weights(engine: Engine, pstate: Any, hf_dir: str) -> None:
    """Set this rank's weights (and fp32 masters) from a Hugging Face Llama directory."""
    from megapost.checkpoint.reader import set_local_params
    from megapost.checkpoint.specs import full_shapes, local_parameters

    cfg: ModelConfig = engine.module.config
    reader = HFReader(hf_dir)
    for name, shape in full_shapes(cfg).items():
        if reader.shape(name) != shape:
            raise ConfigError(f"--load-hf {hf_dir}: {to_hf_name(name)} is {reader.shape(name)} but megapost "
                              f"builds {shape}; check --make-vocab-size-divisible-by and the model flags")
    params = local_parameters(engine.module, cfg.num_layers, pstate.pp_size > 1)

    def read(kind: str, name: str, dim: int | None, start: int, stop: int | None) -> torch.Tensor:
        return reader.read(name, dim, start, stop)

    set_local_params(engine, pstate, params, read, [])
