"""The (data, stage, model) device mesh: layout validation, building, CPU emulation, multi-host init."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from jax3d.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from jax3d.parallel.pipeline_spec import (CHUNKS_NOT_INTERLEAVED, FEW_MICROBATCHES, TOO_FEW_CHUNKS,
                                          UNEVEN_MICROBATCHES, broken_rules, fewest_microbatches,
                                          takes_virtual_stages)

# The mesh's axis names: the only place they are spelled. Code elsewhere names them through these.
DATA, STAGE, MODEL = "data", "stage", "model"
AXES = (DATA, STAGE, MODEL)


def batch_spec():
    """Where a global batch (micro-batches, rows, ...) lives: its rows split over `data`."""
    from jax.sharding import PartitionSpec as P

    return P(None, DATA)


def emulate_cpu_devices(n: int) -> None:
    """Makes JAX see `n` CPU devices. Must run before JAX initialises its backends."""
    import jax

    if n < 1:
        raise ConfigError(f"--cpu-devices {n} must be at least 1")
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # backends already up
        if jax.device_count() != n or jax.default_backend() != "cpu":
            raise ConfigError(
                f"--cpu-devices {n} must be set before JAX starts; call "
                "jax3d.parallel.mesh.emulate_cpu_devices first thing in the process") from e


def init_distributed(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1) -> None:
    """Joins a multi-process run through JAX's own runtime.

    Explicit flags win; otherwise `jax.distributed.initialize()` detects SLURM / Open MPI, and a
    single process with none of those set is left alone.
    """
    import jax

    launcher = any(k in os.environ for k in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))
    if coordinator_address or num_processes > 1:
        if not (coordinator_address and num_processes > 1 and process_id >= 0):
            raise ConfigError("--coordinator-address, --num-processes (>1) and --process-id must be given "
                              "together for a multi-process run")
        if process_id >= num_processes:
            raise ConfigError(f"--process-id {process_id} must be below --num-processes {num_processes} "
                              "(processes count from 0)")
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
        return
    # One process (--num-processes 1 --process-id 0 is one too); a process id past 0 with nothing else
    # would otherwise run alone without a word, unless SLURM or Open MPI supplies the rest.
    if num_processes < 0 or (process_id > 0 and not launcher):
        raise ConfigError(f"--num-processes {num_processes} --process-id {process_id} is no run jax3d can join; give "
                          "--coordinator-address, --num-processes (>1) and --process-id together, or none of them")
    if launcher:
        ntasks = int(os.environ.get("SLURM_NTASKS", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
        if ntasks > 1:
            jax.distributed.initialize()


@dataclass(frozen=True)
class MeshConfig:
    """Sizes of the three mesh axes. Their product is the device count."""

    data: int = 1
    stage: int = 1
    model: int = 1

    @property
    def size(self) -> int:
        return self.data * self.stage * self.model

    @classmethod
    def from_parallel(cls, parallel: ParallelConfig, num_devices: int) -> "MeshConfig":
        """data = devices / (tp * pp), as Megatron derives it."""
        tp, pp = parallel.tensor_parallel, parallel.pipeline_parallel
        if tp is None or pp is None:
            raise ConfigError("the tensor and pipeline sizes are automatic (None) in this config; pass it "
                              "through jax3d.parallel.plan.resolve, which chooses them and validates the layout")
        if tp < 1 or pp < 1:
            raise ConfigError("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
        if num_devices % (tp * pp):
            raise ConfigError(
                f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = {tp * pp} "
                f"does not divide the {num_devices} devices; choose sizes whose product divides it")
        dp = parallel.data_parallel or num_devices // (tp * pp)
        if dp * tp * pp != num_devices:
            raise ConfigError(
                f"data {dp} x tensor {tp} x pipeline {pp} = {dp * tp * pp} does not equal the "
                f"{num_devices} devices; choose sizes whose product is the device count")
        return cls(data=dp, stage=pp, model=tp)

    def validate(self, model: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> None:
        """Checks every rule of the layout up front; one message lists every violated rule."""
        errors = layout_errors(self, model, parallel, train)
        if errors:
            raise ConfigError("; ".join(errors))

    def build(self, devices=None):
        """The jax Mesh with Auto axes, so sharding annotations drive GSPMD."""
        import jax

        devices = jax.devices() if devices is None else devices
        if len(devices) != self.size:
            raise ConfigError(f"mesh {self.data}x{self.stage}x{self.model} needs {self.size} devices, "
                              f"found {len(devices)}")
        return jax.make_mesh((self.data, self.stage, self.model), AXES, devices=devices,
                             axis_types=(jax.sharding.AxisType.Auto,) * 3)


def with_auto_axes(mesh, needs: tuple[str, ...] = AXES, use: str = "training"):
    """A jax Mesh given by the caller, with Auto axes: jax3d places arrays with sharding constraints, which
    an Explicit axis (`jax.make_mesh`'s default) would treat as assertions. Its axes must be jax3d's."""
    import jax

    if not set(needs) <= set(mesh.axis_names):
        raise ConfigError(f"the mesh's axes are {tuple(mesh.axis_names)}; {use} needs jax3d's {AXES}, e.g. from "
                          "MeshConfig.build")
    if all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types):
        return mesh
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))


def layout_errors(mesh: MeshConfig, model: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> list[str]:
    """Every rule a (data, stage, model) layout must meet for this model and batch: one sentence per broken rule.

    The layer-split rules live here; those of the pipeline's shape (micro-batches per stage, which schedule
    takes virtual stages) in pipeline_spec.broken_rules, worded here with the training flags.
    """
    tp, pp, dp = mesh.model, mesh.stage, mesh.data
    errors = []
    split = [("--num-attention-heads", model.num_attention_heads), ("--hidden-size", model.hidden_size),
             ("--ffn-hidden-size", model.ffn_hidden_size), ("--vocab-size (padded)", model.vocab_size)]
    if model.kv_heads != model.num_attention_heads:  # as in Megatron, KV heads are split, not copied
        split.insert(1, ("--num-key-value-heads", model.kv_heads))
    undivided = [f"{flag} {value}" for flag, value in split if value % tp]
    if undivided:  # one sentence, with the sizes that would do: they split the model and the devices
        # (a vocabulary from the tokenizer is padded for whichever size is chosen, so it decides nothing)
        common = math.gcd(*(value for _, value in split[:-1]))
        fits = ", ".join(str(t) for t in range(1, common + 1) if common % t == 0 and mesh.size % t == 0)
        errors.append(f"{' and '.join(undivided)} {'is' if len(undivided) == 1 else 'are'} not divisible by "
                      f"--tensor-model-parallel-size {tp}; pass one of {fits}")
    if model.hidden_size % model.num_attention_heads and not model.kv_channels:  # Megatron's rule, without it
        errors.append(f"--hidden-size {model.hidden_size} is not divisible by "
                      f"--num-attention-heads {model.num_attention_heads}")
    v = parallel.virtual_stages
    lpvs = parallel.layers_per_virtual_stage
    if lpvs and pp > 1 and (model.num_layers // pp) % lpvs:
        errors.append(f"--num-layers-per-virtual-pipeline-stage {lpvs} does not divide the "
                      f"{model.num_layers // pp} layers of each of the {pp} pipeline stages")
    elif v < 1:
        errors.append(f"virtual pipeline stages {v} must be at least 1")
    elif parallel.pipeline_layout:
        if len(parallel.pipeline_layout) != pp * v or sum(parallel.pipeline_layout) != model.num_layers:
            errors.append(f"--pipeline-model-parallel-layout {','.join(map(str, parallel.pipeline_layout))} "
                          f"must list {pp * v} (virtual) stage sizes that sum to --num-layers {model.num_layers}")
    elif model.num_layers % (pp * v):
        errors.append(f"--num-layers {model.num_layers} is not divisible by --pipeline-model-parallel-size "
                      f"{pp} x virtual stages {v}; change them or give --pipeline-model-parallel-layout")
    if model.seq_length > model.max_position_embeddings:
        errors.append(f"--seq-length {model.seq_length} exceeds --max-position-embeddings "
                      f"{model.max_position_embeddings}; pass --seq-length {model.max_position_embeddings} or less")
    if parallel.sequence_parallel and model.seq_length % tp:
        errors.append(f"--seq-length {model.seq_length} is not divisible by --tensor-model-parallel-size "
                      f"{tp}, which --sequence-parallel needs")
    mb, gb = train.micro_batch_size, train.global_batch_size
    micro = gb // (mb * dp)
    broken = broken_rules(parallel.pipeline_schedule, pp, micro, v)
    if gb % (mb * dp):
        errors.append(f"--global-batch-size {gb} is not divisible by --micro-batch-size {mb} x data-parallel "
                      f"size {dp} = {mb * dp}")
    elif pp > 1 and FEW_MICROBATCHES in broken:
        errors.append(f"{micro} micro-batches per step is fewer than --pipeline-model-parallel-size "
                      f"{pp}; raise --global-batch-size to at least {mb * dp * fewest_microbatches(pp)}")
    elif pp > 1 and UNEVEN_MICROBATCHES in broken:
        errors.append(f"{micro} micro-batches per step is not divisible by "
                      f"--pipeline-model-parallel-size {pp}, which the interleaved schedule needs")
    interleaved = takes_virtual_stages(parallel.pipeline_schedule)
    if pp == 1 and (interleaved or lpvs):
        given = [f for f, on in (("--pipeline-schedule interleaved", interleaved),
                                 (f"--num-layers-per-virtual-pipeline-stage {lpvs}", lpvs)) if on]
        errors.append(f"{' and '.join(given)} {'need' if len(given) > 1 else 'needs'} --pipeline-model-parallel-size "
                      f"2 or more, but it is 1; raise it or drop {'them' if len(given) > 1 else 'that flag'}")
    elif TOO_FEW_CHUNKS in broken:
        errors.append("--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage "
                      "(at least 2 chunks per stage)")
    elif CHUNKS_NOT_INTERLEAVED in broken and v > 1:  # fewer than 1 is refused above
        errors.append("--num-layers-per-virtual-pipeline-stage needs --pipeline-schedule interleaved")
    if parallel.zero_stage not in (None, 0, 1, 2, 3):
        errors.append(f"--zero-stage {parallel.zero_stage} must be 0, 1, 2 or 3")
    return errors
