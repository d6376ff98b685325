"""Text generation for jax3d GPT models (Llama included): a KV cache, a prefill and a decode function compiled
once each.

Prompts of a batch are padded on the left to one length, so every row's next token sits in the same
cache slot. A row's positions count its own tokens only (pads don't advance them), and its queries
never see its pads; that gives each row the numbers it would get alone (learned or rotary positions alike).
The cache is one {'k', 'v': (batch, max_len, kv_heads, head_dim)} per layer, grouped-query attention's KV
heads only, sharded over them like the attention it feeds, and is donated to each step, so decoding updates
it in place.

    gen = Generator(cfg, params, mesh, batch=4, max_len=96)
    tokens = gen.generate(prompts, max_new_tokens=32, sampling=Sampling(greedy=True))
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax3d.config import ConfigError, ModelConfig
from jax3d.parallel.mesh import with_auto_axes
from jax3d.models import build_model
from jax3d.parallel import ShardingRules, named_shardings, tree_specs

_CACHE_AXES = ("batch", "seq", "heads", "kv")
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
    """Next token (batch,) from fp32 logits (batch, vocab), padding columns already at -inf."""
    if sampling.greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits_bv = logits_bv / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(logits_bv, sampling.top_k)[0][:, -1:]
        logits_bv = jnp.where(logits_bv < kth, -jnp.inf, logits_bv)
    if sampling.top_p < 1.0:
        order = jnp.argsort(-logits_bv, axis=-1)
        sorted_l = jnp.take_along_axis(logits_bv, order, axis=-1)
        probs = jax.nn.softmax(sorted_l, axis=-1)
        # Keep a token when the mass before it is still under top_p (so the most likely always stays).
        keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < sampling.top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(order.shape[0])[:, None], order].set(keep_sorted)
        logits_bv = jnp.where(keep, logits_bv, -jnp.inf)
    return jax.random.categorical(key, logits_bv, axis=-1).astype(jnp.int32)


class Generator:
    """Prefill and decode of one GPT on `mesh` (tensor parallel over `model`, rows over `data`) for a
    fixed batch size and cache length; both are jitted once and reused for every call.

    `params` are in logical layer order. A train state under an interleaved or uneven pipeline keeps its
    layers in pipeline order: pass `steps.logical_params(state.params)`, not `state.params`. `mesh` has
    jax3d's axis names, as `MeshConfig.build` or `jax.make_mesh` make them (Explicit axes are taken as
    Auto)."""

    def __init__(self, cfg: ModelConfig, params, mesh, *, batch: int, max_len: int, dtype=jnp.float32,
                 eod: int | None = None):
        if cfg.model_type != "gpt":
            raise ConfigError(f"generation needs a GPT checkpoint, but this one is a {cfg.model_type}; "
                              "pass a checkpoint trained with --model gpt")
        if max_len > cfg.max_position_embeddings:
            raise ConfigError(f"prompt plus --max-new-tokens is {max_len} tokens, longer than the model's "
                              f"{cfg.max_position_embeddings} positions; shorten the prompt or ask for fewer tokens")
        mesh = with_auto_axes(mesh, ("data", "model"), "generation")
        rows = dict(mesh.shape).get("data", 1)
        if batch % rows:
            raise ConfigError(f"a batch of {batch} does not split over the mesh's {rows} data devices; pass a "
                              f"batch that is a multiple of {rows}, or a mesh with data = 1")
        stacked = jax.tree.leaves(params["blocks"])[0].shape[0]
        if stacked != cfg.num_layers:
            raise ConfigError(f"params['blocks'] stacks {stacked} layers but the model has {cfg.num_layers}: a "
                              "pipelined train state keeps its layers in pipeline order; pass "
                              "steps.logical_params(state.params)")
        self.cfg, self.mesh, self.batch, self.max_len, self.dtype, self.eod = cfg, mesh, batch, max_len, dtype, eod
        self.rules = ShardingRules.create(False)
        self.model = build_model(dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0), self.rules)
        self.vocab = cfg.unpadded_vocab_size or cfg.vocab_size
        specs = tree_specs(self.rules, self.model.logical_axes())
        # Blocks are kept as one tree per layer: decode reads each weight once per token, and slicing a
        # stack inside the step could cost a copy of it.
        layer_specs = jax.tree.map(lambda s: P(*tuple(s)[1:]), specs.pop("blocks"), is_leaf=lambda x: isinstance(x, P))
        layer_sh = named_shardings(mesh, layer_specs)
        ends = {k: v for k, v in params.items() if k != "blocks"}
        self.params = jax.device_put(jax.tree.map(lambda a: np.asarray(a).astype(dtype), ends),
                                     named_shardings(mesh, specs))
        self.params["blocks"] = [jax.device_put(jax.tree.map(lambda a, i=i: np.asarray(a[i]).astype(dtype),
                                                             params["blocks"]), layer_sh)
                                 for i in range(cfg.num_layers)]
        kv = NamedSharding(mesh, self.rules.spec(_CACHE_AXES))
        self.cache_sharding = [{"k": kv, "v": kv} for _ in range(cfg.num_layers)]
        self._repl = NamedSharding(mesh, self.rules.spec(()))
        self._jits: dict = {}
        self._traces = {"prefill": 0, "decode": 0}  # a trace is a compile: jit caches by shape

    # ---- the model with a cache ---------------------------------------------------------------
    def _forward(self, params, cache, tokens_bt, positions_bt, mask_b1tT, index):
        """Logits (batch, seq, vocab) fp32 of tokens written at cache slot `index`, and the new cache."""
        m = self.model
        x = m.embed_at(params, tokens_bt, positions_bt)
        new_cache = []
        for p, c in zip(params["blocks"], cache):
            x, c = m.block.apply({"params": p}, x, mask_b1tT, None, True, {**c, "index": index}, positions_bt)
            new_cache.append({"k": c["k"], "v": c["v"]})
        logits = m.final_logits(params, x)
        col = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
        return jnp.where(col < self.vocab, logits, -jnp.inf), new_cache

    @staticmethod
    def _mask(valid_bT, query_slots_t):
        """(batch, 1, t, T): query slot s sees valid keys at slots <= s, and always itself (a pad query
        with nothing else to see would otherwise softmax over nothing)."""
        slots = jnp.arange(valid_bT.shape[1])
        causal_tT = slots[None, :] <= query_slots_t[:, None]
        mask = (valid_bT[:, None, :] & causal_tT[None]) | (slots[None, :] == query_slots_t[:, None])[None]
        return mask[:, None]

    def _prefill(self, sampling: Sampling):
        def prefill(params, tokens_bt, valid_bt, key):
            self._traces["prefill"] += 1
            b, t = tokens_bt.shape
            shape = (b, self.max_len, self.cfg.kv_heads, self.cfg.head_dim)
            cache = [{"k": jnp.zeros(shape, self.dtype), "v": jnp.zeros(shape, self.dtype)}
                     for _ in range(self.cfg.num_layers)]
            cache = jax.lax.with_sharding_constraint(cache, self.cache_sharding)
            valid_bT = jnp.zeros((b, self.max_len), bool).at[:, :t].set(valid_bt.astype(bool))
            positions_bt = jnp.maximum(jnp.cumsum(valid_bt, axis=1) - 1, 0).astype(jnp.int32)
            logits, cache = self._forward(params, cache, tokens_bt, positions_bt,
                                          self._mask(valid_bT, jnp.arange(t)), 0)
            state = {"cache": cache, "valid": valid_bT, "slot": jnp.int32(t),
                     "position": jnp.sum(valid_bt, axis=1).astype(jnp.int32)}
            return pick(logits[:, -1], sampling, key), state
        return prefill

    def _decode(self, sampling: Sampling):
        def decode(params, state, token_b, key):
            self._traces["decode"] += 1
            slot = state["slot"]
            valid = jax.lax.dynamic_update_slice_in_dim(state["valid"], jnp.ones((token_b.shape[0], 1), bool), slot, 1)
            logits, cache = self._forward(params, state["cache"], token_b[:, None], state["position"][:, None],
                                          self._mask(valid, slot[None]), slot)
            new = {"cache": cache, "valid": valid, "slot": slot + 1, "position": state["position"] + 1}
            return pick(logits[:, -1], sampling, key), new
        return decode

    def _compiled(self, sampling: Sampling) -> tuple[Callable, Callable]:
        if sampling not in self._jits:
            state_sh = {"cache": self.cache_sharding, "valid": self._repl, "slot": self._repl, "position": self._repl}
            prefill = jax.jit(self._prefill(sampling), out_shardings=(self._repl, state_sh))
            decode = jax.jit(self._decode(sampling), out_shardings=(self._repl, state_sh), donate_argnums=1)
            self._jits[sampling] = (prefill, decode)
        return self._jits[sampling]

    def compile_counts(self) -> dict:
        """How many times prefill and decode were traced and compiled (1 each per sampling setting and
        prompt bucket; decode never again per token)."""
        return dict(self._traces)

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

    def stream(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(greedy=True),
               seed: int = 0, stop_at_eod: bool = False) -> Iterator[np.ndarray]:
        """Yields the next token of every row (batch,), `max_new_tokens` times (fewer when every row
        has produced `eod` and `stop_at_eod`)."""
        sampling.validate()
        if sampling.top_k > self.vocab:
            raise ConfigError(f"--top-k {sampling.top_k} exceeds the model's {self.vocab} tokens; pass at most that, "
                              "or 0 for all")
        longest = max((len(p) for p in prompts), default=0)
        if longest + max_new_tokens > self.max_len:
            raise ConfigError(f"the longest prompt ({longest} tokens) plus --max-new-tokens {max_new_tokens} exceeds "
                              f"the {self.max_len} tokens of the cache; shorten the prompt or ask for fewer tokens")
        # Prompt lengths rounded up to a bucket, so prompts of similar length share one prefill compile.
        bucket = min(-(-longest // PROMPT_BUCKET) * PROMPT_BUCKET, self.max_len - max_new_tokens)
        tokens, valid = self.left_pad(prompts, bucket)
        prefill, decode = self._compiled(sampling)
        key = jax.random.key(seed)
        with jax.set_mesh(self.mesh):
            tok, state = prefill(self.params, tokens, valid, jax.random.fold_in(key, 0))
            done = np.zeros(len(prompts), bool)
            for i in range(max_new_tokens):
                # The next step is dispatched before this token is copied to the host, so the device
                # never waits on Python (at worst one step runs past the end-of-document).
                nxt = None
                if i + 1 < max_new_tokens:
                    nxt, state = decode(self.params, state, tok, jax.random.fold_in(key, i + 1))
                host = np.asarray(tok)
                yield host
                done |= host[:len(prompts)] == self.eod
                if stop_at_eod and done.all():
                    return
                tok = nxt

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(greedy=True),
                 seed: int = 0) -> list[list[int]]:
        """The `max_new_tokens` continuation tokens of each prompt."""
        out = np.stack(list(self.stream(prompts, max_new_tokens, sampling, seed)), axis=1)
        return [list(map(int, row)) for row in out[:len(prompts)]]


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
                  tp: int = 1, dtype=jnp.float32, checkpoint: str = "") -> Generator:
    """A Generator sized for these token prompts, tensor parallel over the first `tp` devices. `checkpoint`
    is the --load directory `cfg` came from, for errors to name."""
    from jax3d.config import Config, ParallelConfig, TrainConfig
    from jax3d.parallel.plan import resolve

    if tp < 1 or tp > jax.device_count():
        raise ConfigError(f"--tensor-model-parallel-size {tp} must be between 1 and the {jax.device_count()} devices")
    mesh_cfg = resolve(Config(model=cfg, parallel=ParallelConfig(tensor_parallel=tp),
                              train=TrainConfig(micro_batch_size=1, global_batch_size=1)), tp,
                       checkpoint=checkpoint, from_checkpoint=[f.name for f in dataclasses.fields(cfg)]).mesh
    if any(not p for p in prompts):
        raise ConfigError("a prompt tokenizes to nothing; give every prompt some text")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise ConfigError(f"the longest prompt is {longest} tokens; with --max-new-tokens {max_new_tokens} that "
                          f"exceeds the model's {cfg.max_position_embeddings} positions, so shorten it or ask for fewer")
    size = getattr(tokenizer, "vocab_size", 0)
    if size and not cfg.unpadded_vocab_size and size < cfg.vocab_size:  # a train.py run: the rest is padding
        cfg = dataclasses.replace(cfg, unpadded_vocab_size=size)
    return Generator(cfg, params, mesh_cfg.build(jax.devices()[:tp]), batch=len(prompts), dtype=dtype,
                     max_len=min(cfg.max_position_embeddings, longest + max_new_tokens + PROMPT_BUCKET),
                     eod=getattr(tokenizer, "eod", None))


def generate_text(load: str, prompts: list[str], max_new_tokens: int, sampling: Sampling = Sampling(greedy=True), *,
                  tp: int = 1, dtype=jnp.float32, seed: int = 0, step: int = -1) -> list[str]:
    """The continuation of each text prompt by checkpoint `load` (up to the end-of-document token)."""
    cfg, params, tok = load_gpt_checkpoint(load, step)
    ids = [tok.tokenize(p) for p in prompts]
    gen = generator_for(cfg, params, tok, ids, max_new_tokens, tp=tp, dtype=dtype, checkpoint=load)
    out = []
    for row in gen.generate(ids, max_new_tokens, sampling, seed):
        cut = row.index(gen.eod) if gen.eod in row else len(row)
        out.append(tok.detokenize(row[:cut]))
    return out
