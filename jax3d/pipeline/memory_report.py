"""Per-device temp memory of the pipelined toy model, compiled ahead of time on emulated CPUs.

    python -m jax3d.pipeline.memory_report [--microbatches 8,16,32] [--schedules gpipe,1f1b,zb-h1]

Prints one JSON line per (schedule, m) with memory_analysis() figures on mesh (1, 4, 1). 1F1B and
ZB-H1 keep a fixed number of activation slots, so their temp memory does not grow with m; GPipe's
grows by one stage-input activation per micro-batch.
"""
import argparse
import json
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax3d.pipeline.memory_report")
    parser.add_argument("--microbatches", default="8,16,32")
    parser.add_argument("--schedules", default="gpipe,1f1b,zb-h1")
    args = parser.parse_args(argv)
    # emulated devices must be configured before JAX starts its backends
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=4").strip()
    import jax

    from jax3d.pipeline import toy
    from jax3d.pipeline.schedules import make_schedule

    mesh = jax.make_mesh((1, 4, 1), ("data", "stage", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    for name in args.schedules.split(","):
        for m in (int(x) for x in args.microbatches.split(",")):
            ma = toy.compile_memory(mesh, make_schedule(name, 4, m), m=m)
            print(json.dumps({"schedule": name, "microbatches": m,
                              "temp_bytes": ma.temp_size_in_bytes,
                              "argument_bytes": ma.argument_size_in_bytes,
                              "output_bytes": ma.output_size_in_bytes}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
