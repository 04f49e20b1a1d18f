"""Configuration of a megapost model exported for ``transformers``. Self-contained: needs only
``transformers``.

The norm placement is carried explicitly, as megapost computed it on export: ``layer_rules`` holds, per
layer, the ``attention`` and ``mlp`` sublayer rules (``input_norm``, ``output_norm``, ``post_norm``,
``residual_scale``, ``input_scale``, ``qkv_norm``), ``norm_kind`` is ``rms`` or ``dyt``, ``final_norm``
whether the head normalises, ``embedding_scale`` whether the embedding output is times a learned scalar,
``qk_norm`` whether every layer RMS-normalises its queries and keys per head. Configs written before
these keys existed (``norm_position`` ``post`` or ``pre`` only) get the rules of those two placements.
"""

from transformers import PretrainedConfig


def _rule(**set_flags):
    rule = {"input_norm": False, "output_norm": False, "post_norm": False, "residual_scale": 1.0,
            "input_scale": 1.0, "qkv_norm": False}
    rule.update(set_flags)
    return rule


def legacy_layout(norm_position, num_layers):
    """(layer_rules, final_norm) of a config that names only ``post`` or ``pre``."""
    if norm_position not in ("post", "pre"):
        raise ValueError(f"config.json: norm_position {norm_position!r} without layer_rules; re-export the "
                         "model with a current megapost (tools/convert_to_hf.py)")
    rule = _rule(post_norm=True) if norm_position == "post" else _rule(input_norm=True)
    return [{"attention": dict(rule), "mlp": dict(rule)} for _ in range(num_layers)], norm_position == "pre"


class MegapostConfig(PretrainedConfig):
    model_type = "megapost"

    def __init__(self, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, rope_theta=10000.0, norm_position="post", prefix_alpha=0.0,
                 layer_rules=None, final_norm=None, norm_kind="rms", embedding_scale=False, qk_norm=False,
                 dyt_alpha_init=(0.8, 0.2), use_cache=False, tie_word_embeddings=False, **kwargs):
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
        if layer_rules is None:
            layer_rules, final_norm = legacy_layout(norm_position, num_hidden_layers)
        if len(layer_rules) != num_hidden_layers:
            raise ValueError(f"config.json: {len(layer_rules)} layer_rules for {num_hidden_layers} layers")
        self.layer_rules = [{k: _rule(**r[k]) for k in ("attention", "mlp")} for r in layer_rules]
        self.final_norm = (not self.layer_rules[-1]["mlp"]["post_norm"] if final_norm is None
                           else bool(final_norm))
        if norm_kind not in ("rms", "dyt"):
            raise ValueError(f"config.json: norm_kind {norm_kind!r} is not 'rms' or 'dyt'")
        self.norm_kind = norm_kind
        self.embedding_scale = bool(embedding_scale)
        self.qk_norm = bool(qk_norm)
        self.dyt_alpha_init = list(dyt_alpha_init)
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
