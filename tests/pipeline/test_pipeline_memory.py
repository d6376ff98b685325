"""Compiled temp memory of the pipelined toy model: 1F1B-family buffers do not grow with m."""
import jax
import pytest

from jax3d.pipeline import make_schedule
from tests import pipeline_toy as toy


@pytest.fixture(scope="module")
def temps():
    mesh = jax.make_mesh((1, 4, 1), ("data", "stage", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    return {(name, m): toy.compile_memory(mesh, make_schedule(name, 4, m), m=m).temp_size_in_bytes
            for name in ("gpipe", "1f1b", "zb-h1") for m in (8, 32)}


def test_1f1b_family_memory_flat_in_m_and_below_gpipe(temps):
    x_bytes = 16 * 256 * 128 * 4  # one stage-input activation of compile_memory's defaults
    # only the schedule table itself (a few int32 per tick) grows with m
    assert abs(temps["1f1b", 32] - temps["1f1b", 8]) < 64 * 1024
    assert abs(temps["zb-h1", 32] - temps["zb-h1", 8]) < 64 * 1024
    # GPipe keeps every micro-batch's stage input: 24 more micro-batches, 24 more activations
    assert temps["gpipe", 32] - temps["gpipe", 8] >= 24 * x_bytes
    for name in ("1f1b", "zb-h1"):
        assert temps[name, 8] < temps["gpipe", 8]
        assert temps[name, 32] < 0.6 * temps["gpipe", 32]
