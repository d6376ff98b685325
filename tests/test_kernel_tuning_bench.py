"""`throughput.py --tune`: a kernel's settings parsed from "FIELD=V,..." equal the Tuning built directly,
bad settings are refused with one sentence, and the settings a run carries reach the kernel's call."""
import dataclasses

import jax.numpy as jnp
import pytest

from benchmarks import step_bench
from jax3d.models import fused_gelu, fused_xent


def test_parsed_settings_equal_the_tuning_built_directly():
    assert step_bench.kernel_tuning("fused_xent", "block=2048,warps=4") == fused_xent.Tuning(block=2048, warps=4)
    assert step_bench.kernel_tuning("fused_gelu", "") == fused_gelu.DEFAULT
    run = step_bench.Run("125m-b32", tunings=(("fused_xent", "block=2048"),))
    assert run.label() == "125m-b32 fused_xent[block=2048]"


@pytest.mark.parametrize("module, fields, match", [("fused_nope", "rows=1", "no kernel"),
                                                   ("fused_xent", "blocks=2048", "not FIELD=INTEGER"),
                                                   ("fused_xent", "block=big", "not FIELD=INTEGER"),
                                                   ("fused_xent", "block=3000", "powers of two")])
def test_bad_settings_are_refused(module, fields, match):
    with pytest.raises(ValueError, match=match):
        step_bench.kernel_tuning(module, fields)


def test_a_runs_settings_reach_the_kernel(monkeypatch):
    monkeypatch.setattr(fused_gelu, "DEFAULT", fused_gelu.DEFAULT)  # restored after the test
    h, b = jnp.zeros((128, 256)), jnp.zeros((256,))
    ok = dataclasses.replace(fused_gelu.DEFAULT, cols_fwd=128, cols_bwd=128, rows_per_program=64)
    step_bench.apply_tunings([("fused_gelu", "cols_fwd=128,cols_bwd=128,rows_per_program=64")])
    assert fused_gelu.DEFAULT == ok
    assert fused_gelu.gelu_bias(h, b, interpret=True).shape == h.shape
    step_bench.apply_tunings([("fused_gelu", "rows_per_program=256")])  # 128 rows no longer split
    with pytest.raises(ValueError, match="does not split"):
        fused_gelu.gelu_bias(h, b, interpret=True)
