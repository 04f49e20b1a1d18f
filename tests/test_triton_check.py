"""The Triton kernels' start-up check (megapost.kernels.triton_check, megapost.train.build.checked_fusion)
in Triton's CPU interpreter (conftest.py's ``interpreter`` fixture): a failure injected into one kernel's
first launch, or a wrong result, takes that fusion (only) onto its torch path, the start-up line names the
kernel and the error, and a model with every kernel failed computes what ``--no-triton-kernels`` does."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from megapost.kernels import triton_common
from megapost.model import LlamaModel, ModelConfig
from megapost.model.fusion import Fusion, parse_fusion, set_kernel_fusion
from megapost.train.build import checked_fusion
from megapost.utils.op_count import count_ops

pytest.importorskip("triton") if sys.platform != "linux" else None

CFG = ModelConfig(vocab_size=96, num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                  seq_length=16, norm_position="post")
CPU = torch.device("cpu")


def _inject(monkeypatch: pytest.MonkeyPatch, kernel: str, fault: Callable[[list[Any]], None]) -> list[int]:
    """``triton_common.jitted(kernel)``'s first launch runs ``fault(args)`` (raise, or corrupt an output
    after the real launch) instead of / after the kernel; returns the launch count."""
    real, launches = triton_common.jitted, [0]

    class Faulty:
        def __init__(self, grid: Any) -> None:
            self.grid = grid

        def __call__(self, *args: Any, **kwargs: Any) -> None:
            launches[0] += 1
            if launches[0] == 1 and fault is _raise:
                fault(list(args))
            real(kernel)[self.grid](*args, **kwargs)
            if launches[0] == 1:
                fault(list(args))

    def jitted(name: str) -> Any:
        if name != kernel:
            return real(name)
        return type("K", (), {"__getitem__": lambda _, grid: Faulty(grid)})()

    monkeypatch.setattr(triton_common, "jitted", jitted)
    for mod in ("triton_norm", "triton_rope", "triton_swiglu"):
        monkeypatch.setattr(sys.modules[f"megapost.kernels.{mod}"], "jitted", jitted)
    return launches


def model_step(cfg: ModelConfig, fusion: Fusion, dtype: torch.dtype) -> tuple[torch.Tensor, list[Any]]:
    torch.manual_seed(0)
    model = LlamaModel(cfg).to(dtype)
    set_kernel_fusion(model, fusion)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    logits = model(tokens)
    logits.float().square().mean().backward()
    return logits.detach(), [p.grad for p in model.parameters()]


def _raise(args: list[Any]) -> None:
    raise RuntimeError("Failed to compile launcher: Python.h: No such file or directory")


def _check(dtype: torch.dtype = torch.bfloat16) -> tuple[Any, dict[str, str]]:
    return checked_fusion(parse_fusion("auto"), CPU, dtype, CFG, 1)


def test_all_kernels_pass_the_check(interpreter: None) -> None:
    fusion, failed = _check()
    assert failed == {} and fusion.triton_off == frozenset()
    assert triton_common.triton_note(CPU, ["norm", "rope", "swiglu"], True, failed).startswith(
        "--kernel-fusion norm, rope, swiglu: Triton kernels on cpu")


def test_fp32_auto_checks_nothing(interpreter: None, monkeypatch: pytest.MonkeyPatch) -> None:
    launches = _inject(monkeypatch, "add_rms_norm_fwd", _raise)
    assert _check(torch.float32) == (parse_fusion("auto"), {}) and launches == [0]  # no Triton there


def test_a_failed_launch_takes_only_its_fusion_to_torch(interpreter: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _inject(monkeypatch, "add_rms_norm_bwd", _raise)
    fusion, failed = _check()
    assert fusion.triton_off == {"norm"} and list(failed) == ["norm"]
    note = triton_common.triton_note(CPU, ["norm", "rope", "swiglu"], True, failed)
    print(note)
    assert note.startswith("--kernel-fusion rope, swiglu: Triton kernels on cpu")
    assert ("--kernel-fusion norm: torch path on cpu, its Triton kernel add_rms_norm_backward: RuntimeError: "
            "Failed to compile launcher: Python.h: No such file or directory at the start-up check") in note
    # the run continues: the norm's torch path (no megapost.add_rms_norm op), the others' kernels
    ops = count_ops(lambda: model_step(CFG, fusion, torch.bfloat16))
    assert "megapost.add_rms_norm" not in ops.by_name and "megapost.add_rms_norm_backward" not in ops.by_name
    assert ops.by_name["megapost.rope"] > 0 and ops.by_name["megapost.swiglu"] > 0


def test_a_wrong_result_is_a_failure(interpreter: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def corrupt(args: list[Any]) -> None:
        args[2].add_(1.0)  # OUT of swiglu_rows

    _inject(monkeypatch, "swiglu_rows", corrupt)
    fusion, failed = _check()
    assert fusion.triton_off == {"swiglu"}
    assert failed["swiglu"].startswith("swiglu: Mismatch: max |diff| / max |torch|")


def test_every_kernel_failed_computes_what_no_triton_kernels_does(interpreter: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for kernel in ("add_rms_norm_fwd", "rope_rows", "swiglu_rows"):
        _inject(monkeypatch, kernel, _raise)
    fusion, failed = _check()
    assert fusion.triton_off == {"norm", "rope", "swiglu"}
    got, got_g = model_step(CFG, fusion, torch.bfloat16)
    want, want_g = model_step(CFG, parse_fusion("auto", triton=False), torch.bfloat16)  # --no-triton-kernels
    # not vacuous: the fallen run dispatches none of the kernels' ops, the default run all of them
    ops = [count_ops(lambda f=f: model_step(CFG, f, torch.bfloat16)).by_name
           for f in (fusion, parse_fusion("auto"))]
    kernels = {"megapost.add_rms_norm", "megapost.rope", "megapost.swiglu", "megapost.swiglu_backward"}
    assert not kernels & set(ops[0]) and kernels <= set(ops[1])
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_g, want_g, strict=True))
