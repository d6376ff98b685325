"""What jax3d's Pallas (Triton) kernels share: where they may run, and the block a dimension gets."""
from __future__ import annotations

import jax


def on_one_gpu() -> bool:
    """Whether the computation being traced runs on a single GPU: the kernels are not partitioned over a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    one_device = jax.device_count() == 1 if mesh.empty else mesh.size == 1
    return jax.default_backend() == "gpu" and one_device


def block_width(n: int) -> int:
    """Triton's blocks are powers of two: a dimension of `n` gets the next one up, its tail masked."""
    return 1 << (n - 1).bit_length()
