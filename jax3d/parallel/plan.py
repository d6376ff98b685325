"""From a parsed configuration to a runnable one, in one step.

A `Config` may leave some fields to be decided here ("auto"): `tensor_parallel` and `pipeline_parallel`
None picks the most parallel layout that the devices and the batch allow, `zero_stage` None is ZeRO-1
when there is data parallelism, and `vocab_size` 0 is the tokenizer's vocabulary padded to a multiple of
`make_vocab_size_divisible_by`, and `scan_layers` None scans the layer stack from `SCAN_LAYERS_FROM` layers
up on CPU devices. `resolve` fills them in and checks every rule once, reporting all that fail in one message. Training,
`--dry-run`, evaluation and export all start from it.

The `Plan` it returns is the whole run's layout, resolved once and handed on: the settled config (its counts in
samples and tokens, jax3d.counts, included), the mesh, the sharding rules, the batch's spec, `plan.zero` (what
ZeRO shards over `data`), `plan.pipeline` (schedule, stages, virtual stages, micro-batches), the kernel policy and
`plan.precision` (jax3d.parallel.precision.PrecisionPolicy: dtypes, loss scaling, FP8 recipe).
Training, evaluation, generation, HF import and the benchmarks all start from it; code outside jax3d/parallel/
reads its facts and never decides from `zero_stage` or the schedule's name itself, nor builds them again.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection
from dataclasses import dataclass, field

import jax
from jax.sharding import PartitionSpec as P

from jax3d.config import Config, ConfigError, ModelConfig
from jax3d.counts import settle
from jax3d.kernels.policy import KernelPolicy
from jax3d.parallel.mesh import MeshConfig, batch_spec, layout_errors
from jax3d.parallel.pipeline_spec import PipelineSpec, default_schedule
from jax3d.parallel.precision import PrecisionPolicy
from jax3d.parallel.rules import ShardingRules
from jax3d.parallel.zero import ZeroPlan, default_zero_stage

# (tensor, pipeline) sizes an automatic layout tries, most parallel first: (2, 2, 2) on 8 devices.
AUTO_LAYOUTS = ((2, 2), (2, 1), (1, 2), (1, 1))
# Unrolled, a stack this deep compiles for minutes on a laptop's CPU; scanned, in seconds. On GPUs the
# unrolled step runs faster (scan over the layers cost 16-22% on an H200), so they keep it unrolled. The
# dry run and the real run on one platform both take the choice made here, so they compile the same step.
SCAN_LAYERS_FROM = 32


@dataclass(frozen=True)
class Plan:
    """A validated, settled configuration and the mesh it runs on, why that layout was chosen, the kernels it
    runs, and the facts derived from them that the model, the train step, the state's shardings, the data
    loader and the pipeline loop read.

    `resolve` builds it. `Plan(cfg, mesh)` of a pair it returned gives the same facts but the kernels (none, and
    the default backend's attention, unless `kernels=` names them) and the precision's device check;
    `plan.replace(cfg=...)` is
    the plan of a changed config (its facts derived again, nothing settled or checked again).
    """

    cfg: Config
    mesh: MeshConfig
    layout_note: str = "as given"  # e.g. "chosen automatically: the most parallel layout that fits"
    kernels: KernelPolicy = field(default_factory=KernelPolicy.none)  # resolve: from the platform and mesh size
    # dtypes, loss scaling, FP8 recipe, compiler options: resolve's, checked against the devices; else (None)
    # derived from cfg.precision
    precision: PrecisionPolicy | None = None
    zero: ZeroPlan = field(init=False)
    pipeline: PipelineSpec = field(init=False)
    rules: ShardingRules = field(init=False)  # logical axes -> mesh axes; built here only
    batch_spec: P = field(init=False)  # a global batch's (micro-batches, rows, ...) placement

    def __post_init__(self):
        if self.precision is None:
            object.__setattr__(self, "precision", PrecisionPolicy.of(self.cfg.precision))
        object.__setattr__(self, "zero", ZeroPlan.of(self.cfg.parallel.zero_stage, self.mesh.data))
        object.__setattr__(self, "pipeline", PipelineSpec.of(self.cfg, self.mesh.stage, self.mesh.data))
        object.__setattr__(self, "rules", ShardingRules.create(self.cfg.parallel.sequence_parallel))
        object.__setattr__(self, "batch_spec", batch_spec())

    def replace(self, **changes) -> "Plan":
        """This plan with `changes` (cfg, mesh, layout_note, kernels, precision), its facts derived again (the
        precision policy too, from a changed cfg, unless given)."""
        if "cfg" in changes and "precision" not in changes and changes["cfg"].precision != self.cfg.precision:
            changes["precision"] = None
        return dataclasses.replace(self, **changes)


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """The vocabulary padded to a multiple of `divisible_by` (and of tp, when tp does not divide that).

    Megatron pads to divisible_by x tp, which makes the padded size depend on the layout; here it does
    not, so a checkpoint restores onto any tensor-parallel size without a vocabulary change.
    """
    m = divisible_by if divisible_by % tp == 0 else divisible_by * tp
    return ((vocab + m - 1) // m) * m


def _with_vocab(cfg: Config, tokenizer_vocab: int | None, vocab_from_checkpoint: str) -> Config:
    model, tp = cfg.model, cfg.parallel.tensor_parallel
    if model.vocab_size:
        if tokenizer_vocab and model.vocab_size < tokenizer_vocab:
            if vocab_from_checkpoint:
                raise ConfigError(f"the checkpoint in --load {vocab_from_checkpoint} has a vocabulary of "
                                  f"{model.vocab_size}, smaller than the tokenizer's {tokenizer_vocab} tokens; "
                                  "use the tokenizer that checkpoint was trained with")
            raise ConfigError(f"--vocab-size {model.vocab_size} is smaller than the tokenizer's "
                              f"{tokenizer_vocab} tokens; raise it or leave it out")
        return cfg
    if not tokenizer_vocab:
        raise ConfigError("the vocabulary size is unknown: give a tokenizer (--tokenizer-type ...) or --vocab-size")
    vocab = padded_vocab(tokenizer_vocab, model.make_vocab_size_divisible_by, tp)
    return dataclasses.replace(cfg, model=dataclasses.replace(model, vocab_size=vocab))


def _with_layout(cfg: Config, tp: int, pp: int) -> Config:
    """`cfg` at tensor size tp and pipeline size pp, with virtual stages derived from layers per virtual stage."""
    par = cfg.parallel
    virtual = par.virtual_stages
    lpvs = par.layers_per_virtual_stage
    if lpvs and (cfg.model.num_layers // pp) % lpvs == 0:
        virtual = cfg.model.num_layers // pp // lpvs
    return cfg.replace(parallel={"tensor_parallel": tp, "pipeline_parallel": pp, "virtual_stages": virtual})


def _candidates(num_devices: int):
    """(tp, pp) to try when the layout is automatic, in AUTO_LAYOUTS order, those that divide the devices."""
    return [(tp, pp) for tp, pp in AUTO_LAYOUTS if num_devices % (tp * pp) == 0]


def _blame_checkpoint(message: str, model, fields: Collection[str], load_dir: str) -> str:
    """`message` with each model field the checkpoint in `load_dir` supplied, named as a flag and its value,
    said to come from there: the user never typed it."""
    for name in fields:
        named = f"--{name.replace('_', '-')} {getattr(model, name)}"
        message = re.sub(re.escape(named) + r"(?![\w.])", f"{named} (from the checkpoint in --load {load_dir})",
                         message, count=1)
    return message


def resolve(cfg: Config, num_devices: int, tokenizer_vocab: int | None = None, *,
            checkpoint: str = "", from_checkpoint: Collection[str] = (), platform: str = "",
            kernels: KernelPolicy | None = None) -> Plan:
    """The run's Plan on `num_devices` devices: auto fields filled in, the counts settled (jax3d.counts), every
    rule checked, the kernels chosen, the precision policy decided (and checked against JAX's devices).

    `tokenizer_vocab` is the tokenizer's vocabulary size; it is needed when `cfg.model.vocab_size` is 0.
    `from_checkpoint` names the model fields taken from the checkpoint in the --load directory `checkpoint`,
    so that a rule one of them breaks blames the checkpoint rather than a flag the user never gave.
    `platform` is that of the devices the plan is for (default: JAX's first device's); `kernels` replaces the
    policy resolved for them (a benchmark's tunings or ablations).
    Raises ConfigError naming every violated rule.
    """
    try:
        plan = _resolve(cfg, num_devices, tokenizer_vocab, checkpoint if "vocab_size" in from_checkpoint else "")
    except ConfigError as e:
        if not checkpoint:
            raise
        raise ConfigError(_blame_checkpoint(str(e), cfg.model, from_checkpoint, checkpoint)) from None
    if kernels is None:
        kernels = KernelPolicy.resolve(platform or jax.devices()[0].platform, plan.mesh.size)
    return plan.replace(kernels=kernels)


def _resolve(cfg: Config, num_devices: int, tokenizer_vocab: int | None, vocab_from_checkpoint: str) -> Plan:
    precision = PrecisionPolicy.of(cfg.precision, jax.devices())  # ConfigError where the devices can't run it (FP8)
    if cfg.model.scan_layers is None:
        deep = cfg.model.num_layers >= SCAN_LAYERS_FROM
        cfg = cfg.replace(model={"scan_layers": deep and jax.default_backend() == "cpu"})
    if cfg.parallel.pipeline_schedule is None:
        cfg = cfg.replace(parallel={"pipeline_schedule": default_schedule(cfg.parallel.layers_per_virtual_stage)})
    par = cfg.parallel
    auto_layout = par.tensor_parallel is None and par.pipeline_parallel is None
    if auto_layout:
        tried, reasons = [], set()
        for tp, pp in _candidates(num_devices):
            trial = _with_vocab(_with_layout(cfg, tp, pp), tokenizer_vocab, vocab_from_checkpoint)
            mesh = MeshConfig.from_parallel(trial.parallel, num_devices)
            errors = layout_errors(mesh, trial.model, trial.parallel, trial.train)
            if not errors:
                break
            tried.append(f"({mesh.data}, {mesh.stage}, {mesh.model}) failed: {errors[0]}")
            reasons.add(errors[0])
        else:
            if len(reasons) == 1:  # a rule every layout breaks, even (devices, 1, 1), is not about the layout
                raise ConfigError(reasons.pop())
            raise ConfigError("no (data, stage, model) layout fits; " + "; ".join(tried))
        cfg = trial
        note = "chosen automatically, the most parallel that fits"
        if tried:
            note += " (" + "; ".join(tried) + ")"
    else:
        cfg = _with_vocab(_with_layout(cfg, par.tensor_parallel or 1, par.pipeline_parallel or 1), tokenizer_vocab,
                          vocab_from_checkpoint)
        note = "as given"
    mesh = MeshConfig.from_parallel(cfg.parallel, num_devices)
    if cfg.parallel.zero_stage is None:
        cfg = cfg.replace(parallel={"zero_stage": default_zero_stage(mesh.data)})
    mesh.validate(cfg.model, cfg.parallel, cfg.train)
    # The run's counts in samples and tokens, on its final batch, sequence and data-parallel sizes: here, once.
    return Plan(settle(cfg, mesh.data), mesh, note, precision=precision)


def generation_plan(model: ModelConfig, tp: int, *, checkpoint: str = "") -> Plan:
    """The plan of generating with `model` (a checkpoint's, from the --load directory `checkpoint`) tensor parallel
    over `tp` devices: one sequence at a time, as far as the layout rules are concerned."""
    from jax3d.config import ParallelConfig, TrainConfig

    return resolve(Config(model=model, parallel=ParallelConfig(tensor_parallel=tp),
                          train=TrainConfig(micro_batch_size=1, global_batch_size=1)), tp,
                   checkpoint=checkpoint, from_checkpoint=[f.name for f in dataclasses.fields(model)])


def evaluation_mesh(num_devices: int, num_layers: int, tp: int, pp: int, dp: int = 0) -> MeshConfig:
    """The (data, stage, model) layout that evaluates a checkpoint of `num_layers` layers with `tp` x `pp`:
    `dp` data shards, by default as many as the devices hold. Its step runs one micro-batch per stage
    (`pipeline_spec.fewest_microbatches`). Raises ConfigError naming the flag and the sizes that would do."""
    dp = dp or num_devices // (tp * pp)
    if dp < 1 or dp * tp * pp > num_devices:
        raise ConfigError(f"the layout data {dp} x stage {pp} x model {tp} needs more than the {num_devices} devices")
    if num_layers % pp:
        fits = ", ".join(str(s) for s in range(1, num_layers + 1) if num_layers % s == 0)
        raise ConfigError(f"--pipeline-model-parallel-size {pp} does not divide the checkpoint's {num_layers} layers; "
                          f"pass one of {fits}")
    return MeshConfig(dp, pp, tp)
