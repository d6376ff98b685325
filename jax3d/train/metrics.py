"""Throughput accounting and the metrics sinks: JSON lines, TensorBoard events, the terminal."""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import jax

from jax3d.config import ModelConfig
from jax3d.train.events import EventFile

# Dense bf16 peak per device in TFLOP/s, by device kind.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0, "V100": 125.0}


def model_flops_per_token(cfg: ModelConfig) -> float:
    """Model FLOPs per token, forward and backward, without recompute.

    Matmuls 6 x (weights), attention 12 x L x seq x heads x head_dim (d) with the causal mask not halved: the PaLM /
    Megatron convention, which the PyTorch peers (GPT and Llama) also use.
    """
    d, f, v, L, s = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, cfg.num_layers, cfg.seq_length
    q = cfg.num_attention_heads * cfg.head_dim  # width of q and of the attention output (d without --kv-channels)
    kv = cfg.kv_heads * cfg.head_dim  # width of k and of v (q without grouped-query attention)
    matmul = L * (2 * d * q + 2 * d * kv + (3 if cfg.swiglu else 2) * d * f) + v * d
    return 6.0 * matmul + 12.0 * L * s * q


def optimizer_state_norms(params, opt_state) -> dict:
    """Megatron's optimizer-state scalars: the l2 norm, l1 norm and largest magnitude of Adam's first moment
    (momentum), second moment (variance) and its square root, and of the weights."""
    import jax.numpy as jnp
    import optax

    adam = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]
    trees = {"weight": params}
    if adam:
        trees.update(momentum=adam[0].mu, variance=adam[0].nu, variance_sqrt=jax.tree.map(jnp.sqrt, adam[0].nu))
    out = {}
    for name, tree in trees.items():
        leaves = [jnp.asarray(x, jnp.float32) for x in jax.tree.leaves(tree)]
        out[f"optimizer/{name}_l2"] = jnp.sqrt(sum(jnp.sum(x * x) for x in leaves))
        out[f"optimizer/{name}_l1"] = sum(jnp.sum(jnp.abs(x)) for x in leaves)
        out[f"optimizer/{name}_abs_max"] = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in leaves]))
    return out


def peak_tflops(override: float = 0.0) -> float | None:
    if override:
        return override
    kind = jax.devices()[0].device_kind
    for name, tf in PEAK_TFLOPS.items():
        if name in kind:
            return tf
    return None


def memory_gb() -> float:
    """Peak device memory in use (GPU), or the peak resident set of the process (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def set_aside_earlier_run(log_dir: str) -> str | None:
    """Moves an earlier run's metrics.jsonl and TensorBoard event files out of `log_dir` into
    `<log_dir>/earlier/<time>/` (TensorBoard still lists them, as a run of their own); returns that
    folder, or None when there was nothing to move."""
    old = [f for f in os.listdir(log_dir) if f == "metrics.jsonl" or f.startswith("events.out.tfevents.")]
    if not old:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = os.path.join(log_dir, "earlier", stamp), 1
    while os.path.exists(dest):
        n += 1
        dest = os.path.join(log_dir, "earlier", f"{stamp}-{n}")
    os.makedirs(dest)
    for f in old:
        os.replace(os.path.join(log_dir, f), os.path.join(dest, f))
    return dest


# Megatron's TensorBoard scalars besides the losses: what it always writes, and what each of its
# --log-*-to-tensorboard flags adds (jax3d.cli.megatron); a key ending in "/" names a prefix.
TENSORBOARD_ALWAYS = ("lr", "loss_scale", "grad_norm", "skipped", "consumed_samples",
                      "params_norm", "num_zeros_in_grad")  # the last two with --log-params-norm / -num-zeros-in-grad
TENSORBOARD_GROUPS = {"timers": ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu"),
                      "batch_size": ("batch_size",), "validation_ppl": ("val_ppl",), "memory": ("mem_gb",),
                      "optimizer_states": ("optimizer/",)}


# What Megatron's --no-log-*-to-tensorboard flags leave out.
TENSORBOARD_OFF = {"no_learning_rate": "lr", "no_loss_scale": "loss_scale"}


def tensorboard_scalars(record: dict, groups) -> dict:
    """The numbers of `record` that Megatron writes to TensorBoard with the flags of `groups` on: the losses
    and accuracies, TENSORBOARD_ALWAYS (less what TENSORBOARD_OFF's groups leave out) and each group's keys."""
    off = {TENSORBOARD_OFF[g] for g in groups if g in TENSORBOARD_OFF}
    keys = tuple(k for k in TENSORBOARD_ALWAYS if k not in off) + \
        tuple(k for g in groups if g in TENSORBOARD_GROUPS for k in TENSORBOARD_GROUPS[g])
    return {k: v for k, v in record.items() if k.endswith(("loss", "_acc")) or k in keys or
            any(p.endswith("/") and k.startswith(p) for p in keys)}


class MetricsWriter:
    """Writes each logged step to `<log_dir>/metrics.jsonl` and TensorBoard (process 0 only): every number
    into `log_dir`, or with `tensorboard_dir` Megatron's choice (`tensorboard_scalars`) into that folder. A run
    that starts from step 0 (`fresh`) first sets an earlier run's files there aside; a resumed run appends."""

    def __init__(self, log_dir: str, enabled: bool = True, fresh: bool = False, tensorboard_dir: str = "",
                 tensorboard_log=()):
        self.enabled = enabled and bool(log_dir)
        self._jsonl = self._tb = None
        self._groups = tuple(tensorboard_log) if tensorboard_dir else None
        if not self.enabled:
            return
        tb_dir = tensorboard_dir or log_dir
        for d in dict.fromkeys((log_dir, tb_dir)):
            os.makedirs(d, exist_ok=True)
            moved = set_aside_earlier_run(d) if fresh else None
            if moved:
                print(f"jax3d: {d} held an earlier run's metrics; they are now in {moved}", file=sys.stderr)
        self._jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a")
        try:
            self._tb = EventFile(tb_dir)
        except OSError as e:  # TensorBoard is a convenience; never fail a run over it
            print(f"jax3d: TensorBoard events disabled ({e})", file=sys.stderr)

    def write(self, record: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
            if self._groups is not None:
                numbers = tensorboard_scalars(numbers, self._groups)
            self._tb.add_scalars({f"{prefix}/{k}": v for k, v in numbers.items()}, record["step"])
            self._tb.flush()

    def close(self):
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
