"""What the benchmarks share: the shapes (model presets at a sequence length and batch), jax3d's real train step
built for one of them (its Pallas kernels left out or set otherwise where a run says so), and the peer.

The step is `jax3d.train.step.build_steps` (what `launch/train.py` runs), on random tokens, so data
loading stays out of the figure. FLOPs are counted as the PyTorch peer counts them
(`jax3d.train.metrics.model_flops_per_token` is the same formula).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PEER = os.path.join(ROOT, ".peer", "torch_gpt_peer.py")



@dataclasses.dataclass(frozen=True)
class Shape:
    """A benchmark shape: a model preset (jax3d.models.presets) at a sequence length and batch size."""

    preset: str
    seq: int
    batch: int
    layers: int = 0  # 0: the preset's


# The shapes the peer comparison is made at. The GPT peer (torch_gpt_peer.py) takes the preset's layers, width and
# heads at VOCAB; a Llama's peer is torch_llama_peer.py (beside it), at the preset's published shape (`--shape`).
SHAPES = {
    "1.3b-b16": Shape("gpt-1.3b", 2048, 16),
    "1.3b-b8": Shape("gpt-1.3b", 2048, 8),
    "350m-b32": Shape("gpt-350m", 1024, 32),
    "125m-b32": Shape("gpt-125m", 1024, 32),
    "2.7b-b8": Shape("gpt-2.7b", 2048, 8),  # for the largest model that trains on one device
    "6.7b-b2": Shape("gpt-6.7b", 2048, 2),
    # half of gpt-6.7b's layers: its GEMM shapes within an H100's memory (FP8 against bf16 where no H200 is had)
    "6.7b-l16-b16": Shape("gpt-6.7b", 2048, 16, layers=16),
    "tiny": Shape("gpt-tiny", 128, 4),  # for trying the scripts on a CPU
    # BERT (Megatron's pre-LN BERT with its MLM and sentence-order heads); the peer is GPT only.
    "bert-large-b32": Shape("bert-large", 512, 32),
    "bert-tiny": Shape("bert-tiny", 128, 4),
    "llama3.2-1b-b8": Shape("llama3.2-1b", 2048, 8),
    "llama3.2-3b-b4": Shape("llama3.2-3b", 2048, 4),
    "llama3-8b-b1": Shape("llama3-8b", 2048, 1),
    "llama-tiny": Shape("llama-tiny", 128, 4),
}
VOCAB = 50304  # the GPT peer's vocabulary
# Batch keys whose values are 0 or 1 (masks, segment types, the sentence-order flag); the rest are token ids.
_BINARY_KEYS = ("types", "loss_mask", "padding_mask", "is_random")


def emitter(out: str = ""):
    """A function that prints a record as one JSON line, and appends it to `out` when given."""
    def emit(rec: dict) -> None:
        line = json.dumps(rec)
        print(line, flush=True)
        if out:
            with open(out, "a") as f:
                f.write(line + "\n")
    return emit


def error_line(e: BaseException) -> str:
    """An exception as one line of a benchmark's record: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def is_bert(shape: str) -> bool:
    """Whether a SHAPES entry is a BERT (the rest are GPTs, the peer's model, and Llamas)."""
    return SHAPES[shape].preset.startswith("bert")


def is_llama(shape: str) -> bool:
    """Whether a SHAPES entry is a Llama (its peer is torch_llama_peer.py)."""
    return SHAPES[shape].preset.startswith("llama")


def model_config(shape: str, dropout: float = 0.0, recompute: str = "none"):
    """The ModelConfig of a SHAPES entry: its preset at the shape's sequence length (and layers)."""
    from jax3d.models import get_preset

    s = SHAPES[shape]
    fields = dict(seq_length=s.seq, hidden_dropout=dropout, attention_dropout=dropout, recompute=recompute)
    if not is_llama(shape):  # a Llama keeps its preset's positions; a GPT or BERT has as many as its sequence
        fields["max_position_embeddings"] = s.seq
    if s.layers:
        fields["num_layers"] = s.layers
    return dataclasses.replace(get_preset(s.preset)[0], **fields)


def dims(shape: str) -> tuple[int, int, int, int, int]:
    """(layers, hidden, heads, seq, batch) of a SHAPES entry."""
    m = model_config(shape)
    return m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, SHAPES[shape].batch


@dataclasses.dataclass(frozen=True)
class Run:
    """One measured configuration of the step."""

    shape: str
    batch: int = 0  # 0: the shape's
    ablate: tuple[str, ...] = ()  # Pallas kernels left out (jax3d.kernels.KERNELS): XLA's code runs
    recompute: str = "none"
    dtype: str = "bfloat16"
    xla_flags: str = ""
    # Kernel settings for this run, as (module, "field=value,...") pairs: ("fused_gelu", "cols_fwd=2048").
    tunings: tuple[tuple[str, str], ...] = ()
    dropout: float = 0.0  # hidden and attention dropout (the peer has none)
    fp8: str = ""  # FP8 GEMMs in the blocks: "" (off), hybrid or e4m3 (jax3d.models.fp8), delayed scaling's defaults

    def __post_init__(self):  # tuples again after a trip through JSON
        object.__setattr__(self, "ablate", tuple(self.ablate))
        object.__setattr__(self, "tunings", tuple(tuple(t) for t in self.tunings))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Run":
        return cls(**json.loads(text))

    def dims(self):
        layers, d, heads, seq, batch = dims(self.shape)
        return layers, d, heads, seq, self.batch or batch

    def label(self) -> str:
        parts = [self.shape if not self.batch else f"{self.shape.split('-')[0]}-b{self.batch}"]
        parts += ["-every kernel"] if set(self.ablate) == set(KERNEL_CALLS) else [f"-{a}" for a in self.ablate]
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        if self.dropout:
            parts.append(f"dropout={self.dropout:g}")
        if self.fp8:
            parts.append(f"fp8={self.fp8}")
        if self.xla_flags:
            parts.append(f"xla[{self.xla_flags}]")
        parts += [f"{module}[{fields}]" for module, fields in self.tunings]
        return " ".join(parts)


# Each Pallas kernel (jax3d.kernels.KERNELS), and the pallas_call name a compiled step that runs it holds.
KERNEL_CALLS = {"fused_gelu": "fused_gelu_fwd", "fused_norm": "fused_layer_norm_fwd", "fused_qkv": "fused_qkv_bwd",
                "fused_xent": "fused_xent", "fp8_cast": "fp8_cast_transpose"}


# The custom call of a cuBLASLt FP8 GEMM in a compiled GPU step (XLA's GEMM rewriter): how many of the step's GEMMs
# the rewriter turned into FP8 ones (0 on a CPU, where XLA runs the f8 dots emulated).
FP8_GEMM_CALL = '"__cublas$lt$matmul$f8"'


def kernel_tuning(kernel: str, settings: str, kernels=None, what: str = "kernel"):
    """The kernel's Tuning with "field=value,..." changed from its defaults (as `--tune` gives them; at
    least one), for one of `kernels` (the train step's, KERNEL_CALLS, by default). ValueError names what is
    wrong."""
    from jax3d.kernels import module
    from jax3d.kernels.pallas_gpu import parse_tuning

    kernels = KERNEL_CALLS if kernels is None else kernels
    if kernel not in kernels:
        raise ValueError(f"no {what} {kernel!r}; choose from {', '.join(kernels)}")
    cls = module(kernel).Tuning
    if not settings:
        raise ValueError(f"{kernel}: no FIELD=INTEGER given; the fields are those of {cls()}")
    return parse_tuning(cls, settings)


def add_tune_flag(p):
    """`--tune KERNEL:FIELD=V[,FIELD=V]`, a decode kernel's settings (decode_tunings reads them)."""
    p.add_argument("--tune", action="append", default=[], metavar="KERNEL:FIELD=V[,FIELD=V]",
                   help="a decode kernel's settings, fields of its module's Tuning (e.g. decode_attention:block=128 "
                        "or row_gemv:rows=16,programs=256), the others at their defaults; repeatable for different "
                        "kernels (a later flag for the same kernel replaces the earlier)")


def add_decode_kernel_flags(p):
    """`--off KERNEL` and `--tune KERNEL:FIELD=V[,FIELD=V]` for a decode benchmark (decode_kernel_flags reads them)."""
    p.add_argument("--off", action="append", default=[], metavar="KERNEL",
                   help="a decode kernel left out (jax3d.kernels.DECODE_KERNELS: decode_attention, "
                        "row_gemv), its plain JAX function run instead (row_gemv off: XLA's blocks at batch 1); "
                        "repeatable")
    add_tune_flag(p)


def decode_kernel_flags(parser, a) -> tuple[list, tuple]:
    """(the Tunings, the kernels left out) that add_decode_kernel_flags' flags give; parser.error names a bad one."""
    from jax3d.kernels import DECODE_KERNELS

    unknown = [k for k in a.off if k not in DECODE_KERNELS]
    if unknown:
        parser.error(f"--off {unknown[0]}: choose decode kernels from {', '.join(DECODE_KERNELS)}")
    return decode_tunings(parser, a.tune), tuple(a.off)


def decode_tunings(parser, tunes: list[str]) -> list:
    """The decode kernels' Tunings that `--tune KERNEL:FIELD=V[,FIELD=V]` flags give; parser.error names a bad
    one."""
    from jax3d.kernels import DECODE_KERNELS

    tuned = []
    for t in tunes:
        module, _, fields = t.partition(":")
        try:
            tuned.append(kernel_tuning(module, fields, DECODE_KERNELS, "decode kernel"))
        except ValueError as e:
            parser.error(f"--tune {t}: {e}")
    return tuned


def kernel_policy(run: Run, platform: str, num_devices: int):
    """The KernelPolicy `run`'s step is built with on `num_devices` devices of `platform`: its kernels left out
    and its settings, every other kernel at its defaults (jax3d.kernels.policy)."""
    from jax3d.kernels.policy import KernelPolicy

    return KernelPolicy.resolve(platform, num_devices, tunings=[kernel_tuning(k, fields) for k, fields in run.tunings],
                                off=run.ablate)


def config_for(run: Run):
    from jax3d.config import Config, ParallelConfig, PrecisionConfig, TrainConfig

    batch = run.batch or SHAPES[run.shape].batch
    return Config(model=model_config(run.shape, run.dropout, run.recompute), parallel=ParallelConfig(),
                  precision=PrecisionConfig(dtype=run.dtype, fp8=run.fp8),
                  train=TrainConfig(micro_batch_size=batch, global_batch_size=batch, train_iters=1000))


def build(run: Run):
    """(steps, state, batch, compiled train step, compile seconds) on one device."""
    return build_config(config_for(run), 1, run)


def _steps_for(cfg, num_devices: int, run: Run | None = None):
    """The steps of `cfg` on the first `num_devices` devices, with `run`'s kernel policy (None: the defaults)."""
    import jax

    from jax3d.parallel.plan import resolve
    from jax3d.train.step import build_steps

    platform = jax.devices()[0].platform
    kernels = None if run is None else kernel_policy(run, platform, num_devices)
    return build_steps(resolve(cfg, num_devices, kernels=kernels))


def host_shortfall(need: int, at_least: bool = False) -> str | None:
    """On a CPU, why `need` bytes (`at_least`: a lower bound) cannot be had here ("needs 424.2 GiB on this
    CPU, and the host has 22.2 GiB free"); None on a GPU, or when they fit. A GPU-sized shape on a CPU is
    otherwise killed by the kernel's OOM killer (exit 137) with nothing printed."""
    import jax

    from jax3d.train.memory import host_available_bytes

    have = host_available_bytes()
    if jax.devices()[0].platform != "cpu" or have is None or need <= have:
        return None
    return f"needs {'at least ' if at_least else ''}{_size(need)} on this CPU, and the host has {_size(have)} free"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def step_host_shortfall(run: Run) -> str | None:
    """`host_shortfall` of `run`'s train step, compiled from abstract shapes so that nothing is allocated
    (on a GPU nothing is compiled)."""
    import jax

    from jax3d.train.memory import step_peak_bytes
    from jax3d.train.step import abstract_batch, abstract_state

    if jax.devices()[0].platform != "cpu":
        return None
    steps = _steps_for(config_for(run), 1, run)
    shapes = abstract_batch(steps, steps.model.sample_shapes())
    compiled = steps.train_step.lower(abstract_state(steps), shapes).compile()
    return host_shortfall(step_peak_bytes(compiled))


def build_config(cfg, num_devices: int, run: Run | None = None):
    """(steps, state, batch, compiled train step, compile seconds) for `cfg` on the first devices, with `run`'s
    kernel policy (None: the defaults)."""
    import jax
    import numpy as np

    from jax3d.train.step import abstract_batch

    steps = _steps_for(cfg, num_devices, run)
    cfg = steps.cfg
    state = steps.init_state(cfg.train.seed)
    shapes = abstract_batch(steps, steps.model.sample_shapes())
    rng = np.random.default_rng(0)
    batch = {k: jax.device_put(rng.integers(0, 2 if k in _BINARY_KEYS else cfg.model.vocab_size, a.shape)
                               .astype(a.dtype), a.sharding)
             for k, a in shapes.items()}
    t0 = time.perf_counter()
    compiled = steps.train_step.lower(state, batch).compile()
    return steps, state, batch, compiled, time.perf_counter() - t0


def kernels_used(hlo_text: str) -> list[str]:
    """The jax3d Pallas kernels (KERNEL_CALLS' modules) that a compiled step runs."""
    return [module for module, call in KERNEL_CALLS.items() if call in hlo_text]


def hlo_transposes(hlo_text: str) -> int:
    """Non-root instructions whose name holds "transpose" in the compiled HLO: a transpose fusion's call
    site, and the transposes inside fused computations (a computation's ROOT is not counted). A proxy,
    not a kernel count; a layout regression shows in it before a profile: at 350M b32 a batch-minor
    residual stream meant 320 per step, and 4 once the stream was laid out token-major."""
    return len(re.findall(r"^\s*%[\w.]*transpose[\w.]* = ", hlo_text, re.M))


class GpuLog:
    """The GPU's SM clock and board power, sampled by `nvidia-smi` every 100 ms in the background, each
    sample stamped with this process's clock on arrival; a context manager, whose exit stops it. An H200
    ran the 1.3B steps at its 700 W power cap with the SM clock at a median of 1560 MHz, not its 1980 MHz
    peak, so the clock a run got belongs beside its tokens/s. On a machine without `nvidia-smi` there
    are no samples and `summary` is empty."""

    def __init__(self, gpu: int = 0):
        self.samples: list[tuple[float, float, float]] = []  # (perf_counter, MHz, W)
        try:
            self._proc = subprocess.Popen(["nvidia-smi", "-i", str(gpu), "--query-gpu=clocks.sm,power.draw",
                                           "--format=csv,noheader,nounits", "-lms", "100"],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None
            return
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self._proc.stdout:
            try:
                mhz, watts = (float(v) for v in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.perf_counter(), mhz, watts))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._reader.join(timeout=2)

    def summary(self, start: float, end: float) -> dict:
        return clock_summary(self.samples, start, end)


def clock_summary(samples, start: float, end: float) -> dict:
    """Median SM clock and power of the (time, MHz, W) samples from `start` to `end`; {} if none."""
    inside = [(mhz, watts) for t, mhz, watts in samples if start <= t <= end]
    if not inside:
        return {}
    return {"sm_clock_mhz": round(statistics.median(m for m, _ in inside)),
            "power_w": round(statistics.median(w for _, w in inside))}


def measure(run: Run, steps_timed: int = 10, warmup: int = 3) -> dict:
    """Times `steps_timed` train steps after `warmup`; one JSON-able record."""
    import jax

    from jax3d.train.metrics import memory_gb, model_flops_per_token, peak_tflops

    short = step_host_shortfall(run)
    if short:  # a GPU-sized shape on a CPU would be killed by the OOM killer, with nothing printed
        return {"who": "jax3d", "run": run.label(), "error": f"its train step {short}; this shape is for a GPU "
                "(on a CPU, try --shape tiny)"}
    steps, state, batch, compiled, compile_s = build(run)
    hlo = compiled.as_text()
    kernels = kernels_used(hlo)
    unused = [module for module, _ in run.tunings if module not in kernels]
    if unused:  # the step fell back to XLA there: timing it would mislabel XLA's time as the kernel's
        return {"who": "jax3d", "run": run.label(), "error": f"{', '.join(unused)} does not run in this step "
                "(not on one GPU, or the settings do not fit the shape), so its settings were not measured"}
    transposes = hlo_transposes(hlo)
    gemms = gemm_kinds(hlo) if run.fp8 else {}
    with GpuLog() as gpu:
        state, metrics, t0, t1 = time_steps(steps, compiled, state, batch, steps_timed, warmup)
    dt = (t1 - t0) / steps_timed
    cfg = steps.cfg
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    tflops = tokens / dt * model_flops_per_token(cfg.model) / 1e12
    peak = peak_tflops()
    m = cfg.model
    layers, d, heads, seq, batch_size = m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, cfg.train.global_batch_size
    return {"who": "jax3d", "run": run.label(), "layers": layers, "d": d, "heads": heads, "seq": seq,
            "batch": batch_size, "ablate": list(run.ablate), "recompute": run.recompute, "dropout": run.dropout,
            "xla_flags": run.xla_flags, "fp8": run.fp8, "fp8_gemms": hlo.count(FP8_GEMM_CALL),
            "step_s": round(dt, 5), "tokens_per_s": round(tokens / dt),
            "tflops_per_device": round(tflops, 1), "mfu": round(tflops / peak, 4) if peak else None,
            "compile_s": round(compile_s, 1), "hlo_transposes": transposes, "kernels": kernels,
            "tunings": [list(t) for t in run.tunings], "mem_gb": round(memory_gb(), 2),
            "loss": float(metrics["loss"]), "device": jax.devices()[0].device_kind, **gpu.summary(t0, t1),
            **({"gemm_kinds": gemms} if gemms else {})}


def gemm_kinds(hlo: str) -> dict[str, int]:
    """How the compiled step's GEMMs run, counted by kind (benchmarks.hlo_gemms.gemm_lowering's labels: a cuBLASLt
    FP8 call, a Triton GEMM whose dot takes f8 operands, a bf16 GEMM, ...), so an FP8 run shows what each of its
    GEMMs became, not only the cuBLASLt FP8 calls that `fp8_gemms` counts."""
    from benchmarks.hlo_gemms import gemm_lowering

    return dict(gemm_lowering(hlo).most_common())


def median_seconds(fn, args, repeats: int, warmup: int = 1) -> float:
    """The median wall time of `fn(*args)` over `repeats` calls, after `warmup` calls (the first compiles)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def child_env() -> dict:
    """This process's environment, for a child that imports this checkout's `benchmarks` and `jax3d`."""
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def time_steps(steps, compiled, state, batch, steps_timed: int, warmup: int):
    """(state, metrics, start, end): `steps_timed` calls of the compiled train step on `steps.mesh` after
    `warmup` untimed ones, the clock read around the timed calls once their results are ready."""
    import jax

    with jax.set_mesh(steps.mesh):
        for _ in range(warmup):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for _ in range(steps_timed):
            state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
    return state, metrics, t0, time.perf_counter()


def run_isolated(run: Run, steps_timed: int) -> dict:
    """`measure` in a fresh process: its own peak-memory counter and XLA flags."""
    from jax3d.cli.train import claim_device_memory

    env = child_env()
    claim_device_memory(env)  # as launch/train.py does
    if run.xla_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + run.xla_flags).strip()
    code = ("import json, sys; from benchmarks.harness import Run, measure; "
            "print('RESULT', json.dumps(measure(Run.from_json(sys.argv[1]), %d)))" % steps_timed)
    return _child([sys.executable, "-c", code, run.to_json()], env, run.label())


def run_peer(shape: str, batch: int, steps_timed: int, script: str = DEFAULT_PEER) -> dict:
    """The PyTorch peer at the same shape, in its own process (a Llama's: torch_llama_peer.py beside `script`)."""
    layers, d, heads, seq, b = dims(shape)
    cmd = [sys.executable, script, "--layers", str(layers), "--d", str(d), "--heads", str(heads),
           "--seq", str(seq), "--batch", str(batch or b), "--steps", str(steps_timed), "--vocab", str(VOCAB)]
    if is_llama(shape):
        cmd = [sys.executable, os.path.join(os.path.dirname(script), "torch_llama_peer.py"), "--shape",
               SHAPES[shape].preset, "--seq", str(seq), "--batch", str(batch or b), "--steps", str(steps_timed)]
    with GpuLog() as gpu:
        rec, printed_at = _child_at(cmd, dict(os.environ), f"peer {shape}", marker="")
    if "step_s" in rec:  # its timed steps: the last steps_timed * step_s seconds before it printed
        rec.update(gpu.summary(printed_at - steps_timed * rec["step_s"], printed_at))
    return rec


def _child(cmd, env, label, marker="RESULT ") -> dict:
    return _child_at(cmd, env, label, marker)[0]


def _child_at(cmd, env, label, marker="RESULT ") -> tuple[dict, float | None]:
    """(the last JSON line after `marker` that `cmd` prints, this process's clock when it arrived); or
    (an error record with the tail of its output, None)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = []
    drain = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    drain.start()
    out, found = [], None
    for line in proc.stdout:
        out.append(line)
        if line.startswith(marker) and line[len(marker):].lstrip().startswith("{"):
            found = (line, time.perf_counter())
    proc.wait()
    drain.join()
    if found is not None:
        return json.loads(found[0][len(marker):]), found[1]
    tail = ("".join(err) or "".join(out)).strip().splitlines()[-3:]
    return {"run": label, "error": f"exit {proc.returncode}: " + " | ".join(tail)}, None
