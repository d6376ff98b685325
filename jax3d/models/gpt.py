"""GPT-2-style decoder: learned positions, pre-LN blocks, tied embeddings, vocab-parallel loss. Llama is the same
class with the config's variants (jax3d.models.layers), and an output layer of its own when untied."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax3d.models import documents
from jax3d.models.layers import Embedding, _param, fused_lm_loss_sum, norm_for, vocab_parallel_logits
from jax3d.models.transformer import TransformerLM


class OutputLayer(nn.Module):
    """The LM head's own (vocab, embed) table, for --untie-embeddings-and-output-weights."""

    cfg: object

    @nn.compact
    def __call__(self):
        cfg = self.cfg
        return _param(self, "output", ("vocab", "embed"), (cfg.vocab_size, cfg.hidden_size),
                      nn.initializers.normal(cfg.init_method_std))


class GPT(TransformerLM):
    """A micro-batch is `{'text': int (batch, seq+1)}`, optionally with `loss_mask` (batch, seq).

    With the config's end-of-document switches (`eod_mask_loss`, `reset_position_ids`, `reset_attention_mask`,
    Megatron's), the loss mask, learned positions and attention mask come from the input tokens and
    `cfg.eod_token_id` (jax3d.models.documents); rotary positions are not reset, as in Megatron-DeepSpeed.

    The loss computes its head's gradients in the forward pass (`layers.fused_lm_loss_sum`, a custom VJP),
    so reverse mode works and forward mode (`jax.jvp`, `jax.jacfwd`) does not; `layers.cross_entropy_sum`
    of `logits(params, tokens)` is the same loss and takes both."""

    causal = True

    def _modules(self):
        return (Embedding(self.cfg, self.rules, spec=self.spec, name="embed"),
                norm_for(self.cfg, self.spec, "final_norm"))

    def _init_ends(self, rng):
        emb, norm = self._modules()
        tokens = jnp.zeros((1, min(8, self.cfg.seq_length)), jnp.int32)
        ends = {"embed": emb.init(rng, tokens)["params"], "final_norm": norm.init(rng, self._dummy_x())["params"]}
        if self.cfg.untie_embeddings_and_output_weights:
            ends["head"] = OutputLayer(self.cfg).init(jax.random.fold_in(rng, 1))["params"]
        return ends

    def output_table(self, params):
        """The (vocab, embed) table the LM head multiplies by: the word embedding, or the head's own."""
        return params["head"]["output"] if self.cfg.untie_embeddings_and_output_weights else params["embed"]["word"]

    def sample_shapes(self) -> dict:
        """Per-sample shape and dtype of each batch key."""
        return {"text": ((self.cfg.seq_length + 1,), jnp.int32)}

    def _eod(self) -> int:
        eod = self.cfg.eod_token_id
        if eod < 0:
            raise ValueError("--eod-mask-loss, --reset-position-ids and --reset-attention-mask need the tokenizer's "
                             "end-of-document id in ModelConfig.eod_token_id, which is not set")
        return eod

    def embed(self, params, mb, rng=None, deterministic=True):
        tokens_bt = mb["text"][:, :-1]
        positions_bt = None
        if self.cfg.reset_position_ids and self.cfg.add_position_embedding:
            positions_bt = documents.document_positions(tokens_bt, self._eod())
        return self._modules()[0].apply({"params": params["embed"]}, tokens_bt, None, rng, deterministic,
                                        positions_bt)

    def block_mask(self, mb):
        """None (causal attention over the whole sample), or with `reset_attention_mask` (batch, 1, seq, seq):
        attention within each document only."""
        if not self.cfg.reset_attention_mask:
            return None
        return documents.document_mask(mb["text"][:, :-1], self._eod())

    def logits(self, params, tokens_bt):
        """Full logits (batch, seq, vocab) in fp32, for evaluation and generation."""
        mb = {"text": jnp.pad(tokens_bt, ((0, 0), (0, 1)))}
        x = self.embed(params, mb)
        x = self.run_blocks(params["blocks"], x, mask=self.block_mask(mb))
        return self.final_logits(params, x)

    def embed_at(self, params, tokens_bt, positions_bt):
        """Embeddings of tokens at explicit positions (generation: left-padded rows, cached steps)."""
        return self._modules()[0].apply({"params": params["embed"]}, tokens_bt, None, None, True, positions_bt)

    def final_logits(self, params, x_btd):
        """fp32 logits (batch, seq, vocab) of the last block's output."""
        x_btd = self._modules()[1].apply({"params": params["final_norm"]}, x_btd)
        return vocab_parallel_logits(x_btd, self.output_table(params), self.rules).astype(jnp.float32)

    def head_loss(self, params, x_btd, mb):
        x_btd = self._modules()[1].apply({"params": params["final_norm"]}, x_btd)
        loss_sum = fused_lm_loss_sum(x_btd, self.output_table(params), mb["text"][:, 1:], self._loss_mask(mb),
                                     self.rules, self.cfg.unpadded_vocab_size, self.kernels.tuning("fused_xent"))
        return {"lm": loss_sum}, {}

    def _loss_mask(self, mb):
        text = mb["text"]
        mask = mb.get("loss_mask", jnp.ones(text[..., 1:].shape, jnp.float32))
        if self.cfg.eod_mask_loss:
            mask = mask * documents.not_after_eod(text[..., :-1], self._eod())
        return mask

    def normalizers(self, batch):
        return {"lm": jnp.maximum(jnp.sum(self._loss_mask(batch).astype(jnp.float32)), 1.0)}
