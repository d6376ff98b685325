"""A pre-LN block's decode step at batch 1 on one GPU, as jax3d.kernels.row_gemv's kernels and the decode
attention kernel: what layers.Block computes for one token with a KV cache, in six kernels where XLA ran eleven
(a GPT's; rotary positions add XLA's own between the QKV and the attention).

Generation stores the weights as rows at batch 1 on a GPU (jax3d.inference.generate.as_rows) or in fp8; either
way they are Quantized, which `row_gemv` reads. Whether the kernels run is the run's KernelPolicy. The step is:

    x = row_gemv(ctx(row_gemv(x, qkv, ln_attn, qkv_bias)), out, out_bias, residual x)
    x = row_gemv(row_gemv(x, up, ln_mlp, up_bias, activation), down, down_bias, residual x)

where ctx is decode_attention over the cache (which also writes the step's key and value into it). A block
this does not take (`applies`) runs layers.Block with the decode spec (cached_attention.decode_spec), and so does
every block with the row_gemv kernel left out of the policy (`KernelPolicy.resolve(..., off=["row_gemv"])`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax3d.config import ModelConfig
from jax3d.inference import cached_attention
from jax3d.kernels import decode_attention, kernel, row_gemv
from jax3d.kernels.policy import KernelPolicy
from jax3d.models import rope
from jax3d.models.quantized import Quantized
from jax3d.models.spec import activation_of, split_qkv

WEIGHTS = (("attn", "qkv_kernel"), ("attn", "out_kernel"), ("mlp", "up_kernel"), ("mlp", "down_kernel"))


def applies(cfg: ModelConfig, params: dict, x_btd, cache: dict, kernels: KernelPolicy) -> bool:
    """Whether `block` computes this decode step of layers.Block: one token of one row, with the row_gemv and
    decode attention kernels in the policy `kernels` (one GPU's), a pre-LN block, its GEMM weights Quantized, an
    activation the kernel has, and a cache the decode attention kernel takes (with the rows' first slots), norms
    that store their scales (not --apply-layernorm-1p's offsets from 1)."""
    if (not kernels.uses("row_gemv") or x_btd.shape[:2] != (1, 1) or "start" not in cache or cfg.post_layernorm
            or cfg.one_plus_norms
            or activation_of(cfg) not in row_gemv.ACTIVATIONS
            or not all(isinstance(params[a][w], Quantized) for a, w in WEIGHTS)):
        return False
    if not kernels.takes("decode_attention", cache["k"]):
        return False
    d, a, m = cfg.hidden_size, params["attn"], params["mlp"]
    return (kernels.takes("row_gemv", d, a["qkv_kernel"])
            and kernels.takes("row_gemv", cfg.num_attention_heads * cfg.head_dim, a["out_kernel"])
            and row_gemv.supported(d, m["up_kernel"], kernels.tuning("row_gemv"), activation_of(cfg))
            and kernels.takes("row_gemv", cfg.ffn_hidden_size, m["down_kernel"]))


def _norm(cfg: ModelConfig, p: dict) -> row_gemv.Norm:
    return row_gemv.Norm(p["scale"], None if cfg.normalization == "rmsnorm" else p["bias"], cfg.layernorm_epsilon)


def block(cfg: ModelConfig, params: dict, x_btd, cache: dict, positions_bt=None, kernels: KernelPolicy | None = None,
          interpret: bool = False):
    """(x (1, 1, embed), {'k', 'v'}) after the block `params` (one layer's, as layers.Block names them) for
    one token `x_btd`: layers.Block's decode step (`applies`), the key and value written into `cache` ({'k',
    'v', 'index', 'start'}, updated in place where donated), with the kernels' Tunings of `kernels` (None: their
    defaults). `interpret=True` runs the kernels in Pallas' interpreter, on any backend (for tests)."""
    tuning = (kernels and kernels.tuning("row_gemv")) or row_gemv.DEFAULT
    attention_tuning = (kernels and kernels.tuning("decode_attention")) or decode_attention.DEFAULT
    a, m = params["attn"], params["mlp"]
    g = cfg.num_attention_heads // cfg.kv_heads
    x = x_btd.reshape(-1)
    kw = dict(tuning=tuning, interpret=interpret)
    with jax.named_scope("attention"):
        qkv = kernel("row_gemv").run(x, a["qkv_kernel"], _norm(cfg, params["ln_attn"]), bias=a.get("qkv_bias"), **kw)
        qkv = qkv.reshape(1, 1, g + 2, cfg.kv_heads, cfg.head_dim)
        if cfg.use_rotary_position_embeddings:
            positions_bt = rope.positions_for(x_btd) if positions_bt is None else positions_bt
            q, k, v = split_qkv(qkv)
            inv_freq = rope.inverse_frequencies(cfg)
            qkv = cached_attention.join_qkv(rope.apply_rope(q, positions_bt, inv_freq),
                                            rope.apply_rope(k, positions_bt, inv_freq), v)
        ctx, k_cache, v_cache = kernel("decode_attention").run(
            qkv[:, 0], cache["k"], cache["v"], cache["start"], cache["index"], tuning=attention_tuning,
            interpret=interpret)
        x = kernel("row_gemv").run(ctx, a["out_kernel"], bias=a.get("out_bias"), residual=x, **kw)
    with jax.named_scope("mlp"):
        h = kernel("row_gemv").run(x, m["up_kernel"], _norm(cfg, params["ln_mlp"]), bias=m.get("up_bias"),
                              activation=activation_of(cfg), **kw)
        x = kernel("row_gemv").run(h, m["down_kernel"], bias=m.get("down_bias"), residual=x, **kw)
    return x.reshape(x_btd.shape), {"k": k_cache, "v": v_cache}


def head_applies(cfg: ModelConfig, table, x_btd, kernels: KernelPolicy) -> bool:
    """Whether `head` computes the LM head of this step: one token of one row, the row_gemv kernel in the policy
    `kernels`, the output `table` Quantized, a final norm that stores its scale (not --apply-layernorm-1p's
    offset)."""
    return (x_btd.shape[:2] == (1, 1) and not cfg.one_plus_norms
            and kernels.takes("row_gemv", cfg.hidden_size, table))


def head(cfg: ModelConfig, final_norm: dict, table, x_btd, kernels: KernelPolicy | None = None,
         interpret: bool = False):
    """fp32 logits (1, 1, vocab) of one token `x_btd` after the final norm and the output `table` (the
    model's final_logits), in one row_gemv kernel (`head_applies`)."""
    tuning = (kernels and kernels.tuning("row_gemv")) or row_gemv.DEFAULT
    logits = kernel("row_gemv").run(x_btd.reshape(-1), table, _norm(cfg, final_norm), tuning=tuning,
                                    interpret=interpret)
    return logits.astype(jnp.float32).reshape(1, 1, -1)
