"""Configuration of a megapost model exported for ``transformers`` (Post-Norm or Pre-Norm, with the
optional prefix-averaging term). Self-contained: needs only ``transformers``."""

from transformers import PretrainedConfig


class MegapostConfig(PretrainedConfig):
    model_type = "megapost"

    def __init__(self, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, rope_theta=10000.0, norm_position="post", prefix_alpha=0.0,
                 use_cache=False, tie_word_embeddings=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.norm_position = norm_position
        self.prefix_alpha = prefix_alpha
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
