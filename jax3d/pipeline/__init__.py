"""Pipeline parallelism: schedules as tables, and the shard_map loop that runs any of them."""
from jax3d.pipeline.layout import (LayerLayout, PipelineError, dropout_key, from_pipeline_order,
                                   layer_keys, make_layout, to_pipeline_order)
from jax3d.pipeline.loop import pipeline_value_and_grad
from jax3d.pipeline.schedules import (SCHEDULES, Schedule, ScheduleError, bubble_fraction,
                                      live_activations, make_schedule, simulate, validate)

__all__ = [
    "LayerLayout", "PipelineError", "SCHEDULES", "Schedule", "ScheduleError", "bubble_fraction",
    "dropout_key", "from_pipeline_order", "layer_keys", "live_activations", "make_layout",
    "make_schedule", "pipeline_value_and_grad", "simulate", "to_pipeline_order", "validate",
]
