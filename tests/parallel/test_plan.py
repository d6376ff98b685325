"""jax3d.parallel.plan.resolve and the layout rules it checks: what it fills in, and what it refuses in one sentence."""
import dataclasses

import pytest

from jax3d.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from jax3d.parallel.mesh import MeshConfig, layout_errors
from jax3d.parallel.pipeline_spec import PipelineSpec
from jax3d.parallel.plan import SCAN_LAYERS_FROM, Plan, resolve
from jax3d.pipeline.schedules import ScheduleError, make_schedule


def _cfg(num_layers=4, vocab_size=256, train=None, **parallel):
    return Config(model=ModelConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                                    vocab_size=vocab_size, seq_length=16),
                  parallel=ParallelConfig(**parallel),
                  train=train or TrainConfig(micro_batch_size=1, global_batch_size=8))


@pytest.mark.parametrize("parallel, given", [
    (dict(pipeline_schedule="interleaved"), "--pipeline-schedule interleaved needs"),
    (dict(pipeline_schedule="interleaved", layers_per_virtual_stage=2),
     "--pipeline-schedule interleaved and --num-layers-per-virtual-pipeline-stage 2 need"),
    (dict(layers_per_virtual_stage=3), "--num-layers-per-virtual-pipeline-stage 3 needs"),
])
def test_virtual_stages_without_a_pipeline_are_refused_in_one_sentence(parallel, given):
    cfg = _cfg(tensor_parallel=2, pipeline_parallel=1, **parallel)
    with pytest.raises(ConfigError) as e:
        resolve(cfg, 8)
    assert str(e.value).startswith(given)
    assert str(e.value).endswith("--pipeline-model-parallel-size 2 or more, but it is 1; raise it or drop "
                                 + ("them" if " and " in given else "that flag"))
    errors = layout_errors(MeshConfig(4, 1, 2), cfg.model, cfg.parallel, cfg.train)
    assert len(errors) == 1


def test_an_automatic_layout_with_the_interleaved_schedule_keeps_a_pipeline():
    plan = resolve(_cfg(tensor_parallel=None, pipeline_parallel=None, pipeline_schedule="interleaved",
                        layers_per_virtual_stage=1), 8)
    assert (plan.mesh.data, plan.mesh.stage, plan.mesh.model) == (2, 2, 2)
    assert plan.cfg.parallel.virtual_stages == 2


@pytest.mark.parametrize("devices, zero, sharded", [(8, 0, (False, False, False)), (8, 1, (True, False, False)),
                                                     (8, 2, (True, True, False)), (8, 3, (True, True, True)),
                                                     (1, 3, (False, False, False))])
def test_the_plan_says_what_zero_shards_and_with_one_data_shard_nothing(devices, zero, sharded):
    z = resolve(_cfg(zero_stage=zero), devices).zero
    assert (z.optimizer_state, z.gradients, z.parameters) == sharded


def test_the_plan_carries_the_pipeline_spec():
    plan = resolve(_cfg(tensor_parallel=2, pipeline_parallel=2, pipeline_schedule="interleaved",
                        layers_per_virtual_stage=1), 8)
    assert plan.pipeline == PipelineSpec("interleaved", stages=2, virtual_stages=2, microbatches=4, layer_counts=None)
    assert Plan(plan.cfg, plan.mesh) == dataclasses.replace(plan, layout_note="as given")  # the facts of a resolved pair
    uneven = resolve(_cfg(num_layers=5, tensor_parallel=1, pipeline_parallel=2, pipeline_layout=(3, 2)), 8).pipeline
    assert uneven.layer_counts == (3, 2) and uneven.pipelined and not resolve(_cfg(), 8).pipeline.pipelined


def test_one_rule_refuses_a_pipeline_shape_in_training_and_in_the_schedule_tables():
    """3 micro-batches do not divide over 2 interleaved stages: layout_errors and make_schedule both say so, from
    the one decision in jax3d.parallel.pipeline_spec."""
    cfg = _cfg(pipeline_schedule="interleaved", virtual_stages=2, train=TrainConfig(micro_batch_size=1,
                                                                                     global_batch_size=6))
    assert layout_errors(MeshConfig(2, 2, 1), cfg.model, cfg.parallel, cfg.train) == [
        "3 micro-batches per step is not divisible by --pipeline-model-parallel-size 2, which the interleaved "
        "schedule needs"]
    with pytest.raises(ScheduleError, match="--microbatches 3 must be divisible by --stages 2"):
        make_schedule("interleaved", 2, 3, 2)


def test_mesh_from_automatic_sizes_asks_for_resolve():
    with pytest.raises(ConfigError, match="pass it through jax3d.parallel.plan.resolve"):
        MeshConfig.from_parallel(ParallelConfig(tensor_parallel=None, pipeline_parallel=None), 8)
    with pytest.raises(ConfigError, match="automatic"):
        MeshConfig.from_parallel(ParallelConfig(tensor_parallel=2, pipeline_parallel=None), 8)


def test_a_vocabulary_too_small_for_the_tokenizer_names_where_it_came_from():
    with pytest.raises(ConfigError) as e:
        resolve(_cfg(vocab_size=256), 8, tokenizer_vocab=300)
    assert str(e.value) == "--vocab-size 256 is smaller than the tokenizer's 300 tokens; raise it or leave it out"
    with pytest.raises(ConfigError) as e:
        resolve(_cfg(vocab_size=256), 8, tokenizer_vocab=300, checkpoint="ckpt/run", from_checkpoint=["vocab_size"])
    assert str(e.value) == ("the checkpoint in --load ckpt/run has a vocabulary of 256, smaller than the "
                            "tokenizer's 300 tokens; use the tokenizer that checkpoint was trained with")


def test_a_rule_a_checkpoint_field_breaks_blames_the_checkpoint():
    """Fields taken from --load are named with where they came from; a flag the user gave is not."""
    cfg = _cfg(tensor_parallel=4).replace(model={"num_attention_heads": 2})
    with pytest.raises(ConfigError) as e:
        resolve(cfg, 8, checkpoint="ckpt/run", from_checkpoint=["num_attention_heads", "num_layers"])
    assert str(e.value) == ("--num-attention-heads 2 (from the checkpoint in --load ckpt/run) is not divisible by "
                            "--tensor-model-parallel-size 4; pass one of 1, 2")
    with pytest.raises(ConfigError) as e:
        resolve(cfg, 8, checkpoint="ckpt/run", from_checkpoint=["num_layers"])
    assert str(e.value) == "--num-attention-heads 2 is not divisible by --tensor-model-parallel-size 4; pass one of 1, 2"


def test_scan_layers_is_decided_once_from_the_depth_unless_given():
    assert resolve(_cfg(num_layers=SCAN_LAYERS_FROM), 8).cfg.model.scan_layers is True
    assert resolve(_cfg(num_layers=SCAN_LAYERS_FROM - 1), 8).cfg.model.scan_layers is False
    given = _cfg(num_layers=SCAN_LAYERS_FROM).replace(model={"scan_layers": False})
    assert resolve(given, 8).cfg.model.scan_layers is False


def test_deep_stacks_are_scanned_on_cpus_only(monkeypatch):
    """Scanning compiles a deep stack fast on a CPU; on a GPU the unrolled step runs faster."""
    monkeypatch.setattr("jax.default_backend", lambda: "gpu")
    assert resolve(_cfg(num_layers=SCAN_LAYERS_FROM), 8).cfg.model.scan_layers is False
    monkeypatch.setattr("jax.default_backend", lambda: "cpu")
    assert resolve(_cfg(num_layers=SCAN_LAYERS_FROM), 8).cfg.model.scan_layers is True


def test_a_plan_carries_the_facts_every_consumer_reads():
    """The rules, the batch spec, ZeRO, the pipeline and the kernels come with the plan; a changed config's plan
    derives them again."""
    from jax.sharding import PartitionSpec as P

    from jax3d.kernels.policy import KernelPolicy
    from jax3d.parallel.rules import ShardingRules

    plan = resolve(_cfg(tensor_parallel=2, pipeline_parallel=2, sequence_parallel=True, zero_stage=None), 8)
    assert plan.rules == ShardingRules.create(sequence_parallel=True) and plan.rules.splits("act_seq")
    assert plan.batch_spec == P(None, "data")
    assert (plan.cfg.parallel.zero_stage, plan.zero.optimizer_state, plan.pipeline.microbatches) == (1, True, 4)
    assert plan.kernels == KernelPolicy.resolve("cpu", 8) == KernelPolicy.none()
    other = plan.replace(cfg=plan.cfg.replace(parallel={"sequence_parallel": False}, train={"micro_batch_size": 2}))
    assert not other.rules.splits("act_seq") and other.pipeline.microbatches == 2 and other.kernels == plan.kernels


def test_the_plan_carries_the_precision_policy_and_a_changed_precision_derives_it_again(monkeypatch):
    """resolve decides the PrecisionPolicy once, checked against JAX's devices (FP8 on a GPU without it is one
    sentence); the plan of a config with other precision flags carries that config's policy."""
    from types import SimpleNamespace

    import jax

    from jax3d.config import PrecisionConfig
    from jax3d.parallel.precision import PrecisionPolicy

    cfg = _cfg().replace(precision={"dtype": "bfloat16", "fp8": "hybrid"})
    plan = resolve(cfg, 8)
    assert plan.precision == PrecisionPolicy.of(cfg.precision) and plan.precision.fp8.format == "hybrid"
    assert Plan(plan.cfg, plan.mesh).precision == plan.precision
    fp16 = plan.replace(cfg=plan.cfg.replace(precision={"dtype": "float16", "fp8": ""}))
    assert fp16.precision == PrecisionPolicy.of(PrecisionConfig(dtype="float16")) and fp16.precision.fp8 is None
    assert plan.replace(layout_note="x").precision is plan.precision
    a100 = SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(jax, "devices", lambda *a: [a100] * 8)
    with pytest.raises(ConfigError, match="--fp8-hybrid needs FP8 tensor cores"):
        resolve(cfg, 8, platform="cpu")


def test_the_plan_picks_the_schedule_a_run_leaves_open():
    assert resolve(_cfg(pipeline_parallel=2, pipeline_schedule=None), 2).cfg.parallel.pipeline_schedule == "1f1b"
    picked = resolve(_cfg(pipeline_parallel=2, pipeline_schedule=None, layers_per_virtual_stage=1), 2).cfg.parallel
    assert (picked.pipeline_schedule, picked.virtual_stages) == ("interleaved", 2)


def _counting(monkeypatch) -> dict:
    """Wraps `resolve` and `settle` (where the plan calls them, and where any other caller would import them)
    with counters."""
    from jax3d import counts
    from jax3d.parallel import plan as plan_mod

    calls = {"resolve": 0, "settle": 0}

    def counted(name, fn):
        def wrapper(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)
        return wrapper

    monkeypatch.setattr(plan_mod, "resolve", counted("resolve", plan_mod.resolve))
    settle = counted("settle", counts.settle)
    monkeypatch.setattr(plan_mod, "settle", settle)
    monkeypatch.setattr(counts, "settle", settle)
    return calls


def test_a_run_and_the_entries_after_it_resolve_and_settle_once_each(tmp_path, monkeypatch, capsys):
    """A train.py run counted in samples (in process, --save), then evaluation and generation of its checkpoint:
    each resolves its plan once and settles its counts once, and hands the plan on."""
    from jax3d.cli.train import main
    from jax3d.inference.generate import generator_for, load_gpt_checkpoint
    from jax3d.train.evaluate import evaluate_checkpoint

    ckpt = str(tmp_path / "ckpt")
    calls = _counting(monkeypatch)
    assert main(["--preset", "gpt-tiny", "--num-layers", "2", "--seq-length", "32", "--train-samples", "32",
                 "--global-batch-size", "16", "--micro-batch-size", "2", "--lr-decay-samples", "32",
                 "--eval-interval", "0", "--no-progress", "--save", ckpt]) == 0
    assert calls == {"resolve": 1, "settle": 1}
    assert '"step": 2' in capsys.readouterr().out  # --train-samples 32 of 16 a batch: settled into 2 steps

    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 20)
    calls.update(resolve=0, settle=0)
    evaluate_checkpoint(ckpt, text_file=str(text), micro_batch_size=1, progress=False)
    assert calls == {"resolve": 1, "settle": 1}

    calls.update(resolve=0, settle=0)
    cfg, params, tok = load_gpt_checkpoint(ckpt)
    gen = generator_for(cfg, params, tok, [tok.tokenize("def f(")], 4)
    assert len(gen.generate([tok.tokenize("def f(")], 4)[0]) == 4
    assert calls == {"resolve": 1, "settle": 1}
