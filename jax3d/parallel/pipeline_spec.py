"""The pipeline's shape, and the rules its schedule, stages, virtual stages and micro-batches meet together.

The rules are decided here only. `jax3d.parallel.mesh.layout_errors` words them with the training flags and
`jax3d.pipeline.schedules.make_schedule` with its own arguments' names; the pipeline loop runs whatever
validated table it is given. This module imports neither JAX nor the config, so the schedule tables stay
free of both.
"""
from __future__ import annotations

from dataclasses import dataclass

# The one schedule that runs several model chunks (virtual stages) on each stage.
INTERLEAVED = "interleaved"

# The rules a pipeline's shape can break, in the order make_schedule reports them.
FEW_MICROBATCHES = "fewer micro-batches than stages"
TOO_FEW_CHUNKS = "the interleaved schedule with fewer than 2 virtual stages"
UNEVEN_MICROBATCHES = "the interleaved schedule with micro-batches that the stages do not divide"
CHUNKS_NOT_INTERLEAVED = "virtual stages other than 1 without the interleaved schedule"


def default_schedule(layers_per_virtual_stage: int) -> str:
    """The schedule of a run that names none: interleaved where it asks for virtual stages by their layers
    (--num-layers-per-virtual-pipeline-stage), else 1F1B."""
    return INTERLEAVED if layers_per_virtual_stage else "1f1b"


def takes_virtual_stages(schedule: str) -> bool:
    """Whether `schedule` runs more than one model chunk on each stage."""
    return schedule == INTERLEAVED


def fewest_microbatches(stages: int) -> int:
    """The fewest micro-batches a step over `stages` pipeline stages takes: one per stage, as in Megatron.
    The loop could run fewer, but a stage would then idle for most of every step."""
    return stages


def broken_rules(schedule: str, stages: int, microbatches: int, virtual_stages: int) -> list[str]:
    """The rules of the pipeline's shape (the constants above) that these sizes break; [] when none.
    `stages` must be at least 1."""
    chunked = takes_virtual_stages(schedule)
    broken = []
    if microbatches < fewest_microbatches(stages):
        broken.append(FEW_MICROBATCHES)
    if chunked and virtual_stages < 2:
        broken.append(TOO_FEW_CHUNKS)
    if chunked and microbatches % stages:  # its order runs the micro-batches in groups of `stages`
        broken.append(UNEVEN_MICROBATCHES)
    if not chunked and virtual_stages != 1:
        broken.append(CHUNKS_NOT_INTERLEAVED)
    return broken


@dataclass(frozen=True)
class PipelineSpec:
    """How a step runs its micro-batches: over `stages` pipeline stages with `schedule` when there are more
    than one, else accumulated one after another. What the train step hands the pipeline loop, what the train
    state's layer order and --dry-run's schedule figures follow."""

    schedule: str  # a name of jax3d.pipeline.schedules.SCHEDULES
    stages: int
    virtual_stages: int  # model chunks on each stage
    microbatches: int  # per step, on each data shard
    layer_counts: tuple[int, ...] | None  # layers of each virtual stage in order; None: an even split

    @property
    def pipelined(self) -> bool:
        return self.stages > 1

    @classmethod
    def of(cls, cfg, stages: int, data: int) -> "PipelineSpec":
        """The spec of a resolved Config on `stages` pipeline stages and `data` data shards."""
        par, train = cfg.parallel, cfg.train
        return cls(schedule=par.pipeline_schedule, stages=stages, virtual_stages=par.virtual_stages,
                   microbatches=train.global_batch_size // (train.micro_batch_size * data),
                   layer_counts=tuple(par.pipeline_layout) or None)
