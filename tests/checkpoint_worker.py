"""Subprocess side of the checkpoint tests (run as a script, never collected by pytest).

  python tests/checkpoint_worker.py crash DIR
      Saves step 1, then starts an asynchronous save of step 2 of a ~300 MB state and sleeps, so the
      test can SIGKILL it mid-write.
  python tests/checkpoint_worker.py multiproc PORT PID LOAD SAVE OUT
      One of 2 processes x 4 CPU devices: restores step 10 of LOAD onto (data, stage, model) = (2, 1, 4)
      spanning both processes, trains steps 11-20 on the test batches, saves step 20 to SAVE, and
      process 0 writes the losses to OUT as JSON.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax3d.parallel.mesh import emulate_cpu_devices  # noqa: E402  (imports no JAX backend)
from jax3d.parallel.plan import Plan


def crash(directory):
    emulate_cpu_devices(1)
    import jax

    from jax3d.checkpoint.checkpointer import Checkpointer
    from jax3d.train.step import build_steps
    from tests.helpers import tiny_config

    # ~25M parameters: params + Adam moments are ~300 MB, several seconds of writing on 2 cores.
    cfg, mesh_cfg, mesh = tiny_config(model_kw=dict(num_layers=4, hidden_size=512, num_attention_heads=8,
                                                    vocab_size=32768, seq_length=16), micro=1, global_batch=1)
    cfg = cfg.replace(train={"save": directory, "save_interval": 1})
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    state = steps.init_state(0)
    ck = Checkpointer(cfg)
    ck.save(1, state, {"consumed_samples": 1}, wait=True)
    print("SAVED 1", flush=True)
    state = state.replace(step=state.step + 1, params=jax.tree.map(lambda a: a + 1, state.params))
    ck.save(2, state, {"consumed_samples": 2})
    print("SAVING 2", flush=True)
    time.sleep(600)


def multiproc(port, pid, load, save, out):
    emulate_cpu_devices(4)
    import jax
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, int(pid))
    assert jax.device_count() == 8 and jax.local_device_count() == 4

    from jax3d.checkpoint.checkpointer import Checkpointer
    from jax3d.train.step import build_steps
    from tests.checkpoint.test_checkpoint import layout, train

    cfg, mesh_cfg, mesh = layout(2, 1, 4, zero=1)
    cfg = cfg.replace(train={"load": load, "ckpt_step": 10, "save": save, "save_interval": 10})
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    ck = Checkpointer(cfg)
    state, consumed = ck.restore(steps)
    assert int(state.step) == 10 and consumed == 10 * cfg.train.global_batch_size
    losses, state = train(steps, state, 10, 20, ck)
    ck.wait()
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump(losses.tolist(), f)


if __name__ == "__main__":
    {"crash": crash, "multiproc": multiproc}[sys.argv[1]](*sys.argv[2:])
