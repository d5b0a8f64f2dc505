"""Grouped-query attention without copied key/value heads, for sampling and for the learner.

Models such as SmolLM2 have fewer key/value heads than query heads (3 against 9). transformers' SDPA path
copies the key/value heads out to every query head (``repeat_kv``) whenever an attention mask is present,
and a left-padded batch, a reused prefix or a packed tree always has one: on a 2-core CPU the copies took
35% of a rollout, 16x the attention kernel itself at 2,048 cached tokens. PyTorch's
``scaled_dot_product_attention(..., enable_gqa=True)`` reads each key/value head once for its group of query
heads, with any mask, on the CPU, and its outputs equal the copying path's.

:data:`ATTENTION` is registered with transformers' attention and mask registries under its own name, and every
model repertory loads or builds asks for it. On CUDA (where a masked GQA call falls back to the slow math
kernel) and for the features this function does not implement (soft-capping, position biases) it hands the
call to transformers' own SDPA function unchanged. A decode step on the CPU (one query token per row, no
gradient) goes to :func:`~repertory.models.decode.decode_attention`, a kernel of our own that reads the cache two to
three times as fast as SDPA. A pass over a paged cache (the hf engine's ``PagedStream``) names its own attention in
the ``paged`` keyword, which the model hands down to every layer.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from repertory.models.decode import decode_attention

ATTENTION = "repertory_gqa_sdpa"
"""The attention implementation every model repertory loads runs (``attn_implementation``)."""


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` [batch, heads, q, dim], ``key``/``value``
    [batch, kv_heads, kv, dim], an additive or boolean mask broadcastable to [batch, heads, q, kv]; returns
    [batch, q, heads, dim]."""
    paged = kwargs.get("paged")
    if paged is not None:
        return paged.attend(query, key, value, scaling), None
    special = kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
    if not special and not dropout:
        decoded = decode_attention(query, key, value, attention_mask, scaling)
        if decoded is not None:
            return decoded, None
    grouped = query.shape[1] != key.shape[1]
    if not grouped or special or query.device.type == "cuda":
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal and attention_mask is None and query.shape[2] > 1)
    if causal and key.shape[2] > query.shape[2]:
        # transformers drops the mask only when no key lies ahead of the queries (an empty static cache): SDPA's
        # causal mask is aligned top-left, so the spare room is cut as transformers' own function does
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, gqa_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
