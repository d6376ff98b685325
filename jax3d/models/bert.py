"""BERT on the shared layers: bidirectional blocks with padding masks, token types, a tied MLM head and
Megatron's binary head (sentence-order prediction)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax3d.models.layers import (Embedding, _param, cross_entropy_sum, norm_for,
                                 vocab_parallel_logits)
from jax3d.models.transformer import TransformerLM, unbox


class BertHeads(nn.Module):
    """MLM transform (dense, GELU, layer norm) before the tied decoder, and pooler + binary classifier."""

    cfg: object
    rules: object
    spec: object

    @nn.compact
    def __call__(self, x_btd, wte_vd):
        cfg = self.cfg
        d = cfg.hidden_size
        init = nn.initializers.normal(cfg.init_method_std)
        w = _param(self, "mlm_dense", ("embed", None), (d, d), init)
        b = _param(self, "mlm_dense_bias", ("norm",), (d,), nn.initializers.zeros)
        h = jax.nn.gelu(jnp.einsum("btd,de->bte", x_btd, w) + b, approximate=cfg.activation == "gelu_tanh")
        h = norm_for(cfg, self.spec, "mlm_norm", one_plus=False)(h)
        bias_v = _param(self, "mlm_bias", ("vocab",), (cfg.vocab_size,), nn.initializers.zeros)
        logits = vocab_parallel_logits(h, wte_vd, self.rules) + bias_v.astype(jnp.float32)
        logits = self.rules.constrain(logits, ("batch", "seq", "vocab"))
        wp = _param(self, "pooler", ("embed", None), (d, d), init)
        bp = _param(self, "pooler_bias", ("norm",), (d,), nn.initializers.zeros)
        if self.rules.splits("act_seq"):
            # The first token of a sequence-split x, as a one-hot sum over the split dim: an all-reduce of
            # (batch, hidden). `x[:, 0]` has a collective-permute in its gradient, which deadlocks inside the
            # pipeline's last-stage branch.
            first_bd = jnp.einsum("btd,t->bd", x_btd, jax.nn.one_hot(0, x_btd.shape[1], dtype=x_btd.dtype))
        else:
            first_bd = x_btd[:, 0]
        pooled = jnp.tanh(jnp.einsum("bd,de->be", first_bd, wp) + bp)
        wc = _param(self, "binary", ("embed", "classes"), (d, 2), init)
        bc = _param(self, "binary_bias", ("classes",), (2,), nn.initializers.zeros)
        sop_logits = jnp.einsum("bd,dc->bc", pooled, wc, preferred_element_type=jnp.float32) + bc
        return logits, sop_logits


class _Identity(nn.Module):
    """Stands in for the final layer norm of a post-LN BERT, whose last block already ends in one."""

    @nn.compact
    def __call__(self, x):
        return x


class BERT(TransformerLM):
    """A micro-batch holds `text`, `types`, `labels`, `loss_mask`, `padding_mask` (batch, seq) and
    `is_random` (batch,): Megatron's BERT sample layout. An optional `sop_weight` (batch,) leaves rows
    out of the sentence-order terms (evaluation pads its last batch with such rows)."""

    causal = False

    def _modules(self):
        return (Embedding(self.cfg, self.rules, num_tokentypes=self.cfg.num_tokentypes, spec=self.spec, name="embed"),
                _Identity() if self.cfg.post_layernorm else norm_for(self.cfg, self.spec, "final_norm"),
                BertHeads(self.cfg, self.rules, self.spec, name="head"))

    def sample_shapes(self) -> dict:
        s = self.cfg.seq_length
        return {"text": ((s,), jnp.int32), "types": ((s,), jnp.int32), "labels": ((s,), jnp.int32),
                "loss_mask": ((s,), jnp.int32), "padding_mask": ((s,), jnp.int32), "is_random": ((), jnp.int32)}

    def _init_ends(self, rng):
        emb, norm, head = self._modules()
        n = min(8, self.cfg.seq_length)
        tokens = jnp.zeros((1, n), jnp.int32)
        r1, r2, r3 = jax.random.split(rng, 3)
        emb_p = emb.init(r1, tokens, tokens)["params"]
        wte = unbox(emb_p)["word"]
        ends = {"embed": emb_p, "head": head.init(r3, self._dummy_x(), wte)["params"]}
        if not self.cfg.post_layernorm:
            ends["final_norm"] = norm.init(r2, self._dummy_x())["params"]
        return ends

    def embed(self, params, mb, rng=None, deterministic=True):
        return self._modules()[0].apply({"params": params["embed"]}, mb["text"], mb["types"], rng, deterministic)

    def block_mask(self, mb):
        """(batch, 1, 1, seq): keys that are padding are masked out for every query."""
        return mb["padding_mask"][:, None, None, :].astype(bool)

    def head_loss(self, params, x_btd, mb):
        logits, sop_logits = self.heads(params, x_btd)
        mlm_sum, _ = cross_entropy_sum(logits, jnp.maximum(mb["labels"], 0), mb["loss_mask"], self.cfg.unpadded_vocab_size)
        sop_lse = jax.nn.logsumexp(sop_logits, axis=-1)
        target = mb["is_random"].astype(jnp.int32)
        sop_target = jnp.take_along_axis(sop_logits, target[:, None], axis=-1)[:, 0]
        w = self._sop_weight(mb)
        sop_sum = jnp.sum((sop_lse - sop_target) * w)
        correct = jnp.sum((jnp.argmax(sop_logits, -1) == target).astype(jnp.float32) * w)
        return {"lm": mlm_sum, "sop": sop_sum}, {"sop_correct": correct}

    def heads(self, params, x_btd):
        """(MLM logits (batch, seq, vocab) fp32, sentence-order logits (batch, 2)) of the last block's output."""
        _, norm, head = self._modules()
        if not self.cfg.post_layernorm:
            x_btd = norm.apply({"params": params["final_norm"]}, x_btd)
        return head.apply({"params": params["head"]}, x_btd, params["embed"]["word"])

    def forward(self, params, mb):
        """Both heads' logits of a batch (no dropout): for evaluation and comparison with other codebases."""
        x = self.embed(params, mb)
        x = self.run_blocks(params["blocks"], x, mask=self.block_mask(mb))
        return self.heads(params, x)

    @staticmethod
    def _sop_weight(mb):
        return mb.get("sop_weight", jnp.ones(mb["is_random"].shape, jnp.float32)).astype(jnp.float32)

    def normalizers(self, batch):
        return {"lm": jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0),
                "sop": jnp.maximum(jnp.sum(self._sop_weight(batch)), 1.0)}
