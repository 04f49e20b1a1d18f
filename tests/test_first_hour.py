"""A Megatron user's and a TensorBoard user's first hour: flags mean what Megatron means, a resume
keeps its data, bf16 fits the CPU, the port check cannot race, one TensorBoard run per training run."""

from __future__ import annotations

import contextlib
import json
import math
import re
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from launch_utils import REPO, pretrain, read_scalars, run, scalar_tags, tiny_model_flags

from megapost.config.arguments import parse_args
from megapost.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megapost.runtime.cpu import bf16_note, native_bf16


def _one_line_error(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    text = str(info.value.code)
    assert "\n" not in text and text.startswith("error: ")
    return text


@pytest.mark.parametrize("argv, expected", [
    (["--swiglue"], "--swiglue: unknown flag (nearest: --swiglu)"),
    (["--tensorboard-queu-size", "3"],
     "--tensorboard-queu-size: unknown flag (nearest: --tensorboard-queue-size)"),
    (["--lr"], "--lr: expected one argument"),
    (["--decoupled-lr", "5e-4"], "--decoupled-lr 5e-4: a separate embedding/output lr is not supported"),
    (["--fp8-format", "hybrid"], "--fp8-format hybrid: fp8 is not supported"),
])
def test_bad_flags_are_one_line_with_the_nearest(argv, expected, capsys) -> None:
    assert expected in _one_line_error(argv)
    assert "usage:" not in capsys.readouterr().err  # no usage dump


def test_megatron_model_flags_mean_pre_norm_and_every_flag_is_noted() -> None:
    megatron = parse_args(["--swiglu", "--normalization", "RMSNorm", "--apply-layernorm-1p",
                           "--attention-backend", "fused", "--cross-entropy-loss-fusion", "--manual-gc",
                           "--no-create-attention-mask-in-dataloader", "--tensorboard-queue-size", "7",
                           "--log-validation-ppl-to-tensorboard", "--timing-log-level", "1"])
    assert megatron.norm_position == "pre"
    notes = " ".join(megatron.start_notes + megatron.megatron_notes)
    for flag in ("Pre-Norm, as Megatron", "--apply-layernorm-1p", "--attention-backend fused",
                 "--cross-entropy-loss-fusion", "--manual-gc", "--no-create-attention-mask-in-dataloader",
                 "--tensorboard-queue-size 7", "--log-validation-ppl-to-tensorboard", "--timing-log-level 1",
                 "--normalization RMSNorm"):
        assert flag in notes, flag
    assert parse_args(["--swiglu", "--norm-position", "post"]).norm_position == "post"  # typed wins
    assert parse_args([]).norm_position == "post"  # megapost's own default, named at start-up


def test_preset_never_overrides_a_typed_flag() -> None:
    typed = parse_args(["--preset", "tiny-cpu", "--init-method-std", "0.02"])
    assert typed.init_variance == "std" and "--init-method-std 0.02 typed" in typed.start_notes[0]
    assert parse_args(["--preset", "tiny-cpu"]).init_variance == "paper"
    assert parse_args(["--preset", "llama-350m"]).bf16
    assert not parse_args(["--preset", "llama-350m", "--no-bf16"]).bf16
    assert not parse_args(["--preset", "paper-180m", "--fp32"]).bf16


def test_no_native_bf16_note() -> None:
    cpu = torch.device("cpu")
    assert "--no-bf16" in bf16_note(True, cpu, {"avx2", "fma"})
    assert bf16_note(True, cpu, {"avx2", "avx512_bf16"}) is None and bf16_note(False, cpu, {"avx2"}) is None
    assert native_bf16({"amx_bf16"}) and not native_bf16({"avx2"})


def test_cpu_peak_covers_small_bf16_matmuls() -> None:
    """The measured bf16 peak is at least what a model-sized (64) bf16 matmul achieves: MFU <= 100 %."""
    import time

    from megapost.metrics.peak_flops import measure_matmul_tflops

    a = torch.randn(64, 64, dtype=torch.bfloat16)
    torch.matmul(a, a)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        torch.matmul(a, a)
        best = max(best, 2 * 64**3 / (time.perf_counter() - t) / 1e12)
    assert measure_matmul_tflops(torch.bfloat16, torch.device("cpu")) >= 0.5 * best


def _data_flags(prefix: str, tokenizer: str) -> list[str]:
    return ["--data-path", prefix, "--tokenizer-model", tokenizer]


@pytest.mark.integration
@pytest.mark.slow
def test_resume_keeps_data_refuses_other_data_and_keeps_history(tiny_data, tmp_path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    for ext in (".bin", ".idx", ".tokenizer.json"):
        src = Path(tiny_data.prefix + ext)
        if src.exists():
            (other / ("copy" + ext)).write_bytes(src.read_bytes())
    base = tiny_model_flags(tiny_data, **{"--runs-dir": tmp_path, "--run-name": "r", "--train-iters": 2})
    pretrain(base)
    no_data = [a for a in base if a not in (tiny_data.prefix, "--data-path")] + ["--train-iters", "3",
                                                                                 "--lr", "1e-3"]
    resumed = pretrain(no_data)  # no --data-path: the saved one
    assert "resumed from" in resumed.stdout and "schedule changed" in resumed.stdout
    # step 3 under the new schedule (lr 1e-3, warmup 2, decay over 3): the peak 1e-3; the old one (3e-3
    # decayed to 0 at step 2) would give 0
    assert read_scalars(tmp_path / "r" / "tensorboard", "train/lr")[3] == pytest.approx(1e-3)
    # the same files under another path are the same data (checked against the tag's data identity)
    moved = pretrain(base + ["--data-path", str(other / "copy"), "--train-iters", "3"])
    assert f"the same data as it was trained on, now at {other / 'copy'}" in moved.stdout
    half = other / "half"  # other data: the first half of the documents
    source, builder = IndexedDataset(tiny_data.prefix), IndexedDatasetBuilder(half)
    for i in range(len(source) // 2):
        builder.add_document(np.asarray(source[i]))
    builder.finalize()
    changed = base + ["--data-path", str(half), "--train-iters", "4", "--allow-tokenizer-mismatch"]
    refused = pretrain(changed, check=False)
    line = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 1 and line.startswith("error: resuming") and "--override-data" in line
    assert "trained on other data" in line and str(half) in line
    ok = pretrain(changed + ["--override-data"])
    assert "--override-data: continuing" in ok.stdout
    record = json.loads((tmp_path / "r" / "tensorboard" / "args.json").read_text())
    assert [launch["schedule"]["train_iters"] for launch in record["launches"]] == [2, 3, 3, 4]
    assert record["launches"][-1]["data"]["data_path"] == [str(half)]


@pytest.mark.integration
@pytest.mark.slow
def test_megatron_script_fresh_save_load_under_torchrun_and_deepspeed(tmp_path) -> None:
    """examples/megatron_llama3.sh (Megatron's Llama flags): fresh --save X --load X, then a resume."""
    ck, tb = tmp_path / "ck", tmp_path / "tb"
    with contextlib.ExitStack() as busy:  # torchrun's default port taken: the script picks a free one
        with contextlib.suppress(OSError):
            held = busy.enter_context(socket.socket())
            held.bind(("127.0.0.1", 29500))
            held.listen()
        first = run(["bash", "examples/megatron_llama3.sh", str(ck), str(tb), "", "", "--no-bf16"],
                    LAUNCHER="torchrun", DATA_CACHE_PATH=str(tmp_path / "cache"))
    port = re.search(r"MASTER_PORT not set: using free port (\d+)", first.stdout)
    assert port and port.group(1) != "29500", first.stdout[:2000]
    assert "norm=pre" in first.stdout and "no checkpoint there yet; starting a new run" in first.stdout
    for flag in ("--apply-layernorm-1p", "--manual-gc", "--attention-backend fused", "--grad-reduce-in-bf16",
                 "--tensorboard-queue-size 5", "--timing-log-level 0", "--sequence-parallel"):
        assert flag in first.stdout, flag
    unaccounted = [f for f in _script_flags() if f not in first.stdout and f not in _native_flags()]
    assert not unaccounted, unaccounted  # every Megatron flag of the script is listed at start-up
    second = run(["bash", "examples/megatron_llama3.sh", str(ck), str(tb), "", "", "--no-bf16",
                  "--train-samples", "24", "--lr-decay-samples", "24"],
                 LAUNCHER="deepspeed", MASTER_PORT=str(_free_port()), DATA_CACHE_PATH=str(tmp_path / "cache"))
    assert "resumed from" in second.stdout and "at iteration 4" in second.stdout
    assert sorted(read_scalars(tb, "train/lm_loss")) == list(range(1, 7))
    third = run(["bash", "examples/megatron_llama3.sh", str(ck), str(tb), "", "", "--no-bf16",
                 "--train-samples", "24", "--lr-decay-samples", "24"],
                LAUNCHER="torchrun", DATA_CACHE_PATH=str(tmp_path / "cache"))  # already finished
    done = [line for line in third.stdout.splitlines() if "nothing to train" in line]
    assert len(done) == 1 and "iteration 6" in done[0], third.stdout[-2000:]


def _script_flags() -> list[str]:
    """The training flags of examples/megatron_llama3.sh (its argument arrays, not the launcher's)."""
    import re

    text = (REPO / "examples" / "megatron_llama3.sh").read_text()
    body = text[text.index("MODEL_ARGS=("):text.index("$LAUNCHER ")]
    return sorted(set(re.findall(r"(?m)^\s+(--[a-z][a-z0-9-]*)", body)))


def _native_flags() -> set[str]:
    """megapost's own flags (not the Megatron-LM compatibility group): they need no start-up note."""
    from megapost.config.arguments import build_parser

    groups = build_parser()._action_groups
    return {s for g in groups if g.title != "Megatron-LM compatibility" for a in g._group_actions
            for s in a.option_strings}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
@pytest.mark.slow
def test_port_taken_during_the_corpus_build_still_one_line(tmp_path) -> None:
    """The first command on a fresh clone: `deepspeed --master_port P examples/pretrain_postnorm.sh` builds
    the corpus (an empty MEGAPOST_DATA_DIR; the wheels come from the cache), another process takes P
    while it builds, and the user still sees the one-line error (naming make train's LAUNCHER=), no
    traceback."""
    port, data = _free_port(), tmp_path / "data"
    data.mkdir()
    env = _env() | {"MEGAPOST_DATA_DIR": str(data), "MEGAPOST_RUN_DIR": str(tmp_path / "runs")}
    proc = subprocess.Popen(["deepspeed", "--master_port", str(port), "examples/pretrain_postnorm.sh",
                             "--train-iters", "1"], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    holder = socket.socket()
    try:
        deadline = time.time() + 300
        while not (data / ".prepare.lock").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)  # the build has started (it holds its lock): the port was free until now
        assert (data / ".prepare.lock").exists() and proc.poll() is None, "the corpus build did not start"
        holder.bind(("", port))
        holder.listen()
        out, err = proc.communicate(timeout=600)
    finally:
        holder.close()
        if proc.poll() is None:
            proc.kill()
    assert "default corpus built" in out + err  # the race window really was the build
    assert proc.returncode != 0
    line = f"error: port {port} (MASTER_PORT) is already in use"
    assert line in out + err and 'make train LAUNCHER="--master_port' in out + err
    assert "Traceback" not in out + err, out + err
    ours = [t for t in (out + err).splitlines() if "error:" in t]
    assert len(ours) == 1, ours


def _env() -> dict[str, str]:
    from launch_utils import child_env

    return child_env()


@pytest.mark.integration
@pytest.mark.slow
def test_one_tensorboard_run_and_readme_tags_exist(tiny_data, tmp_path) -> None:
    flags = tiny_model_flags(tiny_data, **{"--tensorboard-dir": tmp_path / "tb", "--train-iters": 4,
                                           "--plugins": "collapse_metrics", "--collapse-interval": 2})
    pretrain(flags)
    tb = tmp_path / "tb"
    assert [p for p in tb.rglob("*tfevents*") if p.parent != tb] == []  # no runs of its own inside
    assert len(read_scalars(tb, "collapse_layers/t_sim/L01/attn/y")) == 2
    ratio = read_scalars(tb, "collapse/grad_ratio")
    log_ratio = read_scalars(tb, "collapse/log10_grad_ratio")
    assert all(log_ratio[s] == pytest.approx(math.log10(v), abs=1e-5) for s, v in ratio.items())
    tags = scalar_tags(tb)
    import re

    readme = "\n".join(p.read_text() for p in (REPO / "README.md", *sorted(REPO.glob("docs/*.md"))))
    conditional = {"collapse/alerts", "collapse/state", "collapse/depth_profiles",  # text / image
                   "collapse/heatmaps", "collapse/alarm/collapsed_at_step",  # only once collapsed
                   "collapse/alarm/early_warning_at_step", "collapse/alarm/transition_at_step"}  # once warned
    named = set(re.findall(r"`(collapse/[a-z0-9_/]+)`", readme)) - conditional
    missing = {t for t in named if t not in tags and not any(x.startswith(t) for x in tags)}
    assert not missing, missing


def test_torchrun_failure_report_names_the_one_line(tmp_path, monkeypatch) -> None:
    """The rank's line in TORCHELASTIC_ERROR_FILE is what torch's own failure table shows as the root
    cause (read by torch's ProcessFailure / ChildFailedError, as the elastic agent does)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from megapost.runtime.launcher_report import record_for_launcher

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    line = "error: --swiglue: unknown flag (nearest: --swiglu)"
    record_for_launcher(line)
    report = ChildFailedError("megapost.pretrain", {0: ProcessFailure(0, 1234, 1, str(path))}).format_msg()
    assert f"traceback : {line}" in report and "To enable traceback" not in report
