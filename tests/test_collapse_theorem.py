"""Theorem 3.8 (ii) through the plugin: exactly collapsed hidden states and an LM head that outputs the
frequency distribution of the labels give zero parameter gradients in every collapsed layer.

Construction. All tokens of a sequence are the same id, so X_1^1 has identical rows. Attention keeps
rows identical even with RoPE: q and k depend on the position, but every row of V is the same v, so
any causal softmax mixture of V is v; SwiGLU and RMSNorm act row by row. Hence every X_k^l, Y_k^l
and X^H = h 1^T is row-constant (t_sim = 1). The LM head W = log(p) h^T / ||h||^2 then produces
logits log p at every position (softmax = p, the labels' frequency distribution, which has full
support because every label occurs), so the loss equals L_freq and dL/dlogits_i = p - e_{y_i} sums
to n p - c = 0 over the positions: the zero-column-sum gradient that propagates backward.
"""

from __future__ import annotations

import pytest
import torch
from collapse_helpers import make_plugin, random_batches, run_step, small_config

from megapost.model import LlamaModel

COUNTS = [4, 2, 2, 2, 2, 2, 1, 1]  # labels of one sequence of 16 (every label of the vocabulary occurs)


def collapsed_batches(vocab: int, token: int) -> list[dict[str, torch.Tensor]]:
    labels = torch.tensor([v for v, c in enumerate(COUNTS) for _ in range(c)])
    gen = torch.Generator().manual_seed(0)
    rows = torch.stack([labels[torch.randperm(len(labels), generator=gen)] for _ in range(2)])
    tokens = torch.full_like(rows, token)
    return [{"tokens": tokens, "labels": rows, "loss_mask": torch.ones(rows.shape)} for _ in range(2)]


@torch.no_grad()
def set_frequency_head(model: LlamaModel, tokens: torch.Tensor) -> None:
    x = model.embedding(tokens)
    for block in model.layers:
        x = block(x)
    if model.head.final_norm is not None:
        x = model.head.final_norm(x)
    h = x[0, 0].double()
    assert torch.allclose(x, h.to(x.dtype).expand_as(x), atol=1e-6)  # X^H is row-constant
    p = torch.tensor(COUNTS, dtype=torch.float64) / sum(COUNTS)
    model.head.lm_head.weight.copy_(torch.outer(p.log(), h) / h.dot(h))


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_collapsed_network_has_zero_layer_gradients(norm):
    cfg = small_config(norm, vocab_size=len(COUNTS), seq_length=sum(COUNTS))
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    batches = collapsed_batches(cfg.vocab_size, token=3)
    set_frequency_head(model, batches[0]["tokens"])
    plugin = make_plugin(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    run_step(plugin, model, 1, batches, opt)
    step = plugin.last["step_record"]
    assert step["loss"] == pytest.approx(step["freq_loss_agg"], abs=1e-5)  # output = p_freq
    assert step["t_sim_embed"] == pytest.approx(1.0, abs=1e-6)
    assert step["t_sim_head"] == pytest.approx(1.0, abs=1e-6)
    for rec in plugin.last["layers"]:
        for field in ("t_sim_x", "t_sim_y") + (("t_sim_out",) if norm == "post" else ()):
            assert rec[field] == pytest.approx(1.0, abs=1e-6), (rec["layer"], field)
        assert rec["grad_norm_layer"] <= 1e-6, rec

    # the same model on ordinary tokens is not collapsed and its layers do get gradients
    run_step(plugin, model, 2, random_batches(cfg, 2, batch=2, seed=1), opt)
    assert min(r["grad_norm_layer"] for r in plugin.last["layers"]) > 1e-3
