"""One GEMM for q/k/v and one for gate/up in each decoder layer of the worker's decoding step.

At a decoding step's few rows a GEMM costs the GPU's latency floor, 4-6 µs on an H200 whatever its size
(docs/performance.md, the profile of the decoding step): seven GEMMs a layer cost nearly seven floors. The
projections that read the same input become one: q, k and v; gate and up.

The fused weight is one buffer, and each projection's parameter a view into it: a weight sync that copies into the
parameters (asyncgrpo/weights: ``state_dict`` tensors, copied in place) writes straight into the fused buffer, so no
second copy of the weights exists and the step's CUDA graphs stay valid. Names, shapes and ``state_dict`` do not
change; the PS and the transports see the same model.

torch.compile has a pass for linears that share an input (``batch_linear_lhs`` of Inductor's
``pre_grad_fusion_options``), but it concatenates the weights at every call, a copy of them each step, unless the
weights are frozen into the graph, where a sync no longer reaches them; its grouped variant needs fbgemm.

Only layers built the way Llama, Qwen2, Qwen3 and Mistral build theirs are fused (plain ``nn.Linear`` projections,
and the attention forward this module restates): a LoRA adapter's or a quantised layer keeps today's path, and
``fuse_projections`` says why once.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn import functional as F

# The attention classes whose forward ``_fused_attention_forward`` restates (transformers 5.x), and the sliding
# window each passes to its attention function.
ATTENTION_CLASSES = {"LlamaAttention": None, "Qwen2Attention": "module", "Qwen3Attention": "module",
                     "MistralAttention": "config"}
MLP_CLASSES = {"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"}


def fuse_projections(model: nn.Module) -> str | None:
    """Fuses q/k/v and gate/up in every decoder layer of ``model`` (a transformers causal LM); returns why it did
    not, or None. All layers or none: the model is checked before anything changes."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return f"{type(model).__name__} has no model.layers"
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (type(attn).__name__ not in ATTENTION_CLASSES or type(mlp).__name__ not in MLP_CLASSES
                or not type(attn).__module__.startswith("transformers.models.")):  # (not a remote-code namesake)
            return f"layers of {type(attn).__module__}.{type(attn).__name__} and {type(mlp).__name__}"
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
        if any(type(p) is not nn.Linear for p in linears):  # (an adapter's or a quantised layer)
            return "projections that are not plain nn.Linear (an adapter or a quantised model)"
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        attn.forward = _fused_attention_forward.__get__(attn)
        mlp.gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
        mlp.forward = _fused_mlp_forward.__get__(mlp)
    return None


class FusedLinear:
    """The weight (and bias) of several linears that read one input, side by side in one buffer. A plain object,
    not a module: the buffer is reached through the linears' parameters, never through ``state_dict``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]):
        self.weight, self.bias, self.sizes = weight, bias, sizes
        # CUDA graphs copy a compiled function's inputs into static buffers unless their address is static;
        # parameters are marked so by torch.compile, this buffer (not a parameter) must be marked here.
        torch._dynamo.mark_static_address(weight)
        if bias is not None:
            torch._dynamo.mark_static_address(bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def _fuse(linears: list[nn.Linear]) -> FusedLinear:
    """Moves ``linears``' weights (and biases) into one buffer and makes each parameter a view into it."""
    sizes = [p.out_features for p in linears]
    weight = torch.cat([p.weight.detach() for p in linears])
    has_bias = [p.bias is not None for p in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("linears fused together must all have a bias or none")
    bias = torch.cat([p.bias.detach() for p in linears]) if all(has_bias) else None
    start = 0
    for p, size in zip(linears, sizes, strict=True):
        # A Parameter made from a view shares the view's storage.
        p.weight = nn.Parameter(weight[start:start + size], requires_grad=p.weight.requires_grad)
        if bias is not None:
            p.bias = nn.Parameter(bias[start:start + size], requires_grad=p.bias.requires_grad)
        start += size
    return FusedLinear(weight, bias, sizes)


def _fused_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_up(x)
    return self.down_proj(self.act_fn(gate) * up)


def _fused_attention_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                             cache=None, **kwargs):
    """transformers' Llama/Qwen2/Qwen3/Mistral attention forward with q, k and v from one GEMM."""
    modeling = sys.modules[type(self).__module__]  # the model's own RoPE and attention functions
    if cache is None:  # (the name transformers used before 5.x, still accepted there)
        cache = kwargs.pop("past_key_values", None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = self.qkv(hidden_states)
    q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
    if hasattr(self, "q_norm"):  # Qwen3
        q, k = self.q_norm(q), self.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = position_embeddings
    q, k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    attention = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                modeling.eager_attention_forward)
    window = ATTENTION_CLASSES[type(self).__name__]
    if window is not None:
        kwargs["sliding_window"] = (self.sliding_window if window == "module"
                                    else getattr(self.config, "sliding_window", None))
    dropout = self.attention_dropout if self.training else 0.0
    out, weights = attention(self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
