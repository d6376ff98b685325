"""The parallel plan: the (data, stage, model) mesh, every layout rule, the logical-axis table and ZeRO.

    mesh.py           the mesh axes, their sizes (MeshConfig), CPU emulation, multi-host start, layout_errors
    plan.py           resolve: a Config and a device count -> a validated Plan (config, mesh, ZeRO plan,
                      pipeline spec), automatic fields filled in
    zero.py           ZeroPlan (what is sharded over `data`) and ZeRO as sharding transforms
    pipeline_spec.py  PipelineSpec (schedule, stages, virtual stages, micro-batches) and the pipeline-shape rules
    precision.py      PrecisionPolicy: compute dtype, loss scaling, FP8 recipe, compiler options, device check,
                      generation's weight and cache dtypes, decided once from PrecisionConfig
    rules.py          logical axis names -> mesh axes, the one table of tensor, sequence and pipeline parallelism

Code elsewhere reads the Plan's named facts (`plan.zero.gradients`, `plan.pipeline.virtual_stages`) and
never decides from `zero_stage` or the schedule's name what a layout allows.

Exports resolve lazily, so that the schedule tables (jax3d.pipeline.schedules, which read the pipeline-shape
rules) import no JAX.
"""
from jax3d.lazy import lazy_getattr

_EXPORTS = {
    "AXES": "mesh", "MeshConfig": "mesh", "emulate_cpu_devices": "mesh", "init_distributed": "mesh",
    "layout_errors": "mesh", "with_auto_axes": "mesh",
    "Plan": "plan", "resolve": "plan",
    "ZeroPlan": "zero", "add_data_axis": "zero", "cast_for_compute": "zero", "state_specs": "zero",
    "zero_specs": "zero",
    "PipelineSpec": "pipeline_spec",
    "PrecisionPolicy": "precision",
    "BASE_RULES": "rules", "ShardingRules": "rules", "constrain_tree": "rules", "named_shardings": "rules",
    "tree_specs": "rules", "with_shardings": "rules",
}
_MODULES = ("mesh", "plan", "zero", "pipeline_spec", "precision", "rules")
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, _MODULES)
