"""FP8 delayed scaling's state: the amax history of every FP8 GEMM operand, laid out and sharded for the train state.

The recipe (format, margin, history length, algorithm) and its rules (the scales a history gives, how a step's
amaxes enter it) are the precision policy's (jax3d.parallel.precision.Recipe); this module lays the history out.

The state (`TrainState.fp8`) is a tree shaped like the blocks' scales leaves plus a trailing history dim:
(layers, 3, history) per GEMM, rows x, w, g, entry 0 the latest step's amax, entry i the amax of i steps
before. The step reads the scales off it (`Recipe.scales`), the model reports the amaxes it saw (the scales'
"gradients", max-reduced over micro-batches, data shards and pipeline stages' micro-batches), and
`Recipe.update` pushes them in. A step that is skipped (non-finite gradients) leaves the history as it was. The
first step quantizes with scale 1, as Transformer Engine's does: its gradients, far below e5m2's normal range,
mostly round to zero (with Megatron's warm-up its learning rate is 0 anyway), and every later step has amaxes.
"""
from __future__ import annotations

import jax


def history_specs(scales_specs):
    """PartitionSpecs of the history: those of the scales leaves, the history dim unsharded."""
    return jax.tree.map(lambda s: jax.sharding.PartitionSpec(*s, None), scales_specs,
                        is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
