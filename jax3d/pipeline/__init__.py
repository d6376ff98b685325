"""Pipeline parallelism: schedules as tables, and the shard_map loop that runs any of them.

Exports resolve lazily so that `python -m jax3d.cli.schedules` does not import JAX.
"""
import importlib

_EXPORTS = {
    "pipeline_value_and_grad": "loop",
    "LayerLayout": "layout", "PipelineError": "layout", "dropout_key": "layout",
    "layer_keys": "layout", "make_layout": "layout", "to_pipeline_order": "layout",
    "from_pipeline_order": "layout",
    "SCHEDULES": "schedules", "Schedule": "schedules", "ScheduleError": "schedules",
    "bubble_fraction": "schedules", "live_activations": "schedules", "make_schedule": "schedules",
    "simulate": "schedules", "validate": "schedules",
}
_MODULES = ("passes", "program", "residuals", "toy", "loop", "layout", "schedules")
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"jax3d.pipeline.{_EXPORTS[name]}"), name)
    if name in _MODULES:
        return importlib.import_module(f"jax3d.pipeline.{name}")
    raise AttributeError(f"module 'jax3d.pipeline' has no attribute {name!r}")
