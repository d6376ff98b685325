"""What jax3d's Pallas (Triton) kernels share: where they may run, and the block a dimension gets."""
from __future__ import annotations

import jax

from jax3d.sharding.rules import ShardingRules


def on_one_gpu(rules: ShardingRules) -> bool:
    """Whether the computation being traced runs on a single GPU: the kernels are not partitioned over a mesh."""
    return jax.default_backend() == "gpu" and rules.single_device()


def block_width(n: int) -> int:
    """Triton's blocks are powers of two: a dimension of `n` gets the next one up, its tail masked."""
    return 1 << (n - 1).bit_length()
