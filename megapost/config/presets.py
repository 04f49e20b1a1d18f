"""Named flag presets: defaults a run starts from; explicit flags still win.

None sets ``norm_position``: every preset runs in both placements (``--norm-position post|pre``).
Parameter counts below assume the Llama-2 SentencePiece vocabulary (32000 tokens, a multiple of 128 so
unpadded) with an untied head; ``ModelConfig.num_parameters()`` gives the count for the real vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

from megapost.model.config import ModelConfig

LADDER_VOCAB = 32000  # Llama / Llama-2 tokenizer
CHINCHILLA_TOKENS_PER_PARAMETER = 20  # Hoffmann et al. 2022: compute-optimal D ~ 20 N

# Shared by every ladder rung: AdamW (0.9, 0.95), wd 0.1, clip 1.0, cosine decay to 10% of the peak lr
# (GPT-3 Sec. 2.3 / App. B and Llama-2 Sec. 2.2 both), bf16, ZeRO-1.
_LADDER_COMMON = dict(
    lr_decay_style="cosine", weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0,
    init_variance="std", bf16=True, zero_stage=1, eval_interval=1000, eval_iters=10, save_interval=1000,
    log_interval=10,
)
GPT3_WARMUP_TOKENS = 375_000_000  # GPT-3 App. B: linear warmup over the first 375M tokens


def swiglu_ffn(hidden: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: int(8/3 d) rounded up to a multiple of 256 (4096 -> 11008)."""
    return multiple_of * math.ceil(int(8 * hidden / 3) / multiple_of)


def chinchilla_iters(model: dict[str, Any], global_batch: int, seq_length: int) -> int:
    """Optimizer steps for 20 tokens per parameter (all parameters, as Chinchilla counts them)."""
    sizes = {k: model[k] for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")}
    n = ModelConfig(vocab_size=LADDER_VOCAB, norm_position="pre", **sizes).num_parameters()
    return math.ceil(CHINCHILLA_TOKENS_PER_PARAMETER * n / (global_batch * seq_length))


def _rung(layers: int, hidden: int, heads: int, lr: float, global_batch: int, micro_batch: int,
          seq_length: int = 2048, warmup: int | None = None, ffn: int | None = None,
          **extra: Any) -> dict[str, Any]:
    """A ladder preset: shape, lr (min lr = 10%), batch, warmup (default GPT-3's 375M tokens) and a
    Chinchilla token budget at that batch and sequence length."""
    model = dict(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn or swiglu_ffn(hidden),
                 num_attention_heads=heads, seq_length=seq_length)
    tokens_per_step = global_batch * seq_length
    return dict(
        **model, **_LADDER_COMMON, micro_batch_size=micro_batch, global_batch_size=global_batch,
        lr=lr, min_lr=round(lr / 10, 12),
        lr_warmup_iters=warmup or round(GPT3_WARMUP_TOKENS / tokens_per_step),
        train_iters=chinchilla_iters(model, global_batch, seq_length), **extra,
    )


def _paper_recipe(num_layers: int) -> dict[str, Any]:
    """The paper's recipe exactly (Section 4 / QUANTITIES.md) at depth ``num_layers``: x 512, d_ff 1536,
    4 heads, seq 2048, batch 4 x 64 = 256 sequences (524,288 tokens), AdamW (0.9, 0.95), wd 0.1, 2000
    warmup of 40000 cosine steps, clip 1.0, paper init variances, bf16. lr 8e-4 is the paper's
    diagnosed collapsing run. The token budget stays the paper's at every depth, so depth is the
    only variable."""
    return dict(
        num_layers=num_layers, hidden_size=512, ffn_hidden_size=1536, num_attention_heads=4,
        seq_length=2048, micro_batch_size=4, global_batch_size=256, train_iters=40000, lr=8e-4,
        min_lr=0.0, lr_warmup_iters=2000, lr_decay_style="cosine", weight_decay=0.1, adam_beta1=0.9,
        adam_beta2=0.95, clip_grad=1.0, init_variance="paper", bf16=True, zero_stage=1,
        eval_interval=1000, eval_iters=10, save_interval=1000, log_interval=10,
    )


PRESETS: dict[str, dict[str, Any]] = {
    "paper-180m": _paper_recipe(48),  # 196.4M parameters at vocab 32000
    # Depth series at the paper's width (Post-Norm's failure depends on depth): 12 / 24 / 48 / 96 layers
    # = 73.7M / 114.6M / 196.4M / 360.0M parameters (Pre-Norm, vocab 32000).
    **{f"paper-depth-{n}": _paper_recipe(n) for n in (12, 24, 48, 96)},
    # GPT-3 Table 2.1 "Medium": 24 x 1024, 16 heads of 64, lr 3e-4, 0.5M-token batch.
    # 373.9M parameters; Chinchilla budget 7.48B tokens = 14,262 steps of 256 x 2048.
    "llama-350m": _rung(24, 1024, 16, lr=3e-4, global_batch=256, micro_batch=8),
    # GPT-3 "Large": 24 x 1536, lr 2.5e-4, 0.5M tokens; 24 heads of 64 (GPT-3: 16 of 96).
    # 777.9M parameters; 15.56B tokens = 29,673 steps of 256 x 2048.
    "llama-760m": _rung(24, 1536, 24, lr=2.5e-4, global_batch=256, micro_batch=4),
    # GPT-3 "XL": 24 x 2048, lr 2e-4, 1M tokens; 16 heads of 128 (Table 2.1's "24 x 128" does not
    # multiply to 2048). 1.364B parameters; 27.29B tokens = 26,022 steps of 512 x 2048.
    "llama-1.3b": _rung(24, 2048, 16, lr=2e-4, global_batch=512, micro_batch=4),
    # GPT-3 "2.7B": 32 x 2560, lr 1.6e-4, 1M tokens; 40 heads of 64 (GPT-3: 32 of 80).
    # 2.702B parameters; 54.03B tokens = 51,529 steps of 512 x 2048.
    "llama-3b": _rung(32, 2560, 40, lr=1.6e-4, global_batch=512, micro_batch=2),
    # Llama-2-7B (Touvron et al. 2023, Table 1 / Sec. 2.2): 32 x 4096, 32 heads of 128, d_ff 11008,
    # seq 4096, lr 3e-4, 4M-token batch (1024 x 4096), 2000 warmup, cosine to 10%, AdamW eps 1e-5.
    # 6,738,415,616 parameters (6.74B); 134.8B tokens = 32,132 steps.
    "llama-7b": _rung(32, 4096, 32, lr=3e-4, global_batch=1024, micro_batch=1, seq_length=4096,
                      warmup=2000, adam_eps=1e-5),
    # Trains visibly on 2 CPU cores in a few minutes, and shows the study: at lr 1e-2 Post-Norm
    # collapses by step 30 (alarm, t_sim(X^H) = 1, loss pinned at the frequency loss) while Pre-Norm
    # trains (validation 6.42); at 3e-3 Post-Norm only stalls on the unigram plateau, then recovers.
    "tiny-cpu": dict(
        num_layers=4, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4, seq_length=128,
        micro_batch_size=8, global_batch_size=16, train_iters=200, lr=1e-2, min_lr=3e-4,
        lr_warmup_iters=20, lr_decay_style="cosine", weight_decay=0.1, adam_beta1=0.9,
        adam_beta2=0.95, clip_grad=1.0, init_variance="paper", bf16=False, eval_interval=50,
        eval_iters=4, save_interval=0, log_interval=10,
    ),
}
