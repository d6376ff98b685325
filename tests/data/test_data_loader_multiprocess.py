"""Two processes x 4 CPU devices: each host reads only the rows of its own shards."""
import subprocess
import sys
import textwrap

from tests.helpers import free_port, subprocess_env


WORKER = textwrap.dedent("""
    import os, sys
    proc, port = int(sys.argv[1]), sys.argv[2]
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax
    import numpy as np
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, proc)
    from jax3d.data.loader import BatchLoader

    class DS:
        reads = []
        def __len__(self): return 1000
        def __getitem__(self, i):
            self.reads.append(i)
            return {"text": np.arange(i, i + 3, dtype=np.int32)}

    ds = DS()
    mesh = jax.make_mesh((2, 2, 2), ("data", "stage", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    loader = BatchLoader(ds, 16, 2, mesh)
    batch = next(loader)
    loader.close()
    mine = set()
    for shard in batch["text"].addressable_shards:
        a, m = shard.index[0], shard.index[1]
        ids = [[ai * 8 + mi for mi in range(*m.indices(8))] for ai in range(*a.indices(2))]
        np.testing.assert_array_equal(np.asarray(shard.data),
                                      np.arange(3)[None, None] + np.asarray(ids)[..., None])
        mine |= {i for row in ids for i in row}
    assert len(mine) == 8, mine  # half of the 16-sample batch lives on this host
    # reads[0] is the constructor's look at sample 0 (for keys and shapes); after it, each of this
    # host's rows is read exactly once and no other host's row is read.
    step0 = [i for i in ds.reads[1:] if i < 16]
    assert sorted(step0) == sorted(mine), (ds.reads, sorted(mine))
    print("OK", proc, sorted(mine))
""")


def test_each_process_reads_only_its_rows(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    env = subprocess_env()
    procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert out.startswith("OK")
    rows = [eval(o.split(" ", 2)[2]) for o, _ in outs]
    assert sorted(rows[0] + rows[1]) == list(range(16))  # together they cover the batch once
