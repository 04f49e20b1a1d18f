"""Theorem 3.8 (ii) through the plugin: exactly collapsed hidden states and an LM head that outputs the
frequency distribution of the labels give zero parameter gradients in every collapsed layer.

Construction. All tokens of a sequence are the same id, so X_1^1 has identical rows. Attention keeps
rows identical even with RoPE: q and k depend on the position, but every row of V is the same v, so
any causal softmax mixture of V is v; SwiGLU and RMSNorm act row by row. Hence every X_k^l, Y_k^l
and X^H = h 1^T is row-constant (t_sim = 1). The LM head W = log(p) h^T / ||h||^2 then produces
logits log p at every position (softmax = p, the labels' frequency distribution, which has full
support because every label occurs), so the loss equals L_freq and dL/dlogits_i = p - e_{y_i} sums
to n p - c = 0 over the positions: the zero-column-sum gradient that propagates backward.

The model and the loss run in float64 (in fp32 the softmax of log p misses p by ~1e-7). What is left
(~1e-8 Post-Norm, ~1e-7 Pre-Norm, against >1e-3 for the same layers on ordinary tokens) comes from
RMSNorm, which computes in fp32 internally, so each row of the gradient is rounded separately and the
column sums are zero only to fp32 precision.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from collapse_helpers import make_plugin, random_batches, run_step, small_config

from megapost.model import LlamaModel

COUNTS = [4, 2, 2, 2, 2, 2, 1, 1]  # labels of one sequence of 16 (every label of the vocabulary occurs)


def collapsed_batches(vocab: int, token: int) -> list[dict[str, torch.Tensor]]:
    labels = torch.tensor([v for v, c in enumerate(COUNTS) for _ in range(c)])
    gen = torch.Generator().manual_seed(0)
    rows = torch.stack([labels[torch.randperm(len(labels), generator=gen)] for _ in range(2)])
    tokens = torch.full_like(rows, token)
    return [{"tokens": tokens, "labels": rows, "loss_mask": torch.ones(rows.shape)} for _ in range(2)]


def lm_loss64(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy(logits.double().flatten(0, 1), labels.flatten(), reduction="none")
    return (ce * mask.flatten().double()).sum() / mask.sum()


@torch.no_grad()
def set_frequency_head(model: LlamaModel, tokens: torch.Tensor) -> None:
    x = model.embedding(tokens)
    for block in model.layers:
        x = block(x)
    if model.head.final_norm is not None:
        x = model.head.final_norm(x)
    h = x[0, 0].double()
    assert torch.allclose(x, h.to(x.dtype).expand_as(x), atol=1e-12)  # X^H is row-constant
    p = torch.tensor(COUNTS, dtype=torch.float64) / sum(COUNTS)
    model.head.lm_head.weight.copy_(torch.outer(p.log(), h) / h.dot(h))


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_collapsed_network_has_zero_layer_gradients(norm):
    cfg = small_config(norm, vocab_size=len(COUNTS), seq_length=sum(COUNTS))
    torch.manual_seed(0)
    model = LlamaModel(cfg).double()
    batches = collapsed_batches(cfg.vocab_size, token=3)
    set_frequency_head(model, batches[0]["tokens"])
    plugin = make_plugin(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    run_step(plugin, model, 1, batches, opt, loss_fn=lm_loss64)
    step = plugin.last["step_record"]
    assert step["loss"] == pytest.approx(step["freq_loss_agg"], abs=1e-12)  # output = p_freq: L = L_freq
    assert step["t_sim_embed"] == pytest.approx(1.0, abs=1e-12)
    assert step["t_sim_head"] == pytest.approx(1.0, abs=1e-12)
    for rec in plugin.last["layers"]:
        for field in ("t_sim_x", "t_sim_y") + (("t_sim_out",) if norm == "post" else ()):
            assert rec[field] == pytest.approx(1.0, abs=1e-12), (rec["layer"], field)
        assert rec["grad_norm_layer"] <= 1e-6, rec

    # the same model on ordinary tokens is not collapsed and its layers do get gradients
    run_step(plugin, model, 2, random_batches(cfg, 2, batch=2, seed=1), opt, loss_fn=lm_loss64)
    assert min(r["grad_norm_layer"] for r in plugin.last["layers"]) > 1e-3
