"""Pipeline parallelism: schedules as tables, and the shard_map loop that runs any of them.

Exports resolve lazily so that `python -m jax3d.cli.schedules` does not import JAX.
"""
from jax3d.lazy import lazy_getattr

_EXPORTS = {
    "pipeline_value_and_grad": "loop",
    "LayerLayout": "layout", "PipelineError": "layout", "dropout_key": "layout",
    "layer_keys": "layout", "make_layout": "layout", "to_pipeline_order": "layout",
    "from_pipeline_order": "layout",
    "SCHEDULES": "schedules", "Schedule": "schedules", "ScheduleError": "schedules",
    "bubble_fraction": "schedules", "live_activations": "schedules", "make_schedule": "schedules",
    "simulate": "schedules", "validate": "schedules",
}
_MODULES = ("passes", "program", "residuals", "loop", "layout", "schedules")
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, _MODULES)
