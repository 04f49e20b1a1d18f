"""Named flag presets: defaults a run starts from; explicit flags still win."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # The paper's recipe exactly (Section 4 / QUANTITIES.md): 48 x 512, d_ff 1536, 4 heads, seq 2048,
    # batch 4 x 64 = 256 sequences, AdamW (0.9, 0.95), wd 0.1, 2000 warmup of 40000 cosine steps,
    # clip 1.0, paper init variances, bf16. lr 8e-4 is the paper's diagnosed collapsing run.
    "paper-180m": dict(
        num_layers=48, hidden_size=512, ffn_hidden_size=1536, num_attention_heads=4, seq_length=2048,
        micro_batch_size=4, global_batch_size=256, train_iters=40000, lr=8e-4, min_lr=0.0,
        lr_warmup_iters=2000, lr_decay_style="cosine", weight_decay=0.1, adam_beta1=0.9,
        adam_beta2=0.95, clip_grad=1.0, init_variance="paper", bf16=True, zero_stage=1, eval_interval=1000,
        eval_iters=10, save_interval=1000, log_interval=10,
    ),
    # Trains visibly (loss falling) in a few minutes on 2 CPU cores.
    "tiny-cpu": dict(
        num_layers=4, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4, seq_length=128,
        micro_batch_size=8, global_batch_size=16, train_iters=200, lr=3e-3, min_lr=3e-4,
        lr_warmup_iters=20, lr_decay_style="cosine", weight_decay=0.1, adam_beta1=0.9,
        adam_beta2=0.95, clip_grad=1.0, init_variance="paper", bf16=False, eval_interval=50,
        eval_iters=4, save_interval=0, log_interval=10,
    ),
}
