"""``megapost-export-hf``: a megapost checkpoint (any layout) as a Hugging Face ``transformers`` model
directory (``python tools/convert_to_hf.py`` runs the same).

    megapost-export-hf --load CKPT_DIR [--iteration N] --output HF_DIR [--tokenizer-model M]

Reads the tag's layout-free state (safetensors only). Pre-Norm without extras -> ``LlamaForCausalLM``;
any other placement, ``--qk-norm`` or ``--prefix-alpha != 0`` -> a self-contained model loaded with
``trust_remote_code=True`` (its config.json spells out every sublayer's norm rule).
"""

from __future__ import annotations

import argparse
import os

from megapost.checkpoint.folder import CheckpointFolder
from megapost.checkpoint.format import check_complete
from megapost.checkpoint.hf import export, uses_llama
from megapost.checkpoint.reader import ShardIndex
from megapost.config.errors import ConfigError
from megapost.model import ModelConfig


def tag_dir(load: str, iteration: int | None) -> str:
    """The tag to export: ``--iteration``'s, else the one a resume would load."""
    path = CheckpointFolder(load).tag_dir(step=iteration)
    if not check_complete(path):
        raise ConfigError(f"--load {load}: tag {os.path.basename(path)} has no layout-free state (saved by "
                          "an older megapost); resume it once and save again")
    return path


def from_pretrained_line(cfg: ModelConfig, output: str) -> str:
    """The exact line that loads the export: any placement but plain Pre-Norm runs the directory's own
    modeling code, so it needs ``trust_remote_code=True``."""
    remote = "" if uses_llama(cfg) else ", trust_remote_code=True"
    return f"AutoModelForCausalLM.from_pretrained({output!r}{remote})"


def export_hf_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="megapost checkpoint directory (--save of a run)")
    p.add_argument("--iteration", type=int, help="tag iter_N (default: 'latest')")
    p.add_argument("--output", required=True, help="Hugging Face model directory to create")
    p.add_argument("--tokenizer-model", help="SentencePiece model (default: the one the run trained with)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="split model.safetensors above this")
    args = p.parse_args(argv)
    index = ShardIndex(tag_dir(args.load, args.iteration))  # ConfigError: one line, exit status 1
    header = index.header
    tokenizer = args.tokenizer_model or header.get("args", {}).get("tokenizer_model")
    if not tokenizer or not os.path.isfile(tokenizer):
        raise ConfigError(f"--tokenizer-model {tokenizer}: no such file; pass the run's SentencePiece model")
    cfg = ModelConfig(**header["model_config"])
    export(index.full(), cfg, tokenizer, args.output, int(args.max_shard_gb * 1024**3))
    print(f"wrote {args.output}; load it with: from transformers import AutoModelForCausalLM; "
          f"{from_pretrained_line(cfg, args.output)}")
