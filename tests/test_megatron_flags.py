"""A Megatron-LM Llama launch line (as its examples/llama scripts write one) runs on megapost; flags
for features megapost lacks are refused in one line; sample-based schedules and WSD map exactly."""

from __future__ import annotations

import math

import pytest
from launch_utils import pretrain, read_scalars

from megapost.config.arguments import parse_args
from megapost.optim.schedule import lr_at


def megatron_llama_flags(data, tb) -> list[str]:
    """A Megatron-LM Llama-style flag set, shrunk to a tiny model (as a user types it)."""
    return [
        "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--num-attention-heads", "4", "--kv-channels", "16", "--seq-length", "32",
        "--max-position-embeddings", "32", "--position-embedding-type", "rope", "--rotary-base", "10000",
        "--rotary-percent", "1.0", "--use-rotary-position-embeddings", "--normalization", "RMSNorm",
        "--norm-epsilon", "1e-5", "--swiglu", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--init-method-std", "0.02", "--use-flash-attn", "--no-masked-softmax-fusion",
        "--attention-softmax-in-fp32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-samples", "24", "--lr-decay-samples", "24", "--lr-warmup-samples", "8",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", "1.0",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--context-parallel-size", "1", "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
        "--data-path", f"1.0 {data.prefix}", "--data-cache-path", str(tb / "cache"), "--split", "949,50,1",
        "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", data.tokenizer_model,
        "--num-workers", "2", "--log-interval", "1", "--log-throughput", "--tensorboard-dir", str(tb),
        "--tensorboard-log-interval", "1", "--log-timers-to-tensorboard", "--eval-iters", "1",
        "--eval-interval", "3", "--distributed-backend", "gloo", "--seed", "7", "--transformer-impl", "local",
    ]


@pytest.mark.integration
def test_megatron_llama_launch_line_trains(tiny_data, tmp_path) -> None:
    tb = tmp_path / "tb"
    out = pretrain(megatron_llama_flags(tiny_data, tb))
    assert "accepted --swiglu" in out.stdout and "distributed optimizer (the native engine" in out.stdout
    # no --norm-position: Megatron's Pre-Norm, named on the start line (Megatron's init std typed)
    assert "norm=pre, init std 0.02" in out.stdout and "Pre-Norm, as Megatron's models" in out.stdout
    loss = read_scalars(tb, "train/lm_loss")
    assert sorted(loss) == list(range(1, 7))  # 24 samples / global batch 4
    lr = read_scalars(tb, "train/lr")
    assert lr[1] == pytest.approx(3e-3 / 2) and lr[2] == pytest.approx(3e-3)  # 8 samples = 2 iters warmup
    assert (tb / "cache").is_dir()


def test_parsed_meaning(tiny_data, tmp_path) -> None:
    args = parse_args(megatron_llama_flags(tiny_data, tmp_path))
    assert (args.train_iters, args.lr_decay_iters, args.lr_warmup_iters) == (6, 6, 2)
    assert args.norm_eps == 1e-5 and args.rope_theta == 10000 and args.zero_stage == 1
    assert args.checkpoint_activations and args.checkpoint_num_layers == 1
    assert args.data_cache_dir == str(tmp_path / "cache")
    assert not args.qk_norm and parse_args(["--qk-layernorm"]).qk_norm  # megatron-core's per-head norm
    assert args.norm_position == "pre" and args.init_variance == "std"  # Megatron's model, Megatron's init
    typed_post = parse_args([*megatron_llama_flags(tiny_data, tmp_path), "--norm-position", "post"])
    assert typed_post.norm_position == "post" and not any("Pre-Norm" in n for n in typed_post.start_notes)
    frac = parse_args(["--train-iters", "100", "--lr-warmup-fraction", "0.1"])
    assert frac.lr_warmup_iters == 10


@pytest.mark.parametrize("flags, message", [
    (["--fp16"], "--fp16: fp16 with loss scaling is not supported; use --bf16"),
    (["--normalization", "LayerNorm"], "--normalization LayerNorm: not supported; megapost's norms are"),
    (["--position-embedding-type", "learned_absolute"], "megapost uses RoPE"),
    (["--attention-dropout", "0.1"], "dropout is not supported"),
    (["--hidden-dropout", "0.1"], "dropout is not supported"),
    (["--num-experts", "8"], "mixture-of-experts is not supported"),
    (["--context-parallel-size", "2"], "context parallelism is not supported"),
    (["--num-layers-per-virtual-pipeline-stage", "2"], "runs on megapost's native engine only (DeepSpeed's "
     "PipelineEngine runs 1F1B): add --use-distributed-optimizer"),
    (["--num-layers-per-virtual-pipeline-stage", "2", "--use-distributed-optimizer", "--num-layers", "4"],
     "--num-layers-per-virtual-pipeline-stage 2: needs >= 1 layers and --pipeline-model-parallel-size > 1"),
    (["--num-layers-per-virtual-pipeline-stage", "2", "--use-distributed-optimizer", "--num-layers", "6",
      "--pipeline-model-parallel-size", "2"], "--num-layers-per-virtual-pipeline-stage 2: --num-layers 6 is "
     "not a multiple of --pipeline-model-parallel-size 2 x 2"),
    (["--lr-decay-style", "WSD"], "needs --lr-wsd-decay-iters or --lr-wsd-decay-samples"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1",
      "--num-layers", "4"], "recomputing only some layers of a stage is not supported"),
    (["--tokenizer-type", "NullTokenizer"], "needs --vocab-size"),
])
def test_unsupported_flags_refused_in_one_line(flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(flags)
    text = str(info.value.code)
    assert message in text and "\n" not in text and text.startswith("error: ")


def test_wsd_schedule() -> None:
    args = parse_args(["--train-iters", "100", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "20",
                       "--lr-wsd-decay-style", "linear", "--lr-warmup-iters", "10", "--lr", "1.0",
                       "--min-lr", "0.0"])
    lr = [lr_at(s, args.lr, args.min_lr, args.lr_warmup_iters, args.lr_decay_iters, args.lr_decay_style,
                args.lr_wsd_decay_iters, args.lr_wsd_decay_style) for s in range(101)]
    assert lr[9] == pytest.approx(1.0) and lr[50] == 1.0 and lr[80] == 1.0  # warmup, then stable
    assert lr[90] == pytest.approx(0.5) and lr[100] == pytest.approx(0.0)  # linear anneal over 20
    exp = lr_at(90, 1.0, 0.0, 10, 100, "WSD", 20, "exponential")
    assert exp == pytest.approx(2 * 0.5**0.5 - 1)
    assert lr_at(90, 1.0, 0.0, 10, 100, "WSD", 20, "minus_sqrt") == pytest.approx(1 - math.sqrt(0.5))


def test_huggingface_and_null_tokenizers(tiny_data, tmp_path) -> None:
    from megapost.data.tokenizer import build_tokenizer

    null = build_tokenizer("NullTokenizer", None, 512)
    assert (null.vocab_size, null.eod) == (512, 511)
    pytest.importorskip("transformers")
    from megapost.checkpoint.hf import write_tokenizer

    hf_dir = tmp_path / "hf_tok"
    hf_dir.mkdir()
    write_tokenizer(tiny_data.tokenizer_model, hf_dir)  # what tools/convert_to_hf.py writes
    hf = build_tokenizer("HuggingFaceTokenizer", str(hf_dir))
    sp = build_tokenizer("SentencePieceTokenizer", tiny_data.tokenizer_model)
    assert hf.vocab_size == sp.vocab_size and hf.eod == sp.eod
    text = "The farmer built a wooden bridge yesterday."
    assert hf.tokenize(text) == sp.tokenize(text)
