"""The step benchmark's runs: `throughput.py --tune` settings parsed from "FIELD=V,..." equal the Tuning
built directly, bad settings are refused with one sentence, the settings a run carries reach the
kernel's call, and a BERT shape gets a batch in Megatron's BERT layout."""
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


def test_bert_shape_gets_a_bert_batch():
    """The benchmark's BERT batch has Megatron's layout: token ids across the vocabulary, and masks,
    segment types and the sentence-order flag of 0 or 1 only."""
    import numpy as np

    steps, _state, batch, _compiled, _ = step_bench.build(step_bench.Run("bert-tiny", dtype="float32"))
    assert steps.cfg.model.model_type == "bert"
    assert set(batch) == set(steps.model.sample_shapes())
    for key in ("types", "loss_mask", "padding_mask", "is_random"):
        assert set(np.unique(np.asarray(batch[key]))) <= {0, 1}, key
    assert np.asarray(batch["text"]).max() > 1
