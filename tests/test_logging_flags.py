"""Megatron-LM's --log-params-norm and --log-num-zeros-in-grad (megapost.config.logging_flags) beside an
independent computation on the same step of the real trainer, and the --log-*-to-tensorboard family's
scalars as written."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from launch_utils import read_scalars, scalar_tags, tiny_model_flags


def _zeros_of_module_grads(engine: Any) -> int:
    """fp32 ZeRO-0 on one rank: the reduced gradients are the parameters' own ``.grad``."""
    return sum(int((p.grad == 0).sum()) for p in engine.module.parameters())


def _flat_fp32(engine: Any, kind: str) -> list[torch.Tensor]:
    """DeepSpeed's bf16 optimizer's flat fp32 buffers (one per group) at one rank: ``masters`` or
    ``grads``, trimmed to the parameters' elements (the padding is not a parameter)."""
    opt = engine.optimizer
    flats = opt.fp32_groups_flat_partition if kind == "masters" else opt.fp32_groups_gradients_flat
    sizes = [sum(p.numel() for p in group) for group in opt.bf16_groups]
    return [flat.flatten()[:n] for flat, n in zip(flats, sizes, strict=True)]


def _native_flat(engine: Any, kind: str) -> list[torch.Tensor]:
    """The native engine's distributed optimizer at one rank: each bucket's fp32 ``masters`` or averaged
    ``grads`` (at DP 1 a bucket has no padding)."""
    return [b.master if kind == "masters" else b.grad for b in engine.dist.buckets]


def _measure(argv: list[str], bf16: bool, native: bool = False) -> dict[str, float]:
    """Train; record the independent zero count at the last step's optimizer step (gradients reduced,
    not yet applied) and the independent norm of the fp32 masters after it."""
    from megapost.pretrain import run
    from megapost.train.trainer import Trainer

    seen: dict[str, float] = {}
    before, close = Trainer.before_optimizer_step, Trainer.close

    def count(self: Trainer) -> None:
        if native:
            seen["zeros"] = sum(int((g == 0).sum()) for g in _native_flat(self.engine, "grads"))
        elif bf16:
            seen["zeros"] = sum(int((g == 0).sum()) for g in _flat_fp32(self.engine.ds, "grads"))
        else:
            seen["zeros"] = _zeros_of_module_grads(self.engine)
        before(self)

    def norm(self: Trainer) -> None:
        masters = (_native_flat(self.engine, "masters") if native else _flat_fp32(self.engine.ds, "masters")
                   if bf16 else list(self.engine.module.parameters()))
        seen["norm"] = math.sqrt(sum(float(m.detach().double().pow(2).sum()) for m in masters))
        seen["module_norm"] = math.sqrt(sum(float(p.detach().double().pow(2).sum())
                                            for p in self.engine.module.parameters()))
        close(self)

    Trainer.before_optimizer_step, Trainer.close = count, norm  # type: ignore[method-assign]
    try:
        run(argv)
    finally:
        Trainer.before_optimizer_step, Trainer.close = before, close  # type: ignore[method-assign]
    return seen


# fp32 also walks the TensorBoard family: scalars every 2nd iteration, no lr, batch and world size
TB_FAMILY = {"--tensorboard-log-interval": 2, "--no-log-learnig-rate-to-tensorboard": True,
             "--log-batch-size-to-tensorboard": True, "--log-world-size-to-tensorboard": True}


@pytest.mark.parametrize("bf16,native", [(False, False), (True, False), (True, True)],
                         ids=["fp32", "bf16", "native-bf16"])
def test_params_norm_and_zeros_match_an_independent_count(tiny_data, tmp_path, capsys, bf16: bool,
                                                          native: bool) -> None:
    """DeepSpeed's engine in fp32 and bf16, and the native engine (--use-distributed-optimizer) in bf16."""
    tb = tmp_path / "tb"
    argv = tiny_model_flags(tiny_data, **{"--train-iters": 4, "--log-interval": 4, "--tensorboard-dir": tb,
                                          "--log-params-norm": True, "--log-num-zeros-in-grad": True,
                                          "--use-distributed-optimizer": native,
                                          "--bf16": bf16, "--peak-tflops": 1, **({} if bf16 else TB_FAMILY)})
    seen = _measure(argv, bf16, native)
    out = capsys.readouterr().out
    line = re.search(r"iteration +4/4 .*params norm ([\d.]+) \| num zeros (\d+) \|", out)
    assert line, out[-3000:]
    logged_norm = read_scalars(tb, "train/params_norm")[4]
    logged_zeros = read_scalars(tb, "train/num_zeros")[4]
    assert set(read_scalars(tb, "train/num_zeros")) == {4}  # counted on the logging step only
    with capsys.disabled():
        print(f"\n{'bf16' if bf16 else 'fp32'} step 4: params norm logged {logged_norm:.6f} "
              f"(line {line.group(1)}) vs independent {seen['norm']:.6f} (bf16 module weights "
              f"{seen['module_norm']:.6f}); num zeros logged {logged_zeros:.0f} (line {line.group(2)}) "
              f"vs independent {seen['zeros']}")
    assert seen["zeros"] > 0  # the embedding rows of tokens absent from the batch: a real count
    assert int(line.group(2)) == seen["zeros"] and logged_zeros == seen["zeros"]
    assert logged_norm == pytest.approx(seen["norm"], rel=1e-6)
    assert float(line.group(1)) == pytest.approx(seen["norm"], abs=1e-3)
    if bf16:  # the fp32 masters, not the bf16 module copy
        assert seen["module_norm"] != pytest.approx(seen["norm"], rel=1e-6)
    else:
        assert set(read_scalars(tb, "train/lm_loss")) == {2, 4}
        assert "train/lr" not in scalar_tags(tb)
        assert read_scalars(tb, "train/batch_size") == {2: 4.0, 4: 4.0}
        assert read_scalars(tb, "train/world_size") == {2: 1.0, 4: 1.0}


@pytest.mark.integration
def test_logging_flags_add_no_host_sync_on_quiet_steps(tiny_data) -> None:
    from host_sync_audit import ITERATIONS, count_syncs

    flags = ["--global-batch-size", "8", "--bf16", "--log-params-norm", "--log-num-zeros-in-grad"]
    (sites,) = count_syncs(tiny_data, 1, flags)
    assert sites.pop(ITERATIONS) == 2
    assert not sites, f"host syncs on non-logging steps with the logging flags: {sites}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--zero-stage", "2"], ["--tensor-model-parallel-size", "2"],
                                    ["--use-distributed-optimizer"]],
                         ids=["DP2-ZeRO-2", "TP2", "DP2-native"])
def test_params_norm_and_zeros_count_each_element_once_over_ranks(tiny_data, tmp_path, layout) -> None:
    """The same training at 2 ranks (data- or tensor-parallel) logs the 1-rank run's values: ZeRO
    partitions summed once, tensor-parallel replicas counted once."""
    from launch_utils import pretrain

    values = []
    for name, ranks, extra in (("one", 1, []), ("two", 2, layout)):
        tb = tmp_path / name
        pretrain([*tiny_model_flags(tiny_data, **{"--train-iters": 2, "--log-interval": 2,
                                                  "--tensorboard-dir": tb, "--peak-tflops": 1}),
                  "--log-params-norm", "--log-num-zeros-in-grad", *extra], nprocs=ranks)
        values.append((read_scalars(tb, "train/params_norm")[2], read_scalars(tb, "train/num_zeros")[2]))
    (norm1, zeros1), (norm2, zeros2) = values
    print(f"{layout}: params norm {norm2:.6f} vs 1 rank {norm1:.6f}; num zeros {zeros2:.0f} vs {zeros1:.0f}")
    assert norm2 == pytest.approx(norm1, rel=1e-5)
    assert zeros2 == zeros1 > 0
