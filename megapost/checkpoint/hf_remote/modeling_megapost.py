"""A megapost model for ``transformers``: Llama layers (RoPE rotate-half, causal attention, SwiGLU,
untied head) with megapost's norm placement, read from the config as explicit per-sublayer rules and run
by one formula (sublayer k with input X):

    h = F(s * N_in(X));  h = N_out(h);  Y = a * X + h;  the stream continues from N(Y) if post_norm, else Y

(N_in only if ``input_norm``, N_out only if ``output_norm``, s = ``input_scale``, a = ``residual_scale``),
and a final norm before the head iff ``final_norm``. N is RMSNorm, or Dynamic Tanh (``norm_kind`` dyt,
y = g * tanh(alpha * x)). Optional: per-head RMSNorm of Q and K (``qk_norm``) or of Q, K and V (a rule's
``qkv_norm``), the embedding output times a learned scalar (``embedding_scale``), and the
prefix-averaging term (attention output minus ``prefix_alpha`` x the causal running mean of V).
Parameter names are Llama's, plus ``attn_output_layernorm`` / ``mlp_output_layernorm`` (output norms),
``self_attn.{q,k,v}_norm``, ``*.alpha`` (DyT) and ``model.embed_scale``; a sublayer without a stream
norm has no ``input_layernorm`` / ``post_attention_layernorm``. No KV cache: each forward recomputes the
whole sequence (``generate()`` is correct, only slower). Self-contained."""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_megapost import MegapostConfig


class MegapostRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


class MegapostDyT(nn.Module):
    """Dynamic Tanh: y = weight * tanh(alpha * x), scalar alpha, no bias."""

    def __init__(self, dim, alpha_init):
        super().__init__()
        self.alpha_init = float(alpha_init)
        self.alpha = nn.Parameter(torch.full((1,), self.alpha_init))
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return (torch.tanh(self.alpha.float() * x.float()) * self.weight.float()).to(x.dtype)


def make_norm(config, alpha_init):
    if config.norm_kind == "dyt":
        return MegapostDyT(config.hidden_size, alpha_init)
    return MegapostRMSNorm(config.hidden_size, config.rms_norm_eps)


def rope(x, positions, theta):
    """Rotate [b, heads, s, d] by ``positions`` [b, s] (rotate-half convention)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    half = d // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * emb.cos() + rotated.float() * emb.sin()).to(x.dtype)


class MegapostAttention(nn.Module):
    def __init__(self, config, qkv_norm=False):
        super().__init__()
        d, self.heads = config.hidden_size, config.num_attention_heads
        self.head_dim = d // self.heads
        self.groups = config.num_key_value_heads
        self.theta, self.alpha = config.rope_theta, config.prefix_alpha
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.groups * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.groups * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        qk, eps = config.qk_norm or qkv_norm, config.rms_norm_eps
        self.q_norm = MegapostRMSNorm(self.head_dim, eps) if qk else None
        self.k_norm = MegapostRMSNorm(self.head_dim, eps) if qk else None
        self.v_norm = MegapostRMSNorm(self.head_dim, eps) if qkv_norm else None

    def forward(self, x, positions, mask, keep):
        b, s, _ = x.shape

        def split(t):
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        if self.q_norm is not None:  # per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if self.v_norm is not None:
            v = self.v_norm(v)
        q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        if self.groups != self.heads:
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if self.alpha:
            w = keep[:, None, :, None].to(torch.float32)  # running mean over the real (unpadded) tokens
            mean = (v.float() * w).cumsum(dim=-2) / w.cumsum(dim=-2).clamp_min(1.0)
            out = out - self.alpha * mean.to(v.dtype)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MegapostMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MegapostDecoderLayer(nn.Module):
    """The attention and the FFN sublayer, each by its rule (module docstring). The attention's stream
    norm is ``input_layernorm``, the FFN's ``post_attention_layernorm`` (before the sublayer for
    ``input_norm`` rules, after the add for ``post_norm`` ones, absent for neither)."""

    def __init__(self, config, layer_index):
        super().__init__()
        self.attn_rule = config.layer_rules[layer_index]["attention"]
        self.mlp_rule = config.layer_rules[layer_index]["mlp"]
        alpha_attn, alpha_other = config.dyt_alpha_init
        self.self_attn = MegapostAttention(config, qkv_norm=self.attn_rule["qkv_norm"])
        self.mlp = MegapostMLP(config)

        def norm(wanted, alpha):
            return make_norm(config, alpha) if wanted else None

        def stream(rule):
            return rule["input_norm"] or rule["post_norm"]

        self.input_layernorm = norm(stream(self.attn_rule), alpha_attn)
        self.attn_output_layernorm = norm(self.attn_rule["output_norm"], alpha_other)
        self.post_attention_layernorm = norm(stream(self.mlp_rule), alpha_other)
        self.mlp_output_layernorm = norm(self.mlp_rule["output_norm"], alpha_other)

    @staticmethod
    def _sublayer(x, rule, fn, norm, out_norm):
        h = x
        if rule["input_norm"]:
            h = norm(h)
            if rule["input_scale"] != 1.0:
                h = h * rule["input_scale"]
        h = fn(h)
        if out_norm is not None:
            h = out_norm(h)
        a = rule["residual_scale"]
        y = x + h if a == 1.0 else x * a + h
        return norm(y) if rule["post_norm"] else y

    def forward(self, x, positions, mask, keep):
        x = self._sublayer(x, self.attn_rule, lambda h: self.self_attn(h, positions, mask, keep),
                           self.input_layernorm, self.attn_output_layernorm)
        return self._sublayer(x, self.mlp_rule, self.mlp, self.post_attention_layernorm,
                              self.mlp_output_layernorm)


class MegapostPreTrainedModel(PreTrainedModel):
    config_class = MegapostConfig
    base_model_prefix = "model"
    _no_split_modules = ["MegapostDecoderLayer"]

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)
        elif isinstance(module, MegapostRMSNorm):
            module.weight.data.fill_(1.0)
        elif isinstance(module, MegapostDyT):
            module.weight.data.fill_(1.0)
            module.alpha.data.fill_(module.alpha_init)
        elif isinstance(module, MegapostModel) and module.embed_scale is not None:
            module.embed_scale.data.fill_(math.sqrt(module.config.hidden_size))


class MegapostModel(MegapostPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = (nn.Parameter(torch.full((1,), math.sqrt(config.hidden_size)))
                            if config.embedding_scale else None)
        self.layers = nn.ModuleList(MegapostDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config, config.dyt_alpha_init[1]) if config.final_norm else None
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, s = input_ids.shape
        keep = (torch.ones(b, s, dtype=torch.bool, device=input_ids.device) if attention_mask is None
                else attention_mask.bool())
        if position_ids is None:
            position_ids = (keep.long().cumsum(-1) - 1).clamp_min(0)
        causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
        mask = causal[None, None] & keep[:, None, None, :]
        mask = mask | torch.eye(s, dtype=torch.bool, device=input_ids.device)  # padded rows see themselves
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        for layer in self.layers:
            x = layer(x, position_ids, mask, keep)
        return self.norm(x) if self.norm is not None else x


class MegapostForCausalLM(MegapostPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = MegapostModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}  # no cache: the whole sequence

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids, attention_mask, position_ids))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
