"""Checkpoint save / restore speed and size for the GPT-350M shape (24 layers, d 1024, 16 heads, vocab 50304).

  python -m benchmarks.checkpoint_speed [--devices 8] [--layout 2,1,4] [--zero 1] [--restore-layout 1,2,4]
      [--dir /tmp/jax3d_ckpt_bench]

Reports, as JSON: state bytes, bytes on disk, how long the train loop is blocked by an asynchronous
save (save call to return) against the whole write, a synchronous save, and a restore onto another
layout. It also checks that the async save is safe under donation: right after the save returns, the
state is overwritten in place by a donating jit, and the restored checkpoint must still hold the old values.
"""
import argparse
import json
import os
import shutil
import subprocess
import time


def _layout(s):
    return tuple(int(x) for x in s.split(","))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--layout", type=_layout, default=(2, 1, 4))
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--restore-layout", type=_layout, default=(1, 2, 4))
    p.add_argument("--restore-zero", type=int, default=0)
    p.add_argument("--dir", default="/tmp/jax3d_ckpt_bench")
    a = p.parse_args()

    from jax3d.parallel.mesh import emulate_cpu_devices
    emulate_cpu_devices(a.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax3d.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from jax3d.checkpoint.checkpointer import Checkpointer
    from jax3d.parallel.plan import resolve
    from jax3d.train.step import build_steps

    model = ModelConfig(num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=50304,
                        seq_length=1024, hidden_dropout=0.0, attention_dropout=0.0)

    def steps_for(layout, zero):
        d, s, m = layout
        cfg = Config(model=model, parallel=ParallelConfig(tensor_parallel=m, pipeline_parallel=s, zero_stage=zero),
                     train=TrainConfig(micro_batch_size=1, global_batch_size=8 * d, save=a.dir))
        plan = resolve(cfg, d * s * m)
        return plan.cfg, build_steps(plan)

    shutil.rmtree(a.dir, ignore_errors=True)
    cfg, steps = steps_for(a.layout, a.zero)
    # Trained-looking values: Adam moments of zeros would compress to nothing and flatter the figures.
    noisy = jax.jit(lambda s, k: jax.tree.map(
        lambda x: x + 0.01 * jax.random.normal(jax.random.fold_in(k, x.size % 9973), x.shape, x.dtype)
        if x.dtype == jnp.float32 and x.ndim else x, s), donate_argnums=0, out_shardings=steps.state_shardings)
    state = jax.block_until_ready(noisy(steps.init_state(0), jax.random.key(1)))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    ck = Checkpointer(cfg)
    runs = []
    for step in (1, 2):  # the first save also sets up orbax's threads and directories
        probe = jax.device_get(steps.logical_params(state.params)["blocks"]["mlp"]["up_kernel"][0, :4, :4])
        t0 = time.perf_counter()
        ck.save(step, state, {"consumed_samples": 0})
        blocked = time.perf_counter() - t0
        # The next train step donates the state; emulate it by rewriting every buffer in place.
        state = jax.block_until_ready(noisy(state, jax.random.key(step + 1)))
        ck.wait()
        runs.append((blocked, time.perf_counter() - t0))
    disk = int(subprocess.check_output(["du", "-sb", os.path.join(a.dir, "2")]).split()[0])
    t0 = time.perf_counter()
    ck.save(3, state, {"consumed_samples": 0}, wait=True)
    sync_total = time.perf_counter() - t0
    del state
    ck.close()

    rcfg, rsteps = steps_for(a.restore_layout, a.restore_zero)
    t0 = time.perf_counter()
    restored, _ = Checkpointer(rcfg.replace(train={"load": a.dir, "ckpt_step": 2})).restore(rsteps)
    jax.block_until_ready(restored)
    restore_s = time.perf_counter() - t0
    ok = np.array_equal(jax.device_get(rsteps.logical_params(restored.params)["blocks"]["mlp"]["up_kernel"][0, :4, :4]),
                        probe)
    shutil.rmtree(a.dir, ignore_errors=True)
    print(json.dumps({
        "model": "gpt-350m shape", "params": steps.model.num_params(), "devices": a.devices,
        "save_layout": {"dsm": a.layout, "zero": a.zero},
        "restore_layout": {"dsm": a.restore_layout, "zero": a.restore_zero},
        "state_bytes": state_bytes, "disk_bytes": disk,
        "async_save_blocked_s": [round(b, 3) for b, _ in runs],
        "async_save_total_s": [round(t, 3) for _, t in runs],
        "sync_save_s": round(sync_total, 3), "restore_s": round(restore_s, 3),
        "write_GBps": round(disk / sync_total / 1e9, 3), "restore_GBps": round(disk / restore_s / 1e9, 3),
        "restored_values_predate_donation": bool(ok)}, indent=1))


if __name__ == "__main__":
    main()
