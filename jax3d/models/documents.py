"""Documents inside a GPT sample, split at the end-of-document token: Megatron's `get_ltor_masks_and_position_ids`
(--eod-mask-loss, --reset-position-ids, --reset-attention-mask) as array functions of the input tokens.

An end-of-document token belongs to the document it ends: the tokens after it start the next one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def document_ids(tokens_bt, eod: int):
    """(batch, seq) int32: how many end-of-document tokens come strictly before each token."""
    is_eod = (tokens_bt == eod).astype(jnp.int32)
    return jnp.cumsum(is_eod, axis=1) - is_eod


def document_positions(tokens_bt, eod: int):
    """(batch, seq) int32: each token's position in its own document (0 at a document's first token)."""
    t = tokens_bt.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens_bt.shape)
    after_eod = jnp.where(tokens_bt == eod, idx + 1, 0)  # where the next document starts
    start = jax.lax.cummax(after_eod, axis=1)
    start = jnp.pad(start[:, :-1], ((0, 0), (1, 0)))  # only end-of-document tokens strictly before count
    return idx - start


def document_mask(tokens_bt, eod: int):
    """(batch, 1, seq, seq) bool: query t may attend key s only within its own document (causality apart)."""
    doc = document_ids(tokens_bt, eod)
    return doc[:, None, :, None] == doc[:, None, None, :]


def not_after_eod(tokens_bt, eod: int):
    """(batch, seq) float32: 0 where the input token is the end-of-document token (its prediction is the next
    document's first token), else 1."""
    return (tokens_bt != eod).astype(jnp.float32)
