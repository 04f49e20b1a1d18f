"""The backward overlap of megapost.parallel.async_linear, in one process over a fake two-rank TP group
whose ranks hold the same numbers (an all-reduce doubles, an all-gather repeats, a reduce-scatter
doubles this rank's slice): the input-gradient collective is issued before the weight-gradient GEMMs
and waited for after them, and a transformer block's gradients equal the plain mapping's bit for bit
(unfused and packed Q/K/V and W_1/W_3, grouped K/V heads shared by two ranks, with and without SP)."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import tiny_config

from megapost.model import build_block
from megapost.model.fusion import parse_fusion, set_kernel_fusion
from megapost.parallel import ParallelState
from megapost.parallel import async_linear as A
from megapost.parallel import collectives as C
from megapost.parallel import layers as L
from megapost.parallel.parallelize import parallelize_block


class _Done:
    def __init__(self, events: list[str], result: torch.Tensor) -> None:
        self.events, self.result = events, result

    def wait(self) -> torch.Tensor:
        self.events.append("wait")
        return self.result


@pytest.fixture
def fake_tp2(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Two identical TP ranks, this one rank 0; the issue of every collective and every deferred
    weight-gradient GEMM recorded in the returned list."""
    events: list[str] = []

    def all_reduce(x: torch.Tensor, group: object, op: object = None) -> _Done:
        events.append("issue all_reduce")
        return _Done(events, x.contiguous().clone() * 2)

    def reduce_scatter(x: torch.Tensor, dim: int, group: object) -> _Done:
        events.append("issue reduce_scatter")
        return _Done(events, (x * 2).chunk(2, dim)[0].contiguous())

    def gemm(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        events.append("gemm")
        return real_gemm(grad, x)

    real_gemm = A.weight_grad
    monkeypatch.setattr(C, "group_size", lambda group: 2)
    monkeypatch.setattr(C, "start_all_reduce", all_reduce)
    monkeypatch.setattr(C, "start_reduce_scatter", reduce_scatter)
    monkeypatch.setattr(C, "all_gather", lambda x, dim, group: torch.cat([x, x], dim).contiguous())
    monkeypatch.setattr(C, "split", lambda x, dim, group: x.chunk(2, dim)[0].contiguous())
    monkeypatch.setattr(L, "tp_rank_size", lambda group: (0, 2))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(A, "weight_grad", gemm)
    return events


def _block_grads(overlap: bool, sp: bool, fusion: str, **model: object) -> tuple[dict, torch.Tensor]:
    """One forward and backward of a parallelized block: its parameters' and the input's gradients."""
    cfg = tiny_config(**model)
    pstate = ParallelState(tp_size=2, tp_group=object(), sequence_parallel=sp,
                           async_tensor_model_parallel_allreduce=overlap)
    torch.manual_seed(0)
    block = parallelize_block(build_block(cfg, 1), pstate)
    set_kernel_fusion(block, parse_fusion(fusion))
    seq = cfg.seq_length // 2 if sp else cfg.seq_length
    x = torch.randn(2, seq, cfg.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(2, seq, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    (block(x) * g).sum().backward()
    return {n: p.grad for n, p in block.named_parameters()}, x.grad


CASES = [(False, "none", {}), (True, "none", {}), (False, "qkv,w13", {}), (True, "qkv,w13", {}),
         (False, "none", {"num_query_groups": 1}), (True, "qkv,w13", {"num_query_groups": 1})]


@pytest.mark.parametrize(("sp", "fusion", "model"), CASES)
def test_block_gradients_equal_the_plain_mapping_bit_for_bit(fake_tp2: list[str], sp: bool, fusion: str,
                                                             model: dict) -> None:
    plain, plain_dx = _block_grads(False, sp, fusion, **model)
    assert "gemm" not in fake_tp2
    fake_tp2.clear()
    grads, dx = _block_grads(True, sp, fusion, **model)
    assert fake_tp2.count("gemm") == (2 if "qkv" in fusion else 5)  # the deferred GEMMs ran
    assert plain.keys() == grads.keys()
    for name in plain:
        assert grads[name] is not None and torch.equal(grads[name], plain[name]), name
    assert torch.equal(dx, plain_dx)


@pytest.mark.parametrize(("sp", "fusion"), [(False, "none"), (True, "none"), (True, "qkv,w13")])
def test_collective_issued_before_the_weight_gemms_and_waited_after(fake_tp2: list[str], sp: bool,
                                                                     fusion: str) -> None:
    """In backward each sublayer's entry issues its input-gradient collective, then runs its projections'
    weight-gradient GEMMs (3 then 2 unfused: Q/K/V, W_1/W_3; 1 each packed), then waits."""
    _block_grads(True, sp, fusion)
    issue = "issue reduce_scatter" if sp else "issue all_reduce"
    entries = [i for i, e in enumerate(fake_tp2) if e == "gemm" and fake_tp2[i - 1] == issue]
    assert len(entries) == 2, fake_tp2  # the MLP's entry, then attention's (backward order)
    per_entry = [2, 3] if fusion == "none" else [1, 1]
    for start, gemms in zip(entries, per_entry, strict=True):
        assert fake_tp2[start:start + gemms] == ["gemm"] * gemms, fake_tp2
        assert fake_tp2[start + gemms] == "wait", fake_tp2


OFF = "--no-async-tensor-model-parallel-allreduce"


@pytest.mark.integration
def test_trainer_tp2_sp_dp2_equals_the_blocking_path_bit_for_bit() -> None:
    """The real trainer at TP 2 + SP x DP 2 (2 micro-batches per step): overlap on (the default) against
    --no-async-tensor-model-parallel-allreduce, losses, gradient norms and final weights bit for bit —
    DeepSpeed's ZeRO-1 in fp32 (with and without activation recomputation, and without SP), bf16 (packed
    Q/K/V and W_1/W_3, the fp32 gradient-accumulation fusion) and the native engine
    (--use-distributed-optimizer)."""
    from dist_utils import RunSpec, run_layouts
    from native_train import NATIVE, params_equal

    def spec(*flags: str, **kw: object) -> RunSpec:
        return RunSpec(**{"tp": 2, "sp": True, "steps": 4, "global_batch": 8, "micro_batch": 2,
                          "flags": flags, **kw})  # type: ignore[arg-type]

    variants = [(), ("--bf16",), NATIVE]
    specs = [spec(*v, *off) for v in variants for off in ((), (OFF,))]
    specs += [spec(*off, checkpoint_activations=True) for off in ((), (OFF,))]
    specs += [spec(*off, sp=False) for off in ((), (OFF,))]  # TP 2 without SP: the all-reduce
    results = [ranks[0] for ranks in run_layouts(specs, dp=2)]
    for on, off in zip(results[::2], results[1::2], strict=True):
        print(on["spec"]["flags"], on["losses"])
        assert on["losses"] == off["losses"] and on["grad_norms"] == off["grad_norms"]
        assert params_equal(on["params"], off["params"])
    assert results[0]["losses"] != results[2]["losses"]  # bf16 ran in bf16


def test_cuda_connections_set_at_start_up_where_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA at TP > 1 with the overlap: CUDA_DEVICE_MAX_CONNECTIONS=1 set before CUDA initialises where
    unset, another value kept with a line saying so; nothing at TP 1 or with the overlap off; the flag
    at TP 1 is a note."""
    from megapost.runtime.distributed import tp_overlap_env

    key = "CUDA_DEVICE_MAX_CONNECTIONS"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv(key, "0")  # recorded, so the teardown restores the variable as it was
    monkeypatch.delenv(key)
    assert tp_overlap_env(1, True) is None and tp_overlap_env(2, False) is None and key not in os.environ
    assert "changes nothing at TP 1" in tp_overlap_env(1, False)
    assert "=1 set" in tp_overlap_env(2, True) and os.environ[key] == "1"
    assert tp_overlap_env(2, True) is None  # already 1
    monkeypatch.setenv(key, "8")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=8" in tp_overlap_env(4, True) and os.environ[key] == "8"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tp_overlap_env(2, True) is None  # CPU ranks: nothing to order


@pytest.mark.integration
def test_native_pipeline_tp2_sp_pp2_equals_the_blocking_path_bit_for_bit() -> None:
    """TP 2 + SP x PP 2 on the native engine's pipeline (torch's pipelining stages, 4 micro-batches):
    overlap on against off, losses, gradient norms and final weights bit for bit."""
    from dist_utils import RunSpec, run_layouts
    from native_train import NATIVE, params_equal

    specs = [RunSpec(tp=2, sp=True, pp=2, steps=3, global_batch=8, micro_batch=2, flags=(*NATIVE, *off))
             for off in ((), (OFF,))]
    on, off = (ranks[0] for ranks in run_layouts(specs, dp=1))
    print(on["losses"], off["losses"])
    assert on["losses"] == off["losses"] and on["grad_norms"] == off["grad_norms"]
    assert params_equal(on["params"], off["params"])
