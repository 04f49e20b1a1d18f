"""The planner's closed forms against the real model, DeepSpeed's estimators and Megatron's anchors."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from megapost.model import LlamaModel, ModelConfig, TransformerBlock
from megapost.model.fusion import parse_fusion, set_kernel_fusion
from megapost.model.placements import PLACEMENTS
from megapost.plan.__main__ import main as plan_main
from megapost.plan.counts import parameter_counts, stage_layers, stage_parameters
from megapost.plan.memory import Layout, Precision, layer_activation_bytes, model_state_bytes, stage_memory

SMALL = dict(vocab_size=512, num_layers=3, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
             seq_length=32)


PLACEMENT_CASES = [(p, False) for p in PLACEMENTS] + [("post", True), ("hybrid", True), ("dyt", True)]


@pytest.mark.parametrize("norm, qk_norm", PLACEMENT_CASES)
def test_parameter_counts_match_the_model(norm, qk_norm):
    cfg = ModelConfig(**{**SMALL, "num_layers": 4}, norm_position=norm, qk_norm=qk_norm,
                      mix_post_fraction=0.5)
    counts = parameter_counts(cfg)
    model = LlamaModel(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    assert counts.per_layer == sum(p.numel() for p in model.layers[0].parameters())
    # each pipeline stage holds what the model's modules of that stage hold
    for pp in (2, 3):
        first, layers = 0, stage_layers(cfg.num_layers, pp)
        for stage, n in enumerate(layers):
            want = sum(p.numel() for blk in model.layers[first:first + n] for p in blk.parameters())
            want += sum(p.numel() for p in model.embedding.parameters()) if stage == 0 else 0
            want += sum(p.numel() for p in model.head.parameters()) if stage == pp - 1 else 0
            assert stage_parameters(cfg, 1, pp, stage) == want, (pp, stage)
            first += n
    # TP shards everything but the norm parameters (and DyT's embedding scalar)
    gains = sum(p.numel() for p in model.parameters() if p.ndim == 1)
    assert 2 * (stage_parameters(cfg, 2, 1, 0) - gains) == counts.total - gains


def test_stage_layers_match_deepspeed_partition():
    assert stage_layers(4, 3) == (2, 1, 1) and stage_layers(48, 8) == (6,) * 8
    assert sum(stage_layers(7, 4)) == 7


def _saved_bytes(cfg: ModelConfig, dtype: torch.dtype, batch: int = 3, fusion: str = "auto") -> int:
    """Bytes of every storage autograd keeps for one block's backward (weights aside), counted once. The
    weights are views of one flat buffer, as DeepSpeed's flat parameter groups hold them (so the packed
    GEMMs stack them without a copy)."""
    block = TransformerBlock(cfg, 1).to(dtype)
    set_kernel_fusion(block, parse_fusion(fusion))
    params = list(block.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offsets = [0, *itertools.accumulate(p.numel() for p in params)]
    for p, start, end in zip(params, offsets, offsets[1:], strict=False):
        p.data = flat[start:end].view_as(p)
    weights = {p.untyped_storage()._cdata for p in block.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in weights:
            saved[st._cdata] = st.nbytes()
        return t

    x = torch.randn(batch, cfg.seq_length, cfg.hidden_size, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm, qk_norm", PLACEMENT_CASES)
def test_block_activation_bytes_equal_what_autograd_saves(dtype, norm, qk_norm):
    """Every placement's norms (Peri-LN's output norms, HybridNorm's Q/K/V norms, DyT) and --qk-norm."""
    cfg = ModelConfig(**{**SMALL, "seq_length": 64}, norm_position=norm, qk_norm=qk_norm)
    e = 2 if dtype == torch.bfloat16 else 4
    assert _saved_bytes(cfg, dtype) == layer_activation_bytes(cfg, 3, 1, False, e, packed=True)
    assert _saved_bytes(cfg, dtype, fusion="none") == layer_activation_bytes(cfg, 3, 1, False, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_counts_and_activations(dtype):
    cfg = ModelConfig(**{**SMALL, "seq_length": 64}, num_query_groups=2)
    model_count = sum(p.numel() for p in LlamaModel(cfg).parameters())
    assert parameter_counts(cfg).total == cfg.num_parameters() == model_count
    e = 2 if dtype == torch.bfloat16 else 4
    assert _saved_bytes(cfg, dtype) == layer_activation_bytes(cfg, 3, 1, False, e, packed=True)
    assert _saved_bytes(cfg, dtype, fusion="none") == layer_activation_bytes(cfg, 3, 1, False, e)


@pytest.mark.parametrize("params", [10**6, 6_738_415_616, 123_456_789])
@pytest.mark.parametrize("gpus", [1, 2, 8, 64])
def test_bf16_zero2_model_states_equal_deepspeed_estimator(params, gpus):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    ours = sum(model_state_bytes(params, gpus, 2, bf16=True).values())
    _, gpu_mem = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=gpus, cpu_offload=False)
    assert abs(ours - gpu_mem) <= 2  # DeepSpeed rounds 18P/N once, we round per term


@pytest.mark.parametrize("dp", [1, 4, 32])
def test_bf16_zero1_matches_megatron_bytes_per_parameter(dp):
    """Megatron's theoretical_memory_usage.py: 18 bytes/parameter without its distributed optimizer,
    6 + 12/DP with it (bf16 weights, fp32 grads, fp32 master + Adam). DeepSpeed's BF16_Optimizer
    (megapost's bf16 ZeRO-1) is exactly the latter: with ``immediate_grad_update`` the bf16 param grads
    are freed as they are added into the fp32 accumulator."""
    params = 12_000_000
    ours = sum(model_state_bytes(params, dp, 1, bf16=True).values())
    assert ours == params * 6 + 12 * params // dp
    if dp == 1:
        assert ours == 18 * params


def test_memory_phases_and_checkpointing():
    cfg = ModelConfig(**SMALL)
    prec = Precision(bf16=True, reduce_bucket_size=10**6)
    full = stage_memory(cfg, Layout(1, 1, 2, 1, 4, 2), prec, 0)
    ckpt = stage_memory(cfg, Layout(1, 1, 2, 1, 4, 2, checkpoint=True), prec, 0)
    assert ckpt.activations < full.activations and ckpt.weights == full.weights
    first = stage_memory(cfg, Layout(1, 3, 1, 1, 4, 8), prec, 0)
    last = stage_memory(cfg, Layout(1, 3, 1, 1, 4, 8), prec, 2)
    assert first.activations > last.activations - 1  # 3 micro-batches in flight vs 1 (+ logits)


def _plan_json(capsys, *argv: str) -> dict:
    plan_main([*argv, "--json"])
    return json.loads(capsys.readouterr().out)


def test_cli_paper_180m(capsys):
    out = _plan_json(capsys, "--preset", "paper-180m", "--gpus", "8", "--gpu-memory-gb", "80")
    cfg = ModelConfig(vocab_size=32000, num_layers=48, hidden_size=512, ffn_hidden_size=1536,
                      num_attention_heads=4, seq_length=2048)
    assert out["parameters"]["total"] == cfg.num_parameters()
    assert out["flops_per_token"] == cfg.flops_per_token()
    best = out["recommended"]
    assert best["fits"] and best["peak_gb"] <= 72.0 and best["tokens_per_second"] > 0
    assert all(r["layout"]["zero_stage"] <= 1 for r in out["fitting"] if r["layout"]["pp"] > 1)


def test_cli_model_flags_and_tiny_memory(capsys):
    out = _plan_json(capsys, "--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "768",
                     "--seq-length", "256", "--global-batch-size", "8", "--gpus", "4",
                     "--gpu-memory-gb", "0.02")
    assert out["model"]["num_layers"] == 4 and out["not_fitting"]
    assert all(r["peak_gb"] <= 0.018 for r in out["fitting"])


@pytest.mark.parametrize("gpus", [8, 64, 512])
def test_llama_7b_plans(capsys, gpus):
    out = _plan_json(capsys, "--preset", "llama-7b", "--gpus", str(gpus), "--gpu-memory-gb", "80")
    assert abs(out["parameters"]["total"] - 6.74e9) < 0.01e9
    assert out["recommended"] is not None and out["recommended"]["peak_gb"] <= 72.0


def test_cli_bad_cluster_is_one_line_error():
    with pytest.raises(SystemExit, match="--gpus must be >= 1"):
        plan_main(["--gpus", "0"])


def test_cli_tiny_model_step_time_is_never_zero_and_names_its_peak(capsys):
    """A CPU-sized model at the default (H100) peak: the step time keeps its digits, the peak says where
    it comes from; --fp32 (the trainer's flag) plans fp32."""
    plan_main(["--preset", "tiny-cpu", "--gpus", "1"])
    text = capsys.readouterr().out
    assert "0.00 s/step" not in text
    assert "989 TFLOP/s peak (default: H100 SXM bf16 dense; --peak-tflops to set)" in text
    out = _plan_json(capsys, "--preset", "tiny-cpu", "--gpus", "1", "--fp32", "--peak-tflops", "0.2")
    assert out["cluster"]["precision"] == "fp32" and out["cluster"]["peak_source"] == "--peak-tflops"
    best = out["recommended"]
    flops = out["flops_per_token"] * 16 * 128  # tiny-cpu: global batch 16 x seq 128, one GPU at MFU 0.4
    tokens = best["layout"]["micro_batch"] * 128  # saturating MFU, half at 256 tokens; one GPU: no comm
    assert best["step_seconds"] == pytest.approx(flops / (0.2e12 * 0.4 * tokens / (tokens + 256)), rel=1e-6)


def test_collapse_risk_needs_no_cluster(capsys):
    """A collapse-risk question without --gpus: the model and both risk lines, no layout search."""
    plan_main(["--preset", "paper-180m", "--norm-position", "post", "--lr", "8e-4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["cluster"] is None and "recommended" not in out
    assert out["collapse_risk"]["line"].startswith("collapse risk")
    assert "lr*" in out["delayed_collapse"]["line"]
    plan_main(["--preset", "paper-180m", "--lr", "8e-4"])
    text = capsys.readouterr().out.splitlines()
    assert text[3] == "layouts: none asked (--gpus N to lay the model out)" and len(text) == 5
