"""Text generation for jax3d GPT models (Llama included): a KV cache, a prefill and a decode function compiled
once each.

Prompts of a batch are padded on the left to one length, so every row's next token sits in the same
cache slot. A row's positions count its own tokens only (pads don't advance them), and its queries
never see its pads; that gives each row the numbers it would get alone (learned or rotary positions alike).
The cache is one {'k', 'v': (batch, kv_heads, max_len, head_dim)} per layer, grouped-query attention's KV
heads only, sharded over them like the attention it feeds, and is donated to each step, so decoding updates
it in place.

    gen = Generator(cfg, params, mesh, batch=4, max_len=96)
    tokens = gen.generate(prompts, max_new_tokens=32, sampling=Sampling(greedy=True))
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax3d.config import ConfigError, ModelConfig
from jax3d.parallel.mesh import DATA, MODEL, with_auto_axes
from jax3d.parallel.plan import generation_plan
from jax3d.parallel.precision import generation_device_error
from jax3d.inference import decode_rows
from jax3d.inference.cached_attention import CACHE_AXES, decode_spec, visible
from jax3d.kernels.policy import KernelPolicy
from jax3d.models import build_model, quantized
from jax3d.models.layers import Block
from jax3d.parallel import named_shardings, tree_specs
from jax3d.xla_options import unless_in_xla_flags

PROMPT_BUCKET = 16


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy (argmax), or sampled at `temperature` from the `top_k`
    most likely tokens (0: all) within cumulative probability `top_p` (1.0: all)."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def validate(self) -> None:
        unused = [f"{flag} {v}" for flag, v, off in (("--temperature", self.temperature, 1.0),
                                                      ("--top-k", self.top_k, 0), ("--top-p", self.top_p, 1.0))
                  if v != off]
        if self.greedy and unused:
            raise ConfigError(f"--greedy takes the most likely token, so {', '.join(unused)} would go unused; drop "
                              "--greedy to sample, or drop them")
        if not self.greedy and not 0 < self.temperature < float("inf"):  # nan too: it sampled nothing
            raise ConfigError(f"--temperature {self.temperature} must be positive and finite (or pass --greedy)")
        if self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k} must be 0 (off) or positive")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p {self.top_p} must be in (0, 1]")


def pick(logits_bv, sampling: Sampling, key) -> jax.Array:
    """Next token (batch,) from fp32 logits (batch, vocab), padding columns already at -inf.

    With `top_k`, top-p and the draw run over the k candidates only (already sorted), not the vocabulary:
    a sort of 50k logits per row and token is the slowest part of sampling. The random bits depend on the
    key and the shape only, never on how the logits are sharded, so every layout samples the same tokens."""
    if sampling.greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits_bv = logits_bv / sampling.temperature
    if sampling.top_k:
        logits_bk, ids_bk = jax.lax.top_k(logits_bv, sampling.top_k)  # descending
        if sampling.top_p < 1.0:
            logits_bk = _top_p(logits_bk, sampling.top_p)
        choice = jax.random.categorical(key, logits_bk, axis=-1)
        return jnp.take_along_axis(ids_bk, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    if sampling.top_p < 1.0:
        order = jnp.argsort(-logits_bv, axis=-1)
        keep_sorted = _top_p(jnp.take_along_axis(logits_bv, order, axis=-1), sampling.top_p) > -jnp.inf
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(order.shape[0])[:, None], order].set(keep_sorted)
        logits_bv = jnp.where(keep, logits_bv, -jnp.inf)
    return jax.random.categorical(key, logits_bv, axis=-1).astype(jnp.int32)


def _top_p(sorted_logits, top_p: float):
    """Logits sorted descending with those past the nucleus at -inf: a token stays while the mass before it
    is still under top_p (so the most likely always does)."""
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    return jnp.where((jnp.cumsum(probs, axis=-1) - probs) < top_p, sorted_logits, -jnp.inf)


PAD = -1  # a finished row's token in a chunk
CHUNK = 32  # tokens per decode call at most: how often the host sees the stream (and stop strings)
# On a GPU XLA captures sequences of kernels as CUDA graphs (command buffers); with WHILE and CONDITIONAL in the set,
# the token loop itself is one graph, so a decode step pays no launch per kernel from the host, which decoded faster
# on one H100 at batch 1 and 32 (docs/decode.md, docs/performance.md "Kernel notes"). Other backends ignore the option.
DECODE_COMPILER_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"}


def decode_compiler_options(env=os.environ) -> dict:
    """DECODE_COMPILER_OPTIONS, unless XLA_FLAGS sets the command buffers itself: then that wins (to debug, or to
    measure decode without the graph)."""
    return unless_in_xla_flags(DECODE_COMPILER_OPTIONS, env)


class Generator:
    """Prefill and decode of one GPT on `mesh` (tensor parallel over `model`, rows over `data`) for a
    fixed batch size and cache length; both are jitted once and reused for every call.

    Decode is a `lax.while_loop` over up to CHUNK tokens inside one program (the token count is an argument,
    so one compile serves any count): no host round trip per token, and the cache, donated, is updated in
    place. Each row carries `done` on the device: it ends at the end-of-document token or its own token
    budget; a finished row's tokens are PAD, and the loop stops when every row is done. The host sees each
    chunk as it comes (streaming, stop strings) and can end rows for the next chunk (`halt`).

    `params` are in logical layer order. A train state under an interleaved or uneven pipeline keeps its
    layers in pipeline order: pass `steps.logical_params(state.params)`, not `state.params`. `mesh` has
    jax3d's axis names, as `MeshConfig.build` or `jax.make_mesh` make them (Explicit axes are taken as
    Auto). `cache_dtype` is the KV cache's (None: `dtype`); jnp.float8_e4m3fn halves its bytes
    (cached_attention). `weight_dtype` jnp.float8_e4m3fn keeps the blocks' GEMM weights and the vocabulary tables
    in fp8, a scale per output column (jax3d.models.quantized): half the bytes a step reads of them; None keeps them
    in `dtype` (at batch 1 on a GPU stored column by column: `as_rows`)."""

    def __init__(self, cfg: ModelConfig, params, mesh, *, batch: int, max_len: int, dtype=jnp.float32,
                 eod: int | None = None, chunk: int = CHUNK, cache_dtype=None, weight_dtype=None, rules=None,
                 kernels: KernelPolicy | None = None):
        if cfg.model_type != "gpt":
            raise ConfigError(f"generation needs a GPT checkpoint, but this one is a {cfg.model_type}; "
                              "pass a checkpoint trained with --model gpt")
        if max_len > cfg.max_position_embeddings:
            raise ConfigError(f"prompt plus --max-new-tokens is {max_len} tokens, longer than the model's "
                              f"{cfg.max_position_embeddings} positions; shorten the prompt or ask for fewer tokens")
        mesh = with_auto_axes(mesh, (DATA, MODEL), "generation")
        rows = dict(mesh.shape).get(DATA, 1)
        if batch % rows:
            raise ConfigError(f"a batch of {batch} does not split over the mesh's {rows} data devices; pass a "
                              f"batch that is a multiple of {rows}, or a mesh with data = 1")
        stacked = jax.tree.leaves(params["blocks"])[0].shape[0]
        if stacked != cfg.num_layers:
            raise ConfigError(f"params['blocks'] stacks {stacked} layers but the model has {cfg.num_layers}: a "
                              "pipelined train state keeps its layers in pipeline order; pass "
                              "steps.logical_params(state.params)")
        self.cfg, self.mesh, self.batch, self.max_len, self.dtype, self.eod = cfg, mesh, batch, max_len, dtype, eod
        self.chunk = chunk
        self.cache_dtype = jnp.dtype(cache_dtype or dtype)
        self.weight_dtype = None if weight_dtype is None else jnp.dtype(weight_dtype)
        if self.weight_dtype not in (None, jnp.dtype(quantized.E4M3)):
            raise ConfigError(f"weights can be kept in fp8 (float8_e4m3fn) for generation, not {self.weight_dtype}")
        devices = list(mesh.devices.flat)
        refused = generation_device_error(self.cache_dtype.itemsize == 1, self.weight_dtype is not None, devices)
        if refused:
            raise ConfigError(refused)
        # The plan's table (generator_for passes it); a mesh handed in directly gets the plan of its own size.
        self.rules = rules if rules is not None else generation_plan(cfg, mesh.shape[MODEL]).rules
        # The kernels and the attention the mesh's devices run (generator_for passes the plan's; benchmarks their own).
        self.kernels = kernels if kernels is not None else KernelPolicy.resolve(devices[0].platform, len(devices))
        model_cfg = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)
        self.model = build_model(model_cfg, self.rules, kernels=self.kernels)
        self.block = Block(model_cfg, self.rules, decode_spec(model_cfg, self.kernels))  # the blocks with a cache
        self.vocab = cfg.unpadded_vocab_size or cfg.vocab_size
        specs = tree_specs(self.rules, self.model.logical_axes())
        # Blocks are kept as one tree per layer and the layer loop is unrolled in the token loop's body:
        # decode reads each weight once per token, and slicing a stack inside the loop could cost a copy of it.
        layer_specs = jax.tree.map(lambda s: P(*tuple(s)[1:]), specs.pop("blocks"), is_leaf=lambda x: isinstance(x, P))
        layer_sh = named_shardings(mesh, layer_specs)
        ends = {k: v for k, v in params.items() if k != "blocks"}
        ends_sh = named_shardings(mesh, specs)
        self.params = _placed(ends, ends_sh, dtype)
        # fp8 weights, or at batch 1 on a GPU the weights themselves stored as rows: either way jax3d's
        # Quantized, whose product of one row is a row reduction (jax3d.models.quantized.dot)
        stored = self.weight_dtype is not None or as_rows(batch, self.kernels)
        if stored:
            self.params = _quantized(self.params, ends_sh, self.weight_dtype)

        def layer(i):  # placed, and stored at once: one layer's weights at a time held twice, never the model's
            placed = _placed(jax.tree.map(lambda a: a[i] if _concrete(a) else
                                          jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params["blocks"]),
                             layer_sh, dtype)
            return _quantized(placed, layer_sh, self.weight_dtype) if stored else placed
        self.params["blocks"] = [layer(i) for i in range(cfg.num_layers)]
        kv = NamedSharding(mesh, self.rules.spec(CACHE_AXES))
        self.cache_sharding = [{"k": kv, "v": kv} for _ in range(cfg.num_layers)]
        self._repl = NamedSharding(mesh, self.rules.spec(()))
        self._jits: dict = {}
        self._traces = {"prefill": 0, "decode": 0}  # a trace is a compile: jit caches by shape

    # ---- the model with a cache ---------------------------------------------------------------
    def _logits(self, params, cache, tokens_bt, positions_bt, start_b, query_slots_t, index):
        """fp32 logits (batch, vocab) after the last of `tokens_bt`, written at cache slot `index`, and the
        new cache."""
        m = self.model
        x = m.embed_at(params, tokens_bt, positions_bt)
        mask = self._mask(start_b, query_slots_t)
        new_cache = []
        for p, c in zip(params["blocks"], cache):
            c = {**c, "index": index, "start": start_b}
            if decode_rows.applies(self.cfg, p, x, c, self.kernels):  # batch 1 on a GPU: fused kernels
                x, c = decode_rows.block(self.cfg, p, x, c, positions_bt, self.kernels)
            else:
                x, c = self.block.apply({"params": p}, x, mask, None, True, c, positions_bt)
            new_cache.append({"k": c["k"], "v": c["v"]})
        table = m.output_table(params)
        if decode_rows.head_applies(self.cfg, table, x, self.kernels):
            logits = decode_rows.head(self.cfg, params["final_norm"], table, x, self.kernels)[:, 0]
        else:
            logits = m.final_logits(params, x[:, -1:])[:, 0]  # the head of the last token only (prefill)
        if self.vocab < logits.shape[-1]:  # padding columns are never picked
            col = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
            logits = jnp.where(col < self.vocab, logits, -jnp.inf)
        return logits, new_cache

    def _mask(self, start_b, query_slots_t):
        """(batch, 1, t, max_len): the query at slot s sees the row's keys from its first token (slot
        `start`) to s, and always itself (cached_attention.visible). Built from two iotas and compares, which
        XLA fuses into the attention's softmax: nothing of max_len is stored."""
        slots = jax.lax.broadcasted_iota(jnp.int32, (1, 1, self.max_len), 2)
        q = query_slots_t[None, :, None]
        return visible(slots, start_b[:, None, None], q)[:, None]

    def _prefill(self, sampling: Sampling):
        def prefill(params, tokens_bt, valid_bt, budget_b, eod, key):
            self._traces["prefill"] += 1
            b, t = tokens_bt.shape
            shape = (b, self.cfg.kv_heads, self.max_len, self.cfg.head_dim)
            cache = [{"k": jnp.zeros(shape, self.cache_dtype), "v": jnp.zeros(shape, self.cache_dtype)}
                     for _ in range(self.cfg.num_layers)]
            cache = jax.lax.with_sharding_constraint(cache, self.cache_sharding)
            count_b = jnp.sum(valid_bt, axis=1).astype(jnp.int32)
            positions_bt = jnp.maximum(jnp.cumsum(valid_bt, axis=1) - 1, 0).astype(jnp.int32)
            logits, cache = self._logits(params, cache, tokens_bt, positions_bt, t - count_b, jnp.arange(t), 0)
            tok = pick(logits, sampling, jax.random.fold_in(key, 0))
            left = budget_b - 1
            state = {"cache": cache, "start": t - count_b, "slot": jnp.int32(t), "position": count_b,
                     "token": tok, "left": left, "done": (tok == eod) | (left <= 0), "eod": eod, "step": jnp.int32(1),
                     "key": key}
            return tok, state
        return prefill

    def _decode(self, sampling: Sampling):
        def decode(params, state, n, halt_b):
            """Up to `n` (<= chunk) more tokens of each row: (tokens (batch, chunk), PAD past the end or
            where a row is done; the tokens made; each row's done) and the new state."""
            self._traces["decode"] += 1
            b = state["token"].shape[0]

            def more(carry):
                i, _, s = carry
                return (i < n) & ~jnp.all(s["done"])

            def one_token(carry):
                i, out_bc, s = carry
                logits, cache = self._logits(params, s["cache"], s["token"][:, None], s["position"][:, None],
                                             s["start"], s["slot"][None], s["slot"])
                tok = pick(logits, sampling, jax.random.fold_in(s["key"], s["step"]))
                live = ~s["done"]
                tok = jnp.where(live, tok, PAD)
                out_bc = jax.lax.dynamic_update_slice_in_dim(out_bc, tok[:, None], i, axis=1)
                left = s["left"] - live
                s = {**s, "cache": jax.lax.with_sharding_constraint(cache, self.cache_sharding), "token": tok,
                     "left": left, "done": s["done"] | (tok == s["eod"]) | (left <= 0), "slot": s["slot"] + 1,
                     "position": s["position"] + 1, "step": s["step"] + 1}
                return i + 1, out_bc, s

            state = {**state, "done": state["done"] | halt_b}
            out = jnp.full((b, self.chunk), PAD, jnp.int32)
            made, out, state = jax.lax.while_loop(more, one_token, (jnp.int32(0), out, state))
            return {"tokens": out, "made": made, "done": state["done"]}, state
        return decode

    def _compiled(self, sampling: Sampling) -> tuple[Callable, Callable]:
        if sampling not in self._jits:
            r = self._repl
            state_sh = {"cache": self.cache_sharding, **{k: r for k in ("start", "slot", "position", "token", "left",
                                                                            "done", "eod", "step", "key")}}
            prefill = jax.jit(self._prefill(sampling), out_shardings=(r, state_sh))
            decode = jax.jit(self._decode(sampling), out_shardings=({"tokens": r, "made": r, "done": r}, state_sh),
                             donate_argnums=1, compiler_options=decode_compiler_options())
            self._jits[sampling] = (prefill, decode)
        return self._jits[sampling]

    def compile_counts(self) -> dict:
        """How many times prefill and decode were traced and compiled (1 each per sampling setting and
        prompt bucket; decode never again per token)."""
        return dict(self._traces)

    def decode_hlo(self, prompts: list[list[int]], sampling: Sampling = Sampling(greedy=True),
                   compiler_options: dict | None = None) -> str:
        """The optimised HLO of the decode program (after a prefill of `prompts`), to check for copies of the
        cache and to count the kernels of a token. With abstract params (jax.ShapeDtypeStruct leaves) nothing
        runs: the prefill's state is abstract too, and only decode compiles, for the mesh's devices.
        `compiler_options` go beside decode's own (DECODE_COMPILER_OPTIONS), and win where both name one."""
        prefill, decode = self._compiled(sampling)
        tokens, valid = self.left_pad(prompts)
        args = (self.params, tokens, valid, np.ones(self.batch, np.int32), np.int32(PAD), jax.random.key(0))
        with jax.set_mesh(self.mesh):
            _, state = prefill(*args) if all(map(_concrete, jax.tree.leaves(self.params))) else prefill.eval_shape(*args)
            lowered = decode.lower(self.params, state, np.int32(1), np.zeros(self.batch, bool))
            return lowered.compile(compiler_options).as_text()

    # ---- driving it ---------------------------------------------------------------------------
    def left_pad(self, prompts: list[list[int]], length: int = 0, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, valid) (batch, max(longest prompt, length)), prompts right-aligned; rows past the
        prompts are one-token fillers."""
        if len(prompts) > self.batch:
            raise ConfigError(f"{len(prompts)} prompts exceed the generator's batch of {self.batch}")
        if any(len(p) == 0 for p in prompts):
            raise ConfigError("a prompt is empty; give every prompt at least one token")
        t = max(length, max(len(p) for p in prompts))
        tokens = np.full((self.batch, t), pad_id, np.int32)
        valid = np.zeros((self.batch, t), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, t - len(p):] = p
            valid[i, t - len(p):] = 1
        valid[len(prompts):, -1] = 1  # filler rows: one token, never read
        return tokens, valid

    def stream(self, prompts: list[list[int]], max_new_tokens: int | list[int],
               sampling: Sampling = Sampling(greedy=True), seed: int = 0, stop_at_eod: bool = False,
               halt: np.ndarray | None = None) -> Iterator[np.ndarray]:
        """Yields chunks (len(prompts), n) of the next tokens of every row: first the one prefill picks,
        then up to `chunk` at a time, PAD where a row is done. A row is done after `max_new_tokens` tokens
        (one number, or one per prompt), or after `eod` when `stop_at_eod`; the stream ends when every
        row is. `halt` (len(prompts),) bool, which the caller may set between chunks, ends rows too (stop
        strings): the device learns it from the next chunk dispatched, which is one ahead of the chunk
        yielded, so a halted row may make up to one more chunk of tokens, for the caller to drop."""
        sampling.validate()
        if sampling.top_k > self.vocab:
            raise ConfigError(f"--top-k {sampling.top_k} exceeds the model's {self.vocab} tokens; pass at most that, "
                              "or 0 for all")
        if not np.isscalar(max_new_tokens) and len(max_new_tokens) != len(prompts):
            raise ConfigError(f"{len(max_new_tokens)} token budgets for {len(prompts)} prompts; give one per prompt")
        budget = np.zeros(self.batch, np.int32)  # filler rows: done at once
        budget[:len(prompts)] = max_new_tokens
        most = int(budget.max(initial=0))
        longest = max((len(p) for p in prompts), default=0)
        if longest + most > self.max_len:
            raise ConfigError(f"the longest prompt ({longest} tokens) plus --max-new-tokens {most} exceeds "
                              f"the {self.max_len} tokens of the cache; shorten the prompt or ask for fewer tokens")
        if budget[:len(prompts)].min(initial=1) < 1:
            raise ConfigError(f"--max-new-tokens {budget[:len(prompts)].min()} must be at least 1")
        # Prompt lengths rounded up to a bucket, so prompts of similar length share one prefill compile.
        bucket = min(-(-longest // PROMPT_BUCKET) * PROMPT_BUCKET, self.max_len - most)
        tokens, valid = self.left_pad(prompts, bucket)
        prefill, decode = self._compiled(sampling)
        eod = np.int32(self.eod if stop_at_eod and self.eod is not None else PAD)
        halted = np.zeros(self.batch, bool)
        rows = len(prompts)
        with jax.set_mesh(self.mesh):
            first, state = prefill(self.params, tokens, valid, budget, eod, jax.random.key(seed))
            made = 1
            pending = None
            while True:
                # The next chunk is dispatched before this one is copied to the host, so the device never
                # waits on Python (at worst one chunk runs past the end, doing nothing once all rows are done).
                ask = min(self.chunk, most - made)
                if halt is not None:
                    halted[:rows] = halt
                nxt = None
                if ask > 0:
                    nxt, state = decode(self.params, state, np.int32(ask), halted.copy())  # (a CPU may not copy)
                    made += ask
                if pending is None:
                    yield np.asarray(first)[None, :rows].T
                else:
                    got = jax.device_get(pending)
                    yield got["tokens"][:rows, :int(got["made"])]
                    if (got["done"][:rows] | (False if halt is None else halt)).all():
                        return
                if nxt is None:
                    return
                pending = nxt

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                 sampling: Sampling = Sampling(greedy=True), seed: int = 0, stop_at_eod: bool = False
                 ) -> list[list[int]]:
        """The continuation tokens of each prompt: `max_new_tokens` of them, or up to and with `eod`
        when `stop_at_eod`."""
        out = np.concatenate(list(self.stream(prompts, max_new_tokens, sampling, seed, stop_at_eod)), axis=1)
        return [[int(t) for t in row if t != PAD] for row in out]


def as_rows(batch: int, kernels: KernelPolicy) -> bool:
    """Whether a Generator of `batch` rows under the kernel policy `kernels` stores its GEMM weights and vocabulary
    tables column by column (a Quantized weight without a scale: the same values, the same bytes). Each decode
    product is then one row's, a row reduction that reads each weight once. An experiment with this layout (bf16
    weights quantized with unit scales; docs/decode.md "On one H200", docs/performance.md "Kernel notes") decoded
    gpt-1.3b faster than XLA's GEMMs at batch 1 and slower at batch 32, so batch 1 only; off the GPU it is untimed,
    so GPUs only. This code path itself is timed only as the default (docs/decode.md), not against the columns. The blocks'
    weights are the Generator's own copies either way, stored as each layer is placed; the vocabulary tables, whose
    contracted dim is already last, are copied once and go through `quantized.dot`'s reduction."""
    return batch == 1 and kernels.platform == "gpu"


def _concrete(a) -> bool:
    return not isinstance(a, jax.ShapeDtypeStruct)


def _quantized(tree, shardings, dtype):
    """Placed parameters (a layer, or the embedding and head) with jax3d.models.quantized.CONTRACTED's weights
    Quantized in `dtype` (None: their own values, without a scale), each on its weight's sharding (its values'
    spec in their stored order) and its scale on the weight's spec without the contracted dims; abstract leaves
    (see _placed) stay abstract."""
    def out_sharding(path, a, sh):
        contracted = quantized.CONTRACTED.get(path[-1].key)
        if contracted is None:
            return sh
        spec = tuple(sh.spec) + (None,) * (a.ndim - len(sh.spec))  # past its length a spec replicates
        values = P(*[spec[i] for i in quantized.stored_order(a.ndim, contracted)])
        scale = P(*[s for i, s in enumerate(spec) if i not in contracted])
        return quantized.Quantized(NamedSharding(sh.mesh, values),
                                   None if dtype is None else NamedSharding(sh.mesh, scale), contracted)
    out_sh = jax.tree_util.tree_map_with_path(out_sharding, tree, shardings)
    if all(_concrete(a) for a in jax.tree.leaves(tree)):
        return jax.jit(quantized.quantize_params, static_argnums=1, out_shardings=out_sh)(tree, dtype)
    shapes = jax.eval_shape(lambda t: quantized.quantize_params(t, dtype), tree)
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes, out_sh)


def _placed(tree, shardings, dtype):
    """`tree` in `dtype` on its shardings: arrays put there, abstract leaves (jax.ShapeDtypeStruct) given them,
    to compile without allocating (for devices this host may not have: benchmarks/gpu_compile.py)."""
    def one(a, sh):
        if _concrete(a):
            return jax.device_put(np.asarray(a).astype(dtype), sh)
        return jax.ShapeDtypeStruct(a.shape, dtype, sharding=sh)
    return jax.tree.map(one, tree, shardings)


def greedy_without_cache(model, params, prompt: list[int], max_new_tokens: int, vocab: int) -> list[int]:
    """Reference continuation: the training forward pass over the whole sequence for every token.

    The sequence is right-padded to its final length (causal attention never looks right), so the
    forward pass compiles once.
    """
    total = len(prompt) + max_new_tokens
    logits_fn = jax.jit(model.logits)
    seq = np.zeros((1, total), np.int32)
    seq[0, :len(prompt)] = prompt
    for n in range(len(prompt), total):
        seq[0, n] = int(np.argmax(np.asarray(logits_fn(params, seq))[0, n - 1, :vocab]))
    return [int(t) for t in seq[0, len(prompt):]]


def load_gpt_checkpoint(load: str, step: int = -1):
    """(ModelConfig, numpy fp32 params, tokenizer) of a GPT checkpoint; ConfigError for any other."""
    from jax3d.checkpoint.export import load_params
    from jax3d.config import config_from_dict

    params, meta = load_params(load, step)
    cfg = config_from_dict(meta["config"]).model
    if cfg.model_type != "gpt":
        raise ConfigError(f"--load {load} holds a {cfg.model_type} checkpoint; generation needs a GPT one")
    from jax3d.checkpoint.tokenizer import checkpoint_tokenizer
    return cfg, params, checkpoint_tokenizer(meta)


def generator_for(cfg: ModelConfig, params, tokenizer, prompts: list[list[int]], max_new_tokens: int, *,
                  tp: int = 1, dtype=jnp.float32, checkpoint: str = "", batch: int = 0,
                  cache_dtype=None, weight_dtype=None) -> Generator:
    """A Generator sized for these token prompts, `batch` of them at a time (0: all), tensor parallel over the
    first `tp` devices. `checkpoint` is the --load directory `cfg` came from, for errors to name."""
    if tp < 1 or tp > jax.device_count():
        raise ConfigError(f"--tensor-model-parallel-size {tp} must be between 1 and the {jax.device_count()} devices")
    plan = generation_plan(cfg, tp, checkpoint=checkpoint)
    if any(not p for p in prompts):
        raise ConfigError("a prompt tokenizes to nothing; give every prompt some text")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise ConfigError(f"the longest prompt is {longest} tokens; with --max-new-tokens {max_new_tokens} that "
                          f"exceeds the model's {cfg.max_position_embeddings} positions, so shorten it or ask for fewer")
    size = getattr(tokenizer, "vocab_size", 0)
    if size and not cfg.unpadded_vocab_size and size < cfg.vocab_size:  # a train.py run: the rest is padding
        cfg = dataclasses.replace(cfg, unpadded_vocab_size=size)
    return Generator(cfg, params, plan.mesh.build(jax.devices()[:tp]), rules=plan.rules, kernels=plan.kernels,
                     batch=min(batch or len(prompts), len(prompts)),
                     dtype=dtype, cache_dtype=cache_dtype, weight_dtype=weight_dtype,
                     max_len=min(cfg.max_position_embeddings, longest + max_new_tokens + PROMPT_BUCKET),
                     eod=getattr(tokenizer, "eod", None))
