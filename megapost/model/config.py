"""The model's own configuration: sizes, norm placement and initialisation (no parallelism)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Llama decoder hyper-parameters; ``norm_position`` is the one switch the study turns."""

    vocab_size: int
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 192
    num_attention_heads: int = 4
    seq_length: int = 128
    norm_position: str = "post"  # "post" (norm after each residual add) | "pre"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_variance: str = "std"  # "std": N(0, init_method_std^2) | "paper": 1/(3d), W_2: 1/(3 d_ff)
    init_method_std: float = 0.02
    scaled_output_init: bool = True  # Megatron: std / sqrt(2 L) for W_O and W_2 (init_variance="std")
    sublayer_init_multiplier: float = 1.0  # scales the variance of every attention/FFN matrix
    prefix_alpha: float = 0.0  # attention output minus alpha * causal running mean of V
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.norm_position not in ("post", "pre"):
            raise ValueError(f"--norm-position must be 'post' or 'pre', got {self.norm_position!r}")
        if self.init_variance not in ("std", "paper"):
            raise ValueError(f"--init-variance must be 'std' or 'paper', got {self.init_variance!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden-size {self.hidden_size} is not divisible by "
                f"--num-attention-heads {self.num_attention_heads}"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError("head dimension (hidden/heads) must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        """Exact parameter count (embedding and head untied)."""
        d, f, v, n = self.hidden_size, self.ffn_hidden_size, self.vocab_size, self.num_layers
        per_layer = 4 * d * d + 3 * d * f + 2 * d
        final_norm = d if self.norm_position == "pre" else 0
        return 2 * v * d + n * per_layer + final_norm

    def flops_per_token(self) -> float:
        """Model FLOPs per trained token (forward+backward = 3x forward; matmuls and attention scores)."""
        d, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_size
        n, s = self.num_layers, self.seq_length
        matmul = n * (4 * d * d + 3 * d * f) + d * v
        attention = n * s * d  # QK^T and PV, causal half of 2 * s * d each
        return 6.0 * matmul + 6.0 * attention
