"""Test setup: 8 emulated CPU devices, set before JAX starts its backends."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
# The suite compiles hundreds of small programs and runs each a few times: LLVM's optimisations took ~40%
# of its CPU time and buy nothing at these sizes. XLA's own passes still run, so the compiled HLO (fusion,
# sharding, collectives, buffer assignment) and its memory figures are a default build's.
if "xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = flags.strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

# Many tests compile the same small programs (the same layout in several tests, a resumed run's step);
# a persistent cache shared by the session's processes turns the repeats into loads.
import tempfile  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "jax3d-test-compile-cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


# The longest files first. Two workers take whole files (`--dist loadfile`) as they free up, in collection order
# (`--no-loadscope-reorder` in pyproject.toml: xdist would otherwise order files by their count of tests, which put
# these few-but-long ones last, where the one a worker took last ran on after the other worker had finished).
LONGEST_FIRST = ["tests/project/test_readme_commands.py", "benchmarks/tests/test_generate_bench.py", "tests/train/test_layer_order.py",
                 "tests/pipeline/test_pipeline_gpt.py", "tests/checkpoint/test_checkpoint.py", "tests/train/test_llama_layouts.py",
                 "tests/models/test_bert.py", "tests/train/test_fp8.py", "tests/cli/test_cli.py", "tests/cli/test_megatron_scripts.py",
                 "tests/inference/test_generate_cli.py", "tests/hf/test_hf_export.py", "tests/train/test_skipped.py",
                 "benchmarks/tests/test_fp8_bench.py"]


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = str(config.rootpath)
    items.sort(key=lambda item: rank.get(os.path.relpath(str(item.path), root), len(rank)))
