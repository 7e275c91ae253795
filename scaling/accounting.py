"""How to Scale Your Model's accounting as code: parameters and FLOPs.

Notation (the book's "All the Transformer Math You Need"): D model width, F MLP width,
N query heads, K key/value heads, H head dim, L layers, V vocabulary, T sequence length.
"""

from __future__ import annotations

import dataclasses

from scaling.config import ModelConfig


def layer_matmul_params(m: ModelConfig) -> int:
    """Per layer: Q (D·N·H), K and V (2·D·K·H), O (N·H·D), SwiGLU (3·D·F)."""
    d, n, k, h, f = m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.mlp_dim
    return d * n * h + 2 * d * k * h + n * h * d + 3 * d * f


def param_count(m: ModelConfig) -> int:
    """Exact count of the parameters scaling.model.Transformer creates."""
    d, v, l = m.hidden_size, m.vocab_size, m.num_layers
    per_layer = layer_matmul_params(m) + 2 * d  # + two RMSNorm scales
    head = 0 if m.tie_embeddings else d * v
    return v * d + l * per_layer + d + head  # embedding, layers, final norm, head


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
    dense: float  # matmuls against weights (projections, MLP, output head)
    attention: float  # q·k^T and probs·v
    six_n: float  # Kaplan et al.'s 6N approximation, beside it for comparison

    @property
    def total(self) -> float:
        return self.dense + self.attention


def matmul_params(m: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (the embedding lookup does not)."""
    return m.num_layers * layer_matmul_params(m) + m.hidden_size * m.vocab_size


def flops_per_token(m: ModelConfig, seq_len: int, *, training: bool = True, causal: bool = True) -> FlopsPerToken:
    """FLOPs per token.

    Forward dense: 2 FLOPs per weight per token (one multiply, one add). Attention forward:
    q·k^T and probs·v are each 2·T·N·H per token per layer, so 4·T·N·H·L; causal masking
    halves the work a flash kernel does (the book's transformers chapter; PaLM, Chowdhery
    et al. 2022, appendix B counts the unhalved 12·L·N·H·T for training). Training is 3x
    forward (backward = 2x forward: gradients w.r.t. activations and weights).
    """
    mult = 3 if training else 1
    dense = 2 * matmul_params(m) * mult
    attention = 4 * seq_len * m.num_heads * m.resolved_head_dim * m.num_layers * mult
    if causal:
        attention /= 2
    six_n = (6 if training else 2) * param_count(m)
    return FlopsPerToken(float(dense), float(attention), float(six_n))
