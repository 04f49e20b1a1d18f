"""The model's own configuration: sizes, norm placement and initialisation (no parallelism)."""

from __future__ import annotations

from dataclasses import dataclass

from megapost.model.placements import PLACEMENTS, Sublayer, has_final_norm, layer_rules, norm_kind


@dataclass(frozen=True)
class ModelConfig:
    """Llama decoder hyper-parameters; ``norm_position`` is the one switch the study turns."""

    vocab_size: int
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 192
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # K/V heads (grouped-query attention); None: = heads (MHA)
    seq_length: int = 128
    norm_position: str = "post"  # a placement of megapost.model.placements.PLACEMENTS
    mix_post_fraction: float = 0.25  # "mix": the first floor(rho L) layers Post-Norm, the rest Pre-Norm
    dyt_alpha_init: tuple[float, float] = (0.8, 0.2)  # "dyt": a_0 of the attention / other DyT layers
    qk_norm: bool = False  # RMSNorm of queries and keys per head (gain shared by the heads), any placement
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_variance: str = "std"  # "std": N(0, init_method_std^2) | "paper": 1/(3d), W_2: 1/(3 d_ff)
    init_method_std: float = 0.02
    scaled_output_init: bool = True  # Megatron: std / sqrt(2 L) for W_O and W_2 (init_variance="std")
    sublayer_init_multiplier: float = 1.0  # scales the variance of every attention/FFN matrix
    prefix_alpha: float = 0.0  # attention output minus alpha * causal running mean of V
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.norm_position not in PLACEMENTS:
            raise ValueError(f"--norm-position must be one of {', '.join(PLACEMENTS)}, "
                             f"got {self.norm_position!r}")
        if not 0.0 <= self.mix_post_fraction <= 1.0:
            raise ValueError(f"--mix-post-fraction must be in [0, 1], got {self.mix_post_fraction}")
        if self.init_variance not in ("std", "paper"):
            raise ValueError(f"--init-variance must be 'std' or 'paper', got {self.init_variance!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden-size {self.hidden_size} is not divisible by "
                f"--num-attention-heads {self.num_attention_heads}"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError("head dimension (hidden/heads) must be even for RoPE")
        groups = self.num_query_groups
        if groups is not None and (groups < 1 or self.num_attention_heads % groups):
            raise ValueError(f"--num-query-groups {groups} must be >= 1 and divide "
                             f"--num-attention-heads {self.num_attention_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def rules(self, layer_number: int) -> tuple[Sublayer, Sublayer]:
        """(attention, FFN) dataflow rules of 1-based ``layer_number`` (megapost.model.placements)."""
        return layer_rules(self.norm_position, layer_number, self.num_layers, self.mix_post_fraction)

    @property
    def final_norm(self) -> bool:
        """Whether the head normalises its input (the last sublayer did not already)."""
        return has_final_norm(self.norm_position, self.num_layers, self.mix_post_fraction)

    @property
    def norm_kind(self) -> str:
        return norm_kind(self.norm_position)

    @property
    def embedding_scale(self) -> bool:
        """Whether the embedding output is multiplied by a learned scalar (DyT's LLaMA recipe)."""
        return self.norm_kind == "dyt"

    @property
    def norm_parameters(self) -> int:
        """Parameters of one residual-stream norm: RMSNorm's gain, or DyT's gain and scalar."""
        return self.hidden_size + 1 if self.norm_kind == "dyt" else self.hidden_size

    def layer_norm_parameters(self, layer_number: int) -> int:
        """Norm parameters inside layer ``layer_number``: residual-stream norms, Q/K(/V) gains."""
        attn, ffn = self.rules(layer_number)
        n = sum(self.norm_parameters * (int(r.norm_input is not None) + int(r.output_norm))
                for r in (attn, ffn))
        head_norms = 3 if attn.qkv_norm else 2 if self.qk_norm else 0
        return n + head_norms * self.head_dim

    @property
    def kv_groups(self) -> int:
        """Number of K/V heads: ``num_query_groups``, or every query head its own (MHA)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """Width of the K and V projections."""
        return self.kv_groups * self.head_dim

    def _layer_matmul_weights(self) -> int:
        d = self.hidden_size
        return 2 * d * d + 2 * d * self.kv_size + 3 * d * self.ffn_hidden_size  # W_Q, W_O; W_K, W_V; FFN

    def parameter_split(self) -> dict[str, int]:
        """Exact parameter counts by part (embedding and head untied; RMSNorm gains, no biases)."""
        d, v = self.hidden_size, self.vocab_size
        return {
            "embedding": v * d + int(self.embedding_scale),
            "head": v * d,
            "layers": sum(self._layer_matmul_weights() + self.layer_norm_parameters(n)
                          for n in range(1, self.num_layers + 1)),
            "final_norm": self.norm_parameters if self.final_norm else 0,
        }

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Exact parameter count; ``non_embedding`` leaves out the embedding and LM-head matrices."""
        split = self.parameter_split()
        drop = split["embedding"] + split["head"] if non_embedding else 0
        return sum(split.values()) - drop

    def parameter_summary(self) -> str:
        """E.g. "6738.42M parameters (262.14M embedding + head, 6476.27M non-embedding)"."""
        total, body = self.num_parameters(), self.num_parameters(non_embedding=True)
        gqa = f", GQA {self.kv_groups} K/V heads" if self.kv_groups != self.num_attention_heads else ""
        return (f"{total / 1e6:.2f}M parameters ({(total - body) / 1e6:.2f}M embedding + head, "
                f"{body / 1e6:.2f}M non-embedding){gqa}")

    def flops_per_token(self, causal: bool = False) -> float:
        """Model FLOPs per trained token (forward+backward = 3x forward; matmuls and attention scores),
        in Megatron-LM's convention: QK^T and PV counted in full, 12·L·s·d per token (as published MFU
        figures count them); ``causal=True`` counts the causal half actually needed (6·L·s·d).
        Grouped-query attention shrinks only the K/V projections; scores and P V use every query head."""
        d, v, n, s = self.hidden_size, self.vocab_size, self.num_layers, self.seq_length
        matmul = n * self._layer_matmul_weights() + d * v
        attention = n * s * d * (1 if causal else 2)  # QK^T and PV: 2·s·d each, or their causal half
        return 6.0 * matmul + 6.0 * attention


def padded_vocab_size(vocab_size: int, divisible_by: int = 128) -> int:
    """``vocab_size`` rounded up to a multiple of ``--make-vocab-size-divisible-by`` only (not times the
    tensor-parallel size, so the model, and a seed's weights, are the same under every layout)."""
    if divisible_by < 1:
        raise ValueError(f"--make-vocab-size-divisible-by must be >= 1, got {divisible_by}")
    return -(-vocab_size // divisible_by) * divisible_by
