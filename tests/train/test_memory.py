"""The memory guard: what the host can still grant (cgroup v1 / v2, /proc/meminfo), and the stop it makes."""
import os
import types

import pytest

from jax3d.config import ConfigError
from jax3d.train import memory
from jax3d.parallel.plan import Plan

GIB = 2**30


def _write(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _meminfo(root, available_gib):
    _write(root, "proc/meminfo", f"MemTotal:       99999999 kB\nMemAvailable:   {available_gib * 2**20} kB\n")


def test_v2_headroom_counts_inactive_page_cache_as_free_and_a_parent_limit_binds(tmp_path):
    _write(tmp_path, "proc/self/cgroup", "0::/user.slice/job\n")
    cg = "sys/fs/cgroup/user.slice"
    _write(tmp_path, f"{cg}/job/memory.max", f"{8 * GIB}\n")
    _write(tmp_path, f"{cg}/job/memory.current", f"{6 * GIB}\n")
    _write(tmp_path, f"{cg}/job/memory.stat", f"anon {3 * GIB}\nfile {3 * GIB}\ninactive_file {2 * GIB}\n")
    assert memory.cgroup_headroom(str(tmp_path)) == 8 * GIB - (6 * GIB - 2 * GIB)
    _meminfo(tmp_path, 16)
    assert memory.host_available_bytes(root=str(tmp_path)) == 4 * GIB
    # The parent's limit is tighter than the job's own: 7 GiB - (7 GiB - 1 GiB cache) = 1 GiB.
    _write(tmp_path, f"{cg}/memory.max", f"{7 * GIB}\n")
    _write(tmp_path, f"{cg}/memory.current", f"{7 * GIB}\n")
    _write(tmp_path, f"{cg}/memory.stat", f"inactive_file {GIB}\n")
    assert memory.host_available_bytes(root=str(tmp_path)) == GIB


def test_v1_reads_the_memory_hierarchy_and_ignores_its_no_limit_value(tmp_path):
    _write(tmp_path, "proc/self/cgroup", "5:devices:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n")
    cg = "sys/fs/cgroup/memory"
    _write(tmp_path, f"{cg}/memory.limit_in_bytes", "9223372036854771712\n")
    _write(tmp_path, f"{cg}/memory.usage_in_bytes", f"{50 * GIB}\n")
    _write(tmp_path, f"{cg}/process_api/abc/memory.limit_in_bytes", f"{24 * GIB}\n")
    _write(tmp_path, f"{cg}/process_api/abc/memory.usage_in_bytes", f"{10 * GIB}\n")
    _write(tmp_path, f"{cg}/process_api/abc/memory.stat",
           f"cache {4 * GIB}\ninactive_file 0\ntotal_inactive_file {3 * GIB}\n")
    assert memory.cgroup_headroom(str(tmp_path)) == 24 * GIB - (10 * GIB - 3 * GIB)
    _meminfo(tmp_path, 30)
    assert memory.host_available_bytes(root=str(tmp_path)) == 17 * GIB


def test_a_container_that_sees_its_cgroup_as_the_mount_root(tmp_path):
    """/proc/self/cgroup names a path the container's mount does not have: the mount root's files count."""
    _write(tmp_path, "proc/self/cgroup", "0::/kubepods/pod1/ctr\n")
    _write(tmp_path, "sys/fs/cgroup/memory.max", f"{2 * GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/memory.current", f"{GIB}\n")
    assert memory.cgroup_headroom(str(tmp_path)) == GIB


def test_no_limit_falls_back_to_meminfo(tmp_path):
    _write(tmp_path, "proc/self/cgroup", "0::/a\n")
    _write(tmp_path, "sys/fs/cgroup/a/memory.max", "max\n")
    _write(tmp_path, "sys/fs/cgroup/a/memory.current", f"{GIB}\n")
    assert memory.cgroup_headroom(str(tmp_path)) is None
    _meminfo(tmp_path, 5)
    assert memory.host_available_bytes(root=str(tmp_path)) == 5 * GIB
    assert memory.host_available_bytes(root=str(tmp_path / "nothing")) is None


def _compiled(args_gib, temp_gib):
    """Stands in for a compiled step: only its memory analysis is read."""
    mem = types.SimpleNamespace(argument_size_in_bytes=args_gib * GIB, output_size_in_bytes=args_gib * GIB,
                                alias_size_in_bytes=args_gib * GIB, temp_size_in_bytes=temp_gib * GIB)
    return types.SimpleNamespace(memory_analysis=lambda: mem)


def test_check_fits_stops_with_one_sentence_naming_the_figure_and_the_fixes(monkeypatch):
    # 1 GiB of arguments (donated) + 2 GiB of temporaries = 3 GiB per device, 8 emulated devices = 24 GiB.
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 10 * GIB)
    with pytest.raises(ConfigError) as e:
        memory.check_fits(_compiled(1, 2))
    msg = str(e.value)
    assert "3.0 GiB per device x 8 emulated devices = 24.0 GiB" in msg and "10.0 GiB free" in msg
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--zero-stage",
                 "--recompute", "--micro-batch-size", "--no-memory-check"):
        assert flag in msg
    assert msg.count(". ") == 0 and "\n" not in msg
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 24 * GIB)
    memory.check_fits(_compiled(1, 2))  # exactly fits


def test_the_guard_stops_a_resumed_run_before_its_checkpoint_is_read(monkeypatch):
    from jax3d.train.loop import train
    from tests.helpers import tiny_config

    class Checkpointer:
        def step_to_restore(self):  # lists steps, reads no arrays
            return 1

        def restore(self, steps, step=-1):
            restored.append(steps)
            return None, 0

    restored = []
    cfg, mesh_cfg, mesh = tiny_config(data=8)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1)
    with pytest.raises(ConfigError, match="emulated devices"):
        train(Plan(cfg, mesh_cfg), mesh, inputs=None, progress=False, checkpointer=Checkpointer())
    assert restored == []


def test_a_run_claims_most_of_each_gpu_unless_told_otherwise():
    from jax3d.cli.train import DEVICE_MEMORY_FRACTION, claim_device_memory

    env = {}
    claim_device_memory(env)
    assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": DEVICE_MEMORY_FRACTION}
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}
    claim_device_memory(env)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == ".5"


def test_the_guard_also_checks_the_checkpoint_copy_of_a_pipeline_ordered_state(monkeypatch):
    """Interleaved (1, 2, 1): saves and restores hold the state and its logical-order copy at once, which
    here needs more than the step; a host with room for the step but not for that copy is told so."""
    from jax3d.train import step as step_mod
    from jax3d.train.loop import train
    from tests.helpers import tiny_config

    class Checkpointer:
        def step_to_restore(self):
            return None

    cfg, mesh_cfg, mesh = tiny_config(stage=2, zero=0, micro=1, global_batch=8, pipeline_schedule="interleaved",
                                      virtual_stages=2, model_kw={"num_layers": 4})
    steps = step_mod.build_steps(Plan(cfg, mesh_cfg), mesh)
    step_peak = memory.step_peak_bytes(steps.train_step.lower(
        step_mod.abstract_state(steps), step_mod.abstract_batch(steps, steps.model.sample_shapes())).compile())
    copy_peak = memory.step_peak_bytes(steps.compiled_logical_copy())
    assert copy_peak > step_peak
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 8 * (step_peak + copy_peak) // 2)
    with pytest.raises(ConfigError) as e:
        train(Plan(cfg, mesh_cfg), mesh, inputs=None, progress=False, checkpointer=Checkpointer())
    msg = str(e.value)
    assert msg.startswith("saving or restoring a checkpoint") and "--zero-stage 3" in msg and "\n" not in msg
    from jax3d.train.dry_run import dry_run  # --dry-run reports both figures the guard checks
    report = dry_run(Plan(cfg, mesh_cfg), mesh)
    assert (report["peak"], report["checkpoint_copy_peak"]) == (step_peak, copy_peak)


class _Gpu:
    """Stands in for one GPU: its kind and its allocator's statistics."""
    platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    def __init__(self, **stats_gib):
        self.stats = {k: int(v * GIB) for k, v in stats_gib.items()}

    def memory_stats(self):
        return self.stats


def _on(monkeypatch, device, preallocate="true"):
    monkeypatch.setattr(memory.jax, "local_devices", lambda: [device])
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", preallocate)


def test_the_gpu_guard_holds_the_peak_against_what_the_allocator_can_give(monkeypatch):
    """The pool XLA claimed at start can be smaller than bytes_limit (the claim backs off when something else
    holds the card): a step of 67.5 GiB passes a 71.3 GiB limit but not a 60 GiB pool."""
    _on(monkeypatch, _Gpu(bytes_limit=71.26, pool_bytes=71.26, largest_free_block_bytes=71.26, bytes_in_use=0))
    memory.check_fits(_compiled(14.7, 52.8))
    _on(monkeypatch, _Gpu(bytes_limit=71.26, pool_bytes=60, largest_free_block_bytes=60, bytes_in_use=0))
    tried = []

    def smaller(have):
        return memory.largest_fitting([8, 12, 4], lambda b: tried.append(b) or int((14.7 + 3.3 * b) * GIB), have)
    with pytest.raises(memory.DeviceOutOfMemory) as e:
        memory.check_fits(_compiled(14.7, 52.8), smaller=smaller)
    msg = str(e.value)
    assert "needs 67.5 GiB per device" in msg and "can give it 60.0 GiB" in msg and "largest free block" in msg
    assert "; --micro-batch-size 12 fits (54.3 GiB per device: the same global batch" in msg and "\n" not in msg
    assert tried == [12]  # the largest candidate fits: nothing smaller is compiled
    # A growing pool (XLA_PYTHON_CLIENT_PREALLOCATE=false) has its limit less what is in use.
    _on(monkeypatch, _Gpu(bytes_limit=71.26, pool_bytes=2, largest_free_block_bytes=2, bytes_in_use=10),
        preallocate="false")
    with pytest.raises(memory.DeviceOutOfMemory, match="can give it 61.3 GiB"):
        memory.check_fits(_compiled(14.7, 52.8))


def test_once_the_state_is_placed_the_temporaries_must_fit_in_one_free_block(monkeypatch):
    _on(monkeypatch, _Gpu(bytes_limit=71.26, pool_bytes=71.26, largest_free_block_bytes=56.56, bytes_in_use=14.7))
    memory.check_placed(_compiled(14.7, 52.8))
    _on(monkeypatch, _Gpu(bytes_limit=71.26, pool_bytes=71.26, largest_free_block_bytes=50, bytes_in_use=14.7))
    with pytest.raises(memory.DeviceOutOfMemory, match="52.8 GiB of temporaries in one block.*50.0 GiB left"):
        memory.check_placed(_compiled(14.7, 52.8))


def test_advice_after_running_out_is_for_a_fresh_run_with_the_whole_pool(monkeypatch):
    """A run that ran out may still hold part of the pool (on an H100, the state of the 1.3B step at micro-batch 24
    was still there, so the advice was micro-batch 8 where 12 fits); the next run has all of it."""
    _on(monkeypatch, _Gpu(bytes_limit=71.26, pool_bytes=71.26, largest_free_block_bytes=56.5, bytes_in_use=14.7))
    assert memory.device_capacity() == int(71.26 * GIB)
    _on(monkeypatch, _Gpu(bytes_limit=71.26, pool_bytes=20, largest_free_block_bytes=5, bytes_in_use=14.7),
        preallocate="false")
    assert memory.device_capacity() == int(71.26 * GIB)


def test_largest_fitting_compiles_from_the_largest_candidate_down():
    tried = []
    peak = lambda b: tried.append(b) or 10 * b  # noqa: E731
    assert memory.largest_fitting([1, 2, 4, 8], peak, 35) == (2, 20) and tried == [8, 4, 2]
    assert memory.largest_fitting([1, 2], peak, 5) is None


def test_micro_batches_below_keep_the_global_batch():
    from jax3d.train.loop import _micro_batches_below
    from tests.helpers import tiny_config

    cfg = tiny_config(data=2, micro=12, global_batch=48)[0]
    assert _micro_batches_below(cfg, 2) == [1, 2, 3, 4, 6, 8]


def test_a_step_that_runs_out_of_device_memory_ends_in_one_sentence(tmp_path, monkeypatch, capsys):
    """An allocation failure past the guard (here raised by the first batch, as XLA raises it at the first step) is
    reported with the step's compiled peak and the largest micro-batch whose step compiles to less, exit 2."""
    from jax3d.cli.train import main
    from jax3d.train import loop

    def out_of_memory(self):
        raise memory.jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 52.83GiB.")
    monkeypatch.setattr(loop._TrainBatches, "next", out_of_memory)
    argv = ["--cpu-devices", "8", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "32", "--train-iters", "2",
            "--no-progress", "--log-dir", str(tmp_path), "--tensor-model-parallel-size", "1",
            "--pipeline-model-parallel-size", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err
    assert "the run ran out of device memory" in lines[0] and "the train step's compiled peak is" in lines[0]
    assert "; --micro-batch-size 2 fits (" in lines[0] and "--recompute full" in lines[0]
