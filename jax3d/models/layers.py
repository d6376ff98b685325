"""Transformer layers shared by GPT, BERT and Llama, as Flax (Linen) modules that name logical axes.

Llama differs from GPT-2 in fields of the one block (jax3d.config.ModelConfig): RMSNorm, a SwiGLU MLP, rotary
positions, grouped-query attention, no biases, an untied output layer.

Linen rather than NNX because its `init` / `apply` are pure functions over parameter pytrees: the
pipeline, ZeRO and checkpoint code all work on those trees, and a stage applies a block with
`Block(...).apply({'params': p}, x)` without owning module state.

Which kernel, attention implementation or FP8 GEMM a layer runs is not decided here: the block's parts come from
its `jax3d.models.spec.BlockSpec`, chosen once from the config, the run's kernel policy and the FP8 recipe, and
the layers call them in order.

Parameters are created fp32 (the master copy). The train step casts them to the compute dtype before the
forward pass, so every layer computes in whatever dtype its parameters arrive in; layer norm and softmax
upcast to fp32 internally.
"""
from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax3d import dropout_keys
from jax3d.config import ModelConfig
from jax3d.kernels import kernel
from jax3d.models import quantized
from jax3d.models.spec import (BlockSpec, _dropout, _plus, activation_of, block_spec, lean_layer_norm,  # noqa: F401
                               layer_norm, split_qkv)
from jax3d.parallel.rules import DEFAULT_RULES, ShardingRules


def _param(module: nn.Module, name: str, axes: tuple, shape: tuple, init):
    """The module's parameter `name`. A Quantized one (generation's fp8 weights) stores its values in another dim
    order than the weight's (jax3d.models.quantized), so it is checked against `shape` here rather than by flax,
    which compares its stored leaves."""
    if module.has_variable("params", name):
        held = module.get_variable("params", name)
        if isinstance(held, quantized.Quantized):
            if held.shape != tuple(shape):
                raise ValueError(f"parameter {name!r} of {module.name} is {held.shape}, not {tuple(shape)}")
            return held
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


def _bias(module: nn.Module, cfg: ModelConfig, name: str, axes: tuple, shape: tuple):
    """A linear layer's bias (zeros), or None when the model has none (--disable-bias-linear)."""
    return _param(module, name, axes, shape, nn.initializers.zeros) if cfg.add_bias_linear else None


def _inits(cfg: ModelConfig):
    """Megatron's init: normal(std) for weights, and std / sqrt(2 L) for the layers that write into the
    residual stream (attention-out, MLP-down), so its variance doesn't grow with depth."""
    std = cfg.init_method_std
    return nn.initializers.normal(std), nn.initializers.normal(std / math.sqrt(2.0 * cfg.num_layers))


def _dropout_rng(module: nn.Module, rng, deterministic: bool):
    """The key that drives a layer's dropout: `rng`, else Flax's 'dropout' stream where the caller gave
    one (`apply(..., rngs={'dropout': key})`), else None (no dropout)."""
    if rng is None and not deterministic and module.has_rng("dropout"):
        return module.make_rng("dropout")
    return rng


class LayerNorm(nn.Module):
    """Layer norm computed in fp32, returned in the input dtype, as the spec's `norm` part computes it (by default
    `lean_layer_norm`; fused_norm's kernel where the kernel policy runs it). With `rms`, RMSNorm: a scale and no
    bias. With
    `one_plus` (Megatron's --apply-layernorm-1p) the parameter `scale` holds the scale minus 1, initialised to 0:
    the same norm, but weight decay pulls the scale towards 1 rather than 0."""

    eps: float = 1e-5
    rms: bool = False
    one_plus: bool = False
    norm: Callable = lean_layer_norm  # the spec's part

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        scale = _param(self, "scale", ("norm",), (d,), nn.initializers.zeros if self.one_plus else nn.initializers.ones)
        if self.one_plus:  # added in fp32: in bf16, 1 + w would round away a small w
            scale = scale.astype(jnp.float32) + 1.0
        bias = None if self.rms else _param(self, "bias", ("norm",), (d,), nn.initializers.zeros)
        return self.norm(x, scale, bias, self.eps)


def norm_for(cfg: ModelConfig, spec: BlockSpec, name: str, one_plus: bool = True) -> LayerNorm:
    """The model's layer norm (or RMSNorm), with its epsilon. `cfg.apply_layernorm_1p` applies to the layer norms
    of the blocks and the final one, as in Megatron-DeepSpeed (whose RMSNorm and BERT head norm ignore it); other
    callers pass `one_plus=False`."""
    return LayerNorm(cfg.layernorm_epsilon, cfg.normalization == "rmsnorm", one_plus and cfg.one_plus_norms,
                     spec.norm, name=name)


class Attention(nn.Module):
    """Multi-head self-attention; QKV column-parallel over heads, output row-parallel.

    Grouped-query attention is the same projection: `qkv_kernel` is (embed, g + 2, kv_heads, head_dim), for
    each KV head its g = heads / kv_heads query heads, then its key and its value (g = 1: GPT's (embed, 3,
    heads, head_dim)). Query head n is KV head n // g's (Hugging Face's order), and tensor parallelism splits
    the KV heads, each with its query heads.

    Returns (output, cache). Under generation's decode spec (jax3d.inference.cached_attention.decode_spec), with
    `cache` ({'k', 'v': (batch, kv_heads, max_len, head_dim), 'index': where this call's tokens go, and
    optionally 'start': each row's first slot}) it writes its keys and values into the cache, attends over all of
    it under the caller's `mask` (batch, 1, seq, max_len), and returns the updated cache; under training's spec
    the cache passes through. `positions_bt` (batch, seq) place the tokens for rotary embeddings (default 0, 1,
    ...).
    """

    cfg: ModelConfig
    rules: ShardingRules = DEFAULT_RULES  # Megatron's table; with no mesh in context, no constraint
    spec: BlockSpec | None = None  # None: block_spec(cfg), no kernel
    causal: bool = True

    @nn.compact
    def __call__(self, x_btd, mask=None, rng=None, deterministic=True, cache=None, positions_bt=None):
        cfg, spec = self.cfg, self.spec or block_spec(self.cfg)
        d, n, h, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.kv_heads
        g = n // kv
        init, out_init = _inits(cfg)
        w_qkv = _param(self, "qkv_kernel", ("embed", "qkv", "heads", "kv"), (d, g + 2, kv, h), init)
        b_qkv = _bias(self, cfg, "qkv_bias", ("qkv", "heads", "kv"), (g + 2, kv, h))
        w_out = _param(self, "out_kernel", ("heads", "kv", "embed"), (n, h, d), out_init)
        b_out = _bias(self, cfg, "out_bias", ("embed",), (d,))
        s_qkv, s_out = spec.project.scales(self, "qkv"), spec.project.scales(self, "out")

        x_btd = self.rules.constrain(x_btd, ("batch", "seq", "embed"))
        # The fused attention kernel reads q, k and v as strided views of this layout; putting the q/k/v
        # axis first instead cost a transpose and three copies forward, a stack backward (docs/performance.md).
        qkv = spec.project("btd,dcnh->btcnh", x_btd, w_qkv, s_qkv)
        q, k, v, packed = spec.split_qkv(qkv, b_qkv, self.rules)  # packed: what q, k, v are plain slices of
        q, k, packed = spec.positions(q, k, packed, x_btd, positions_bt)
        rng = _dropout_rng(self, rng, deterministic)
        ctx, cache = spec.attend(q, k, v, packed, mask, rng, deterministic, self.causal, cache, self.rules)
        return _plus(spec.out_project(ctx, w_out, s_out, spec.project, self.rules), b_out), cache


class MLP(nn.Module):
    """GELU MLP, or SwiGLU (`cfg.swiglu`), whose up-projection `up_kernel` (embed, 2, mlp) holds the gate and
    the up matrices; up-projection column-parallel over `mlp`, down-projection row-parallel."""

    cfg: ModelConfig
    rules: ShardingRules = DEFAULT_RULES  # Megatron's table; with no mesh in context, no constraint
    spec: BlockSpec | None = None  # None: block_spec(cfg), no kernel

    @nn.compact
    def __call__(self, x_btd):
        cfg, spec = self.cfg, self.spec or block_spec(self.cfg)
        d, f = cfg.hidden_size, cfg.ffn_hidden_size
        init, out_init = _inits(cfg)
        up_axes, up_shape = (("embed", None, "mlp"), (d, 2, f)) if cfg.swiglu else (("embed", "mlp"), (d, f))
        w_up = _param(self, "up_kernel", up_axes, up_shape, init)
        b_up = _bias(self, cfg, "up_bias", up_axes[1:], up_shape[1:])
        w_down = _param(self, "down_kernel", ("mlp", "embed"), (f, d), out_init)
        b_down = _bias(self, cfg, "down_bias", ("embed",), (d,))
        s_up, s_down = spec.project.scales(self, "up"), spec.project.scales(self, "down")
        h = spec.project("btd,dcf->btcf" if cfg.swiglu else "btd,df->btf", x_btd, w_up, s_up)
        return _plus(spec.mlp(h, b_up, w_down, s_down, spec.project, self.rules), b_down)


class Block(nn.Module):
    """Pre-LN transformer block (post-LN with `cfg.post_layernorm`: each layer norm after its residual
    add). `rng`, or else the 'dropout' stream of Flax's `rngs`, drives dropout; deterministic=True or
    neither turns it off. With a KV `cache` (see Attention) it returns (output, updated cache);
    `positions_bt` place the tokens for rotary embeddings (generation's left-padded rows). Its parts are its
    `spec`'s (jax3d.models.spec; None: `block_spec(cfg)`, no kernel)."""

    cfg: ModelConfig
    rules: ShardingRules = DEFAULT_RULES  # Megatron's table; with no mesh in context, no constraint
    spec: BlockSpec | None = None
    causal: bool = True

    @nn.compact
    def __call__(self, x_btd, mask=None, rng=None, deterministic=True, cache=None, positions_bt=None):
        cfg, spec = self.cfg, self.spec or block_spec(self.cfg)
        rng = _dropout_rng(self, rng, deterministic)
        r_attn, r_h1, r_h2 = dropout_keys.split(rng, 3) if rng is not None else (None,) * 3
        stream = ("batch", "act_seq", "embed")
        before = not cfg.post_layernorm  # each layer norm before its sublayer, or after the residual add
        x_btd = self.rules.constrain(x_btd, stream)
        with jax.named_scope("attention"):
            h = _norm_if(before, cfg, spec, "ln_attn", x_btd)
            h, cache = Attention(cfg, self.rules, spec, self.causal, name="attn")(h, mask, r_attn, deterministic,
                                                                                cache, positions_bt)
            h = self.rules.constrain(h, stream)
            x_btd = x_btd + _dropout(h, cfg.hidden_dropout, r_h1, deterministic)
            x_btd = _norm_if(not before, cfg, spec, "ln_attn", x_btd)
        with jax.named_scope("mlp"):
            h = _norm_if(before, cfg, spec, "ln_mlp", x_btd)
            h = MLP(cfg, self.rules, spec, name="mlp")(h)
            h = self.rules.constrain(h, stream)
            x_btd = x_btd + _dropout(h, cfg.hidden_dropout, r_h2, deterministic)
            x_btd = _norm_if(not before, cfg, spec, "ln_mlp", x_btd)
        return x_btd if cache is None else (x_btd, cache)  # training's x; generation's x and its cache


def _norm_if(on: bool, cfg: ModelConfig, spec: BlockSpec, name: str, x):
    """x through the named layer norm when `on`, else x: the pre- / post-LN switch."""
    return norm_for(cfg, spec, name)(x) if on else x


class Embedding(nn.Module):
    """Vocab-parallel word embedding plus learned positions (none with `cfg.add_position_embedding` off) and
    token types for BERT."""

    cfg: ModelConfig
    rules: ShardingRules = DEFAULT_RULES  # Megatron's table; with no mesh in context, no constraint
    num_tokentypes: int = 0
    spec: BlockSpec | None = None  # its norm's part (None: block_spec(cfg), no kernel)

    @nn.compact
    def __call__(self, tokens_bt, types_bt=None, rng=None, deterministic=True, positions_bt=None):
        cfg = self.cfg
        init = nn.initializers.normal(cfg.init_method_std)
        wte = _param(self, "word", ("vocab", "embed"), (cfg.vocab_size, cfg.hidden_size), init)
        if tokens_bt.shape[1] > cfg.max_position_embeddings:
            raise ValueError(f"a sequence of {tokens_bt.shape[1]} tokens is longer than the model's "
                             f"{cfg.max_position_embeddings} positions; shorten it or raise --max-position-embeddings")
        # Explicit positions are for generation, where left-padded rows start counting at their first token.
        # Otherwise positions are still gathered per token: broadcasting wpe[:t] over the batch made XLA
        # lay the whole residual stream out batch-minor and transpose it around every GEMM (docs/performance.md).
        if self.rules.splits("act_seq"):
            # The output is split over the sequence. Left open, that split reaches back to the token ids, and a
            # GPT's `text[:, :-1]` of its (seq + 1)-long rows becomes a collective-permute between neighbours,
            # which deadlocks inside the pipeline's first-stage branch (the other stages never join it).
            tokens_bt = self.rules.constrain(tokens_bt, ("batch", "seq"))
        pos = None
        if cfg.add_position_embedding:
            wpe = _param(self, "position", ("pos", "embed"), (cfg.max_position_embeddings, cfg.hidden_size), init)
            if positions_bt is None:
                positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
            elif self.rules.splits("act_seq"):  # as the tokens (positions reset at documents are computed)
                positions_bt = self.rules.constrain(positions_bt, ("batch", "seq"))
            pos = jnp.take(wpe, positions_bt, axis=0)
        # A gather from a vocab-sharded table: XLA's SPMD partitioner does the masked local lookup and
        # all-reduce over `model` (Megatron's VocabParallelEmbedding) without gathering the table.
        x_btd = _plus(quantized.take(wte, tokens_bt), pos)
        if self.num_tokentypes:
            wtt = _param(self, "tokentype", ("types", "embed"), (self.num_tokentypes, cfg.hidden_size), init)
            x_btd = x_btd + jnp.take(wtt, types_bt, axis=0)
        if cfg.embedding_layernorm:
            x_btd = norm_for(cfg, self.spec or block_spec(cfg), "norm", one_plus=False)(x_btd)
        x_btd = self.rules.constrain(x_btd, ("batch", "act_seq", "embed"))
        return _dropout(x_btd, cfg.hidden_dropout, _dropout_rng(self, rng, deterministic), deterministic)


def vocab_parallel_logits(x_btd, wte_vd, rules: ShardingRules):
    """LM-head logits of the (vocab, embed) output table, sharded over the vocabulary, in the compute dtype.

    In bf16 both backward GEMMs run on bf16 tensor cores and the logits and their gradient take half the
    memory; asking the GEMM for fp32 output instead makes XLA run all three on TF32 kernels.
    `cross_entropy_sum` upcasts inside its reductions, so the loss is still summed in fp32.
    """
    logits = quantized.einsum("btd,vd->btv", x_btd, wte_vd)
    return rules.constrain(logits, ("batch", "seq", "vocab"))


# Tokens of the global batch per chunk of the fused head and loss: [8192, 50304] bf16 logits are 0.8 GB,
# and GEMMs of 8192 rows still run at full speed.
LOSS_CHUNK_TOKENS = 8192


def loss_chunks(batch: int, seq: int) -> int:
    """Sequence chunks for `fused_lm_loss_sum`: the most that divide `seq` and keep LOSS_CHUNK_TOKENS each."""
    most = max(1, batch * seq // LOSS_CHUNK_TOKENS)
    return max(c for c in range(1, min(most, seq) + 1) if seq % c == 0)


def fused_lm_loss_sum(x_btd, wte_vd, targets_bt, mask_bt, rules: ShardingRules, valid_vocab: int = 0,
                      xent=None):
    """`cross_entropy_sum` of the tied LM head's logits, run over `loss_chunks` slices of the sequence.

    Each slice's logits live only inside its loop step. When differentiated, the forward pass also
    computes the gradients (of x by one GEMM, of the table accumulated in fp32 by another), so the
    backward pass only scales them by the incoming cotangent: the full logits and their gradient are
    never stored, and nothing is recomputed. The same three GEMMs run as in the unfused head, in less memory
    (docs/performance.md). Reverse mode only (a custom VJP): for `jax.jvp`, take `cross_entropy_sum` of the
    whole logits. With `xent` (fused_xent's Tuning, where the kernel policy runs it) each chunk's cross-entropy
    and its gradient are that kernel's.
    """
    b, t, d = x_btd.shape
    chunks = loss_chunks(b, t)
    tuning = xent if xent is not None and kernel("fused_xent").supported(b * (t // chunks), xent) else None

    def split(a):  # (b, t, ...) -> (chunks, b, t / chunks, ...)
        return jnp.moveaxis(a.reshape(b, chunks, t // chunks, *a.shape[2:]), 1, 0)

    def run(x, w, targets, mask, with_grads: bool):
        def step(carry, xs):
            loss, dw = carry
            x_c, t_c, m_c = xs
            logits = vocab_parallel_logits(x_c, w, rules)
            m = m_c.astype(jnp.float32)
            if tuning is not None:
                nll, dlogits = kernel("fused_xent").run(logits, t_c, m, valid_vocab, x.dtype if with_grads else None,
                                                        tuning)
            else:
                nll, dnll = token_nll(logits, t_c, valid_vocab)
                dlogits = (dnll * m[..., None]).astype(x.dtype) if with_grads else None
            loss = loss + jnp.sum(nll * m)
            if not with_grads:
                return (loss, dw), None
            dlogits = rules.constrain(dlogits, ("batch", "seq", "vocab"))
            dx_c = jnp.einsum("btv,vd->btd", dlogits, w)
            dw = dw + jnp.einsum("btv,btd->vd", dlogits, x_c, preferred_element_type=jnp.float32)
            return (loss, rules.constrain(dw, ("vocab", "embed"))), dx_c

        x = rules.constrain(x, ("batch", "seq", "embed"))
        refs = (x, w, targets, mask)
        dw0 = None
        if with_grads:
            dw0 = rules.constrain(_varying_like(jnp.zeros(w.shape, jnp.float32), *refs), ("vocab", "embed"))
        carry = (_varying_like(jnp.float32(0), *refs), dw0)
        (loss, dw), dx = jax.lax.scan(step, carry, (split(x), split(targets), split(mask)))
        if not with_grads:
            return loss
        return loss, jnp.moveaxis(dx, 0, 1).reshape(b, t, d), dw

    @jax.custom_vjp
    def loss_sum(x, w, targets, mask):
        return run(x, w, targets, mask, False)

    def fwd(x, w, targets, mask):
        loss, dx, dw = run(x, w, targets, mask, True)
        return loss, (dx, dw)

    def bwd(res, g):
        dx, dw = res
        # Scaled in fp32: in fp16, the cotangent (1 / tokens without a loss scale) could underflow.
        return ((dx.astype(jnp.float32) * g).astype(dx.dtype), (dw * g).astype(wte_vd.dtype), None, None)

    loss_sum.defvjp(fwd, bwd)
    return loss_sum(x_btd, wte_vd, targets_bt, mask_bt)


def _varying_like(zero, *refs):
    """`zero` marked varying over the manual mesh axes (inside a shard_map) that any of `refs` varies
    over: a scan's carry must start as varying as the step makes it."""
    axes = sorted({a for r in refs for a in jax.typeof(r).manual_axis_type.varying})
    return jax.lax.pcast(zero, tuple(axes), to="varying") if axes else zero


def cross_entropy_sum(logits_btv, targets_bt, mask_bt, valid_vocab: int = 0):
    """Summed token cross-entropy over vocab-sharded logits, never gathering them on one device.

    logsumexp and the target pick are reductions over the sharded vocab dim, so XLA emits partial
    reductions plus an all-reduce of (batch, seq) scalars; the one-hot compare fuses into the reduce.
    With `valid_vocab` the padding columns past it are left out, as in the unpadded model it came from.
    """
    nll, _ = token_nll(logits_btv, targets_bt, valid_vocab)
    mask = mask_bt.astype(jnp.float32)
    return jnp.sum(nll * mask), jnp.sum(mask)


def token_nll(logits_btv, targets_bt, valid_vocab: int):
    """Each token's negative log-likelihood, and its gradient with respect to the logits (unscaled).

    The logits go to fp32 inside the reductions (never stored); padding columns past `valid_vocab` are
    left out. A caller that needs only the loss leaves the gradient unused, and XLA drops it.
    """
    logits_btv = logits_btv.astype(jnp.float32)
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits_btv.shape, 2)
    if valid_vocab:
        logits_btv = jnp.where(vocab < valid_vocab, logits_btv, -jnp.inf)
    lse = jax.nn.logsumexp(logits_btv, axis=-1)
    hit = vocab == targets_bt[..., None]
    nll = lse - jnp.sum(jnp.where(hit, logits_btv, 0.0), axis=-1)
    return nll, jnp.exp(logits_btv - lse[..., None]) - hit
