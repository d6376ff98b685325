"""`python launch/train.py`: flags -> config -> devices and mesh -> data -> train (or --dry-run)."""
from __future__ import annotations

import importlib.metadata
import json
import os
import sys

from jax3d.cli.common import run_command
from jax3d.cli.train_flags import build_parser, config_from_args
from jax3d.config import ConfigError
from jax3d.parallel.mesh import emulate_cpu_devices, init_distributed
from jax3d.parallel.precision import PrecisionPolicy


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


def header(plan, num_params: int) -> str:
    """The run's first line: model, size, layout (and how it was chosen), ZeRO, dtype, batch."""
    cfg, mesh = plan.cfg, plan.mesh
    m, tr = cfg.model, cfg.train
    par = cfg.parallel
    pipeline = ""
    if mesh.stage > 1:
        micro = tr.global_batch_size // (tr.micro_batch_size * mesh.data)
        layers = f", layers {','.join(map(str, par.pipeline_layout))}" if par.pipeline_layout else ""
        pipeline = f"; {par.pipeline_schedule} pipeline over {micro} micro-batches{layers}"
    size = f"{num_params / 1e9:.1f}B" if num_params >= 1e9 else f"{num_params / 1e6:.1f}M"
    return (f"jax3d: {m.model_type} {m.num_layers}L d{m.hidden_size} ({size} params) on "
            f"(data, stage, model) = ({mesh.data}, {mesh.stage}, {mesh.model}), {plan.layout_note}{pipeline}; "
            f"ZeRO-{par.zero_stage}, {PrecisionPolicy.of(cfg.precision).describe()}, "
            f"global batch {tr.global_batch_size} x {m.seq_length} tokens")


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    setup_devices(args)
    # Reading a directory's steps starts JAX, so this comes after the devices are set up.
    from jax3d.checkpoint.read import check_outside_checkpoint
    for flag, path in (("--save", cfg.train.save), ("--log-dir", cfg.train.log_dir)):
        if path:
            check_outside_checkpoint(flag, path)
    import jax

    from jax3d.models import build_model
    from jax3d.parallel.plan import resolve
    from jax3d.train.inputs import build_inputs, tokenizer_and_paths, with_default_tokenizer, with_eod_token

    from_checkpoint, checked = (), None
    if args.load:  # fine-tuning: the checkpoint's model unless a flag says otherwise
        from jax3d.cli.train_flags import given_flags
        from jax3d.cli.resume import adopt_saved_model, adopt_saved_run, adopt_saved_tokenizer
        from jax3d.checkpoint.read import check_files, list_steps, read_meta, resolve_step
        found = list_steps(args.load)
        if not found and args.exit_on_missing_checkpoint:
            raise ConfigError(f"--load {args.load} holds no checkpoint and --exit-on-missing-checkpoint stops rather "
                              "than start from random weights; check the path, or drop the flag to start afresh")
        step = resolve_step(args.load, found, args.ckpt_step) if found else None
        if found:
            check_files(args.load, step)  # a damaged checkpoint is named before anything else is said
            checked = step  # its checksums read every byte: once is enough
            from jax3d.train.loop import check_not_past_end
            check_not_past_end(step, cfg.train)
        given = given_flags(argv)
        # what the checkpoint set, including values that equal a flag's default
        cfg, from_checkpoint = adopt_saved_model(cfg, args.load, args.ckpt_step, given)
        if found:  # resuming: the checkpoint's data, tokenizer, optimizer and seed, unless flags say otherwise
            meta = read_meta(args.load, step)
            adopted = adopt_saved_run(cfg, args.load, meta, given)
            # other data (a fine-tune, --override-data) is read with the checkpoint's tokenizer unless flags name one
            cfg, tok_note = adopt_saved_tokenizer(adopted.cfg, args.load, meta, given)
            if jax.process_index() == 0:
                for note in [*adopted.notes, *([tok_note] if tok_note else [])]:
                    print(f"jax3d: --load {args.load}: {note}", file=sys.stderr)
    # The tokenizer fixes the vocabulary, so it comes before the plan; the datasets come after it. The type
    # Megatron's scripts leave to their trainer's default is set here, so the checkpoint records it.
    cfg = with_default_tokenizer(cfg)
    tok, paths = tokenizer_and_paths(cfg)
    cfg = with_eod_token(cfg, tok)
    if args.load:
        from jax3d.checkpoint.tokenizer import check_same_tokenizer
        check_same_tokenizer(args.load, args.ckpt_step, tok)
    plan = resolve(cfg, jax.device_count(), tok.vocab_size, checkpoint=args.load or "",
                   from_checkpoint=from_checkpoint)
    cfg, mesh_cfg = plan.cfg, plan.mesh
    from jax3d.cli.megatron import after_plan, header_notes
    cfg = after_plan(args, cfg, mesh_cfg.data)  # counts in samples and tokens, on the final batch and sequence
    if jax.process_index() == 0:
        print(header(plan, build_model(cfg.model).num_params()), file=sys.stderr)
        for note in header_notes(args, cfg):
            print(note, file=sys.stderr)
        if note := PrecisionPolicy.of(cfg.precision).autotuning_note:
            print(note, file=sys.stderr)
        if cfg.parallel.sequence_parallel and mesh_cfg.model == 1:
            print("jax3d: --sequence-parallel shards activations over tensor parallelism, which is 1 here, so it "
                  "changes nothing", file=sys.stderr)
        if args.pipeline_schedule and mesh_cfg.stage == 1:
            print(f"jax3d: --pipeline-schedule {args.pipeline_schedule} orders a pipeline's passes, and "
                  "--pipeline-model-parallel-size is 1 here, so it changes nothing", file=sys.stderr)
    if args.dry_run:
        from jax3d.train.dry_run import dry_run
        print(json.dumps(dry_run(cfg, mesh_cfg, mesh_cfg.build())))
        return 0
    tr = cfg.train
    n_train = tr.train_iters * tr.global_batch_size
    # Every evaluation reads the same first eval_iters batches of the validation split, so the curve
    # compares like with like.
    n_valid = tr.eval_iters * tr.global_batch_size if tr.eval_interval else 0
    inputs = build_inputs(cfg, n_train, n_valid, tok, paths)
    mesh = mesh_cfg.build()
    checkpointer = None
    if tr.save or tr.load:
        from jax3d.checkpoint.checkpointer import Checkpointer
        checkpointer = Checkpointer(cfg, tokenizer=inputs.tokenizer, checked=checked)
        checkpointer.install_signal_handlers()
    from jax3d.checkpoint.checkpointer import TrainingInterrupted
    from jax3d.train.loop import train
    from jax3d.train.skipped import SkippedStepsStop
    try:
        last = train(cfg, mesh_cfg, mesh, inputs, progress=not args.no_progress, checkpointer=checkpointer,
                     memory_check=not args.no_memory_check)
    except TrainingInterrupted as e:
        print(f"jax3d: {e}", file=sys.stderr)
        return e.exit_code  # 143 for SIGTERM, 130 for SIGINT
    except SkippedStepsStop as e:
        if jax.process_index() == 0:
            kept = checkpointer.newest() if checkpointer is not None and tr.save else None
            print(f"jax3d: {e}" + (f", keeping the checkpoints in {tr.save} (the newest is step {kept})" if kept
                                   is not None else " (no checkpoint was saved)" if tr.save else "")
                  + "; lower --lr, or set --clip-grad, and resume from a checkpoint of before the trouble",
                  file=sys.stderr)
        return e.exit_code
    finally:
        if checkpointer is not None:
            checkpointer.uninstall_signal_handlers()
    if jax.process_index() == 0 and last:
        print(json.dumps({k: last[k] for k in ("step", "loss", "val_loss", "tokens_per_s", "mfu") if k in last}))
        if not tr.save:  # generate, evaluate and export all start from a checkpoint
            print("jax3d: no --save was given, so the trained model was not kept; add --save DIR to keep it",
                  file=sys.stderr)
    return 0
