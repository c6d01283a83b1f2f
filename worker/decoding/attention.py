"""The attention of the worker's own decoding steps (worker/decoding/graph.py, continuous.py): transformers' sdpa
attention with a token's query heads packed onto their key/value heads, and, where a forward asks, over only the
first columns of a static KV cache (those written so far, worker/decoding/shapes.py ``column_buckets``)."""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "sdpa_gqa_packed"  # the attention implementation the step sets on a model that uses "sdpa"


def sdpa_gqa_packed(module, query, key, value, attention_mask,
                    attention_columns: int | tuple[tuple[int, int], ...] | None = None, **kwargs):
    """transformers' sdpa attention, except that a single query token's heads are packed onto their key/value heads
    (grouped-query attention) in a compiled region too. transformers packs them only outside one; compiled, it
    repeats each key/value head for its query heads: a copy of the whole cache in every layer at every step, and an
    attention kernel that fills one query row of each tile. ``attention_columns`` (a forward's keyword): attend to
    the cache's first columns only, those written so far (the others are masked out); or ((rows, columns), ...):
    consecutive ranges of rows, from the first, each attending to its own number of first columns."""
    if isinstance(attention_columns, tuple):
        parts, start = [], 0
        for rows, columns in attention_columns:
            end = start + rows
            mask = None if attention_mask is None else attention_mask[start:end]
            parts.append(sdpa_gqa_packed(module, query[start:end], key[start:end], value[start:end], mask, columns,
                                         **kwargs)[0])
            start = end
        return torch.cat(parts), None
    if attention_columns is not None:
        key, value = key[:, :, :attention_columns], value[:, :, :attention_columns]
        if attention_mask is not None:
            attention_mask = attention_mask[..., :attention_columns]
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, _ = query.shape
    if q_len != 1 or groups == 1 or attention_mask is None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kv_heads = heads // groups
    # Query head h attends with key/value head h // groups, as after transformers' repeat_kv.
    if attention_mask.shape[1] != 1:
        attention_mask = attention_mask.reshape(batch, kv_heads, groups, -1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, kv_heads, groups, -1), key, value, attn_mask=attention_mask,
        dropout_p=kwargs.get("dropout", 0.0), scale=kwargs.get("scaling"))
    return out.reshape(batch, heads, 1, -1).transpose(1, 2).contiguous(), None


# Registered once, at import: registering again later changes transformers' mappings, which the compiled steps of
# other decoders in the process are guarded on (they would compile again).
AttentionInterface.register(PACKED_SDPA, sdpa_gqa_packed)
AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
