"""A tiny Llama (RMSNorm, SwiGLU, rotary, 8 heads over 4 KV heads, untied, no biases) trains to the same 20-step
loss curve on every layout, and resumes onto other layouts; its layout rules are one sentence."""
import jax
import numpy as np
import pytest

from jax3d.config import Config, ConfigError, ParallelConfig, TrainConfig
from jax3d.parallel.plan import resolve
from tests.checkpoint import test_checkpoint
from tests.helpers import tiny_config, tiny_model
from tests.checkpoint.test_checkpoint import GB, resume, uninterrupted
from jax3d.parallel.plan import Plan

LLAMA = dict(num_layers=4, normalization="rmsnorm", swiglu=True, num_key_value_heads=4, add_bias_linear=False,
             use_rotary_position_embeddings=True, rope_theta=500000.0, untie_embeddings_and_output_weights=True)
CURVE_TOL = 1e-5  # fp32, layouts differ only in the order of their sums
RESUME_TOL = 1e-6


def llama_layout(data, stage, model, zero=0, **parallel):
    """The tiny Llama on one (data, stage, model) layout, micro-batch 2 of a global batch of 16 (as
    tests/checkpoint/test_checkpoint.py's), 20 steps at a learning rate that moves the loss."""
    cfg, mesh_cfg, mesh = tiny_config(data=data, stage=stage, model=model, zero=zero, micro=2, global_batch=16,
                                      model_kw=LLAMA, **parallel)
    return cfg.replace(optim={"lr": 3e-3, "min_lr": 3e-4}, train={"train_iters": 20}), mesh_cfg, mesh


# Each layout compiles its own step, so three cover what a Llama adds to each kind of parallelism (its KV heads
# split over `model`, rotary positions on sequence-split activations, the untied head on the last stage); the
# schedules themselves are checked on every mesh with the GPT (tests/pipeline/test_pipeline_gpt.py, 1F1B among them).
LAYOUTS = {
    "124-zbh1": ((1, 2, 4), dict(pipeline_schedule="zb-h1")),  # 4-way tensor parallelism (one KV head a device)
    "412-zero3-sp": ((4, 1, 2, 3), dict(sequence_parallel=True)),  # ZeRO-3 with sequence parallelism
    # data, pipeline and tensor parallelism with ZeRO-1, the layers kept in pipeline order
    "222-interleaved": ((2, 2, 2, 1), dict(pipeline_schedule="interleaved", layers_per_virtual_stage=1)),
}


def counting_batch(cfg, i) -> dict:
    """Global batch number i: rows that count up by one from a random start, which a model learns in a few
    steps (the random rows of test_checkpoint's batches leave the loss flat at log(vocab))."""
    m = cfg.model
    start = np.random.RandomState(1000 + i).randint(0, m.vocab_size, (GB, 1))
    return {"text": ((start + np.arange(m.seq_length + 1)) % m.vocab_size).astype(np.int32)}


@pytest.fixture(scope="module", autouse=True)
def counting_batches():
    """test_checkpoint's train loop, on counting batches, for this module's runs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_checkpoint, "host_batch", counting_batch)
        yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """20 steps at (8, 1, 1), saving step 10."""
    return uninterrupted(tmp_path_factory, *llama_layout(8, 1, 1), "llama_ref")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_gives_the_same_loss_curve(reference, tmp_path_factory, name):
    args, parallel = LAYOUTS[name]
    ref = reference["losses"]
    assert len(ref) == 20 and ref[-1] < ref[0] - 0.5  # it learns (the batches repeat a little)
    run = uninterrupted(tmp_path_factory, *llama_layout(*args, **parallel), f"llama_{name}")
    np.testing.assert_allclose(run["losses"], ref, rtol=0, atol=CURVE_TOL, err_msg=name)


@pytest.mark.parametrize("name", ["124-zbh1", "412-zero3-sp"])
def test_resume_onto_another_layout(reference, name):
    """Step 10 of the (8, 1, 1) run, restored onto another layout, continues its curve."""
    args, parallel = LAYOUTS[name]
    losses, params = resume(reference, *llama_layout(*args, **parallel))
    np.testing.assert_allclose(losses, reference["losses"][10:], rtol=0, atol=RESUME_TOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), params, reference["params"])


def test_kv_heads_that_tensor_parallelism_cannot_split_are_refused_in_one_sentence():
    cfg = Config(model=tiny_model(**{**LLAMA, "num_key_value_heads": 2}),
                 parallel=ParallelConfig(tensor_parallel=4, pipeline_parallel=1),
                 train=TrainConfig(micro_batch_size=2, global_batch_size=16))
    with pytest.raises(ConfigError, match=r"^--num-key-value-heads 2 is not divisible by "
                                          r"--tensor-model-parallel-size 4; pass one of 1, 2$"):
        resolve(cfg, 8)
    with pytest.raises(ConfigError, match="--num-attention-heads 8 is not divisible by --num-key-value-heads 3"):
        tiny_model(**{**LLAMA, "num_key_value_heads": 3})


@pytest.mark.parametrize("model_kw", [{}, LLAMA], ids=["gpt", "llama"])
def test_fp16_without_dropout_tracks_fp32_on_the_cpu(model_kw):
    """--fp16 with no dropout (Llama's default) on a CPU, whose XLA has no f16 x f16 -> f32 dot for attention:
    five steps stay within fp16's reach of the fp32 ones (the step failed to compile before)."""
    curves = {}
    # A fixed loss scale: the dynamic one starts at 2**32 and skips the first steps while it comes down.
    for dtype, scale in (("float32", 0.0), ("float16", 1024.0)):
        cfg, mesh_cfg, mesh = tiny_config(data=8, micro=2, global_batch=GB,
                                          model_kw={**model_kw, "num_layers": 2, "hidden_dropout": 0.0,
                                                    "attention_dropout": 0.0})
        s = test_checkpoint.build_steps(Plan(cfg.replace(precision={"dtype": dtype, "loss_scale": scale}), mesh_cfg), mesh)
        curves[dtype], _ = test_checkpoint.train(s, s.init_state(0), 0, 5)
    np.testing.assert_allclose(curves["float16"], curves["float32"], rtol=0, atol=2e-2)
