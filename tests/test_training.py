"""The trainer end to end: resume exactness, TensorBoard output, bad-input errors, presets."""

from __future__ import annotations

import json

import numpy as np
import pytest
from launch_utils import pretrain, read_scalars, scalar_tags, tiny_model_flags

from megapost.config.arguments import parse_args

DYT_QK = ["--norm-position", "dyt", "--qk-norm", "--z-loss", "1e-3"]  # a placement with its own parameters


@pytest.mark.integration
@pytest.mark.parametrize("precision", [[], ["--bf16"], DYT_QK], ids=["fp32", "bf16", "dyt-qk-norm-z-loss"])
def test_resume_continues_exactly(tiny_data, tmp_path, precision) -> None:
    """2N steps in one run == N steps, save, resume, N more (CPU: bitwise-equal losses; in bf16 the
    fp32 master weights, optimizer state and fp32 gradient accumulators resume exactly; under DyT its
    scalars and the embedding scale, with --qk-norm's gains, resume too)."""
    full, half = tmp_path / "full", tmp_path / "half"
    pretrain([*tiny_model_flags(tiny_data, **{"--train-iters": 6, "--tensorboard-dir": full / "tb"}),
              *precision])
    first = tiny_model_flags(tiny_data, **{"--train-iters": 3, "--lr-decay-iters": 6,
                                           "--tensorboard-dir": half / "tb1", "--save": half / "ckpt"})
    pretrain([*first, *precision])
    assert (half / "ckpt" / "latest").read_text().strip() == "iter_0000003"
    second = [*tiny_model_flags(tiny_data, **{"--train-iters": 6, "--tensorboard-dir": half / "tb2",
                                              "--load": half / "ckpt"}), *precision]
    out = pretrain(second)
    assert "resumed from" in out.stdout
    expected = read_scalars(full / "tb", "train/lm_loss")
    resumed = {**read_scalars(half / "tb1", "train/lm_loss"), **read_scalars(half / "tb2", "train/lm_loss")}
    assert sorted(expected) == list(range(1, 7)) and sorted(resumed) == list(range(1, 7))
    assert [expected[s] for s in range(1, 7)] == [resumed[s] for s in range(1, 7)]
    lr_full, lr_resumed = read_scalars(full / "tb", "train/lr"), read_scalars(half / "tb2", "train/lr")
    assert all(lr_full[s] == lr_resumed[s] for s in range(4, 7))


@pytest.mark.integration
def test_tensorboard_scalars_and_loss_falls(tiny_data, tmp_path) -> None:
    tb = tmp_path / "tb"
    flags = {"--train-iters": 12, "--eval-interval": 6, "--eval-iters": 1, "--log-interval": 4,
             "--tensorboard-dir": tb, "--peak-tflops": 0.5}  # known: a busy CPU's own measurement is refused
    proc = pretrain(tiny_model_flags(tiny_data, **flags))
    # the planner's prediction beside the measurement, once (CPU without MEGAPOST_TENSOR_MEMORY: RSS)
    assert proc.stdout.count(" memory: planned ") == 1 and "(peak RSS, not tensor memory)" in proc.stdout
    tags = scalar_tags(tb)
    for tag in ("train/lm_loss", "train/lr", "train/grad_norm", "train-vs-tokens/lm_loss",
                "valid/lm_loss", "valid-vs-tokens/lm_loss", "throughput/tokens_per_sec",
                "throughput/tflops_per_device", "throughput/mfu", "throughput/memory_gb"):
        assert tag in tags, tag
    loss = read_scalars(tb, "train/lm_loss")
    assert len(loss) == 12 and np.mean([loss[s] for s in (10, 11, 12)]) < loss[1] - 0.3
    by_tokens = read_scalars(tb, "train-vs-tokens/lm_loss")
    assert sorted(by_tokens) == [s * 4 * 32 for s in range(1, 13)]  # global batch 4 x seq 32
    lr = read_scalars(tb, "train/lr")
    assert lr[1] == pytest.approx(3e-3 / 2) and lr[2] == pytest.approx(3e-3)  # warmup 2
    assert sorted(read_scalars(tb, "valid/lm_loss")) == [6, 12]
    assert json.loads((tb / "args.json").read_text())["hidden_size"] == 64


def _error(argv: list[str], capsys) -> str:
    from megapost.pretrain import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    return str(info.value.code)


def test_bad_input_errors_are_one_line_and_early(tiny_data, tmp_path, capsys) -> None:
    base = tiny_model_flags(tiny_data)
    msg = _error(base + ["--global-batch-size", "5"], capsys)
    assert "--global-batch-size 5" in msg and "--micro-batch-size 2" in msg
    msg = _error(tiny_model_flags(tiny_data, **{"--data-path": tmp_path / "nope"}), capsys)
    assert "--data-path" in msg and "nope.bin" in msg
    msg = _error(tiny_model_flags(tiny_data, **{"--tokenizer-model": tmp_path / "x.model"}), capsys)
    assert "--tokenizer-model" in msg
    msg = _error(base + ["--tensor-model-parallel-size", "2"], capsys)
    assert "world size 1" in msg and "--tensor-model-parallel-size 2" in msg
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4}))
    msg = _error(base + ["--deepspeed_config", str(cfg)], capsys)
    assert "--micro-batch-size 2 disagrees" in msg and "train_micro_batch_size_per_gpu=4" in msg
    assert "\n" not in msg


def test_tokenizer_vocab_must_cover_dataset(tiny_data, tmp_path, capsys) -> None:
    from megapost.data import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(tmp_path / "big", dtype=np.uint16)
    for _ in range(50):
        builder.add_document(np.arange(600, 900))  # ids beyond the 512-token tokenizer
    builder.finalize()
    msg = _error(tiny_model_flags(tiny_data, **{"--data-path": tmp_path / "big"}), capsys)
    assert "token id 899" in msg and "re-tokenize" in msg


def test_deepspeed_config_values_are_adopted_when_flags_are_not_typed(tmp_path) -> None:
    from megapost.config.deepspeed_json import reconcile_with_user_config

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 64, "zero_optimization": {"stage": 1}}))
    args = parse_args(["--deepspeed_config", str(cfg)])
    reconcile_with_user_config(args)
    assert args.global_batch_size == 64 and args.zero_stage == 1


def test_paper_preset_is_the_paper_recipe_and_flags_override() -> None:
    args = parse_args(["--preset", "paper-180m", "--lr", "1.2e-3"])
    sizes = (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads)
    assert sizes == (48, 512, 1536, 4)
    assert (args.seq_length, args.micro_batch_size, args.global_batch_size) == (2048, 4, 256)
    assert (args.adam_beta1, args.adam_beta2, args.weight_decay, args.clip_grad) == (0.9, 0.95, 0.1, 1.0)
    assert (args.lr_warmup_iters, args.train_iters, args.lr_decay_style) == (2000, 40000, "cosine")
    assert args.init_variance == "paper" and args.lr == 1.2e-3
    from megapost.model import ModelConfig

    cfg = ModelConfig(vocab_size=32000, num_layers=48, hidden_size=512, ffn_hidden_size=1536,
                      num_attention_heads=4, seq_length=2048)
    # 163.6M in the blocks + 2 x 16.4M untied embedding/head with Llama-2's 32k vocab ("~180M")
    assert cfg.num_parameters() == 196_395_008


@pytest.mark.integration
def test_non_finite_loss_stops_with_a_one_line_error(tiny_data) -> None:
    """A diverged run: every step's gradient is non-finite, so every step is skipped, and the run stops
    at the log step after --max-consecutive-skipped-iterations of them."""
    proc = pretrain(tiny_model_flags(tiny_data, **{"--lr": 1e12, "--lr-warmup-iters": 0, "--clip-grad": 0,
                                                   "--train-iters": 8,
                                                   "--max-consecutive-skipped-iterations": 2}), check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 2 consecutive iterations skipped (non-finite gradient norm") \
        and "--lr" in last and "no good checkpoint was saved" in last, proc.stderr[-2000:]


@pytest.mark.parametrize("saved_zero, zero, refused", [(1, 1, True), (0, 0, False), (0, 1, True)])
def test_zero_shards_of_another_data_parallel_size_are_refused(tmp_path, saved_zero, zero, refused) -> None:
    from megapost.checkpoint.format import META_FILE
    from megapost.checkpoint.layout import RunLayout, check_layout
    from megapost.config.errors import ConfigError
    from megapost.model import ModelConfig

    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "latest").write_text("iter_0000002")
    meta = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 2,
            "zero_stage": saved_zero}
    (tmp_path / "iter_0000002" / META_FILE).write_text(json.dumps(meta))
    args = parse_args(["--load", str(tmp_path), "--zero-stage", str(zero)])
    args.data_parallel_size = 1
    run = RunLayout.before_resolution(ModelConfig(vocab_size=128), vars(args))
    if refused:
        with pytest.raises(ConfigError, match="ZeRO optimizer shards for 2 data-parallel ranks"):
            check_layout(str(tmp_path), run)
    else:
        check_layout(str(tmp_path), run)  # ZeRO-0 checkpoints hold full optimizer state: any DP size resumes
