"""`python launch/train.py`: flags -> config -> devices, then the run (jax3d.train.run: plan, data, train or
--dry-run)."""
from __future__ import annotations

import importlib.metadata
import os

from jax3d.cli.common import run_command
from jax3d.cli.train_flags import build_parser, config_from_args
from jax3d.config import ConfigError
from jax3d.parallel.mesh import emulate_cpu_devices, init_distributed


def _accelerator_installed() -> bool:
    """Whether a GPU/TPU JAX plugin is installed, decided without starting any JAX backend."""
    plat = os.environ.get("JAX_PLATFORMS", "")
    if plat:
        return any(p.strip() not in ("cpu", "") for p in plat.split(","))
    names = {d.metadata["Name"].lower().replace("_", "-") for d in importlib.metadata.distributions()
             if d.metadata and d.metadata["Name"]}
    return any(n.startswith(("jax-cuda", "jax-rocm", "libtpu")) or n in ("jaxlib-cuda",) for n in names)


# Of each GPU's memory, the share XLA's allocator may claim. JAX's own default, 75%, suits a notebook that
# shares the device; a training run is the device's only user, and the rest is left for CUDA, cuDNN and NCCL.
DEVICE_MEMORY_FRACTION = "0.90"


def claim_device_memory(env=os.environ) -> None:
    """Let XLA claim DEVICE_MEMORY_FRACTION of each GPU, unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise."""
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", DEVICE_MEMORY_FRACTION)


def setup_devices(args) -> None:
    if args.compilation_cache_dir:
        use_compilation_cache(args.compilation_cache_dir)
    if args.cpu_devices is not None:
        emulate_cpu_devices(args.cpu_devices)
    elif not _accelerator_installed():
        emulate_cpu_devices(8)
    else:
        claim_device_memory()
    init_distributed(args.coordinator_address, args.num_processes, args.process_id)


def use_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache in `path`: programs compiled here are kept there and read back by a
    later process that compiles the same program for the same devices."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--compilation-cache-dir {path} is a file; pass a directory (it is created if missing)")
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))


def _bad_input() -> tuple:
    from jax3d.data import DataError
    from jax3d.pipeline.layout import PipelineError
    from jax3d.pipeline.schedules import ScheduleError
    return ConfigError, DataError, PipelineError, ScheduleError


def main(argv=None) -> int:
    return run_command(_main, argv, _bad_input)


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    setup_devices(args)
    # Reading a directory's steps starts JAX, so this comes after the devices are set up.
    from jax3d.checkpoint.read import check_outside_checkpoint
    for flag, path in (("--save", cfg.train.save), ("--log-dir", cfg.train.log_dir)):
        if path:
            check_outside_checkpoint(flag, path)
    from jax3d.cli.megatron import after_plan, header_notes
    from jax3d.cli.train_flags import given_flags
    from jax3d.train.run import RunOptions, run

    def on_plan(plan) -> list[str]:
        """The command line's rules on the plan, and the header's notes on its flags."""
        after_plan(args, plan.cfg, plan.mesh.data)  # DeepSpeed's batch rule, on the data-parallel size
        notes = header_notes(args, plan.cfg)
        if args.pipeline_schedule and plan.mesh.stage == 1:
            notes.append(f"jax3d: --pipeline-schedule {args.pipeline_schedule} orders a pipeline's passes, and "
                         "--pipeline-model-parallel-size is 1 here, so it changes nothing")
        return notes

    options = RunOptions(given=frozenset(given_flags(argv)) if args.load else frozenset(),
                         exit_on_missing_checkpoint=args.exit_on_missing_checkpoint, dry_run=args.dry_run,
                         progress=not args.no_progress, memory_check=not args.no_memory_check)
    return run(cfg, options, on_plan=on_plan)
