"""How much memory a compiled step needs per device, how much the devices have, and the guard between them.

`--dry-run` reports `step_peak_bytes`; the train loop runs `check_fits` on the same figure before the first
step, so a run that cannot fit stops with one sentence instead of being killed by the kernel (CPU) or
failing deep inside XLA (GPU).
"""
from __future__ import annotations

import jax

from jax3d.config import ConfigError

_FIXES = ("more --tensor-model-parallel-size or --pipeline-model-parallel-size, --zero-stage 3, "
          "--recompute full or a smaller --micro-batch-size")


def step_peak_bytes(compiled) -> int:
    """Peak bytes one device holds while the compiled step runs.

    The compiler's own peak is not filled in on every backend; arguments + outputs - aliased (donated)
    + temporaries bounds it everywhere.
    """
    mem = compiled.memory_analysis()
    bound = (int(mem.argument_size_in_bytes) + int(mem.output_size_in_bytes) - int(mem.alias_size_in_bytes)
             + int(mem.temp_size_in_bytes))
    return max(int(getattr(mem, "peak_memory_in_bytes", 0) or 0), bound)


def host_available_bytes() -> int | None:
    """Memory this process can still take on the host: the lower of free RAM and its cgroup's headroom."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        limits.append(int(info["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            cap = f.read().strip()
        if cap != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                limits.append(int(cap) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def check_fits(compiled, what: str = "the train step") -> None:
    """Raises ConfigError when `compiled` needs more memory than the local devices have."""
    peak = step_peak_bytes(compiled)
    devices = jax.local_devices()
    gib = 2**30
    if devices[0].platform == "cpu":
        # Emulated CPU devices all live in this process's host memory.
        have, need = host_available_bytes(), peak * len(devices)
        if have is not None and need > have:
            raise ConfigError(
                f"{what} needs {peak / gib:.1f} GiB per device x {len(devices)} emulated devices = "
                f"{need / gib:.1f} GiB, but this host has {have / gib:.1f} GiB free; use {_FIXES}, "
                f"or pass --no-memory-check")
        return
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    if limit and peak > limit:
        raise ConfigError(f"{what} needs {peak / gib:.1f} GiB per device, but each {devices[0].device_kind} "
                          f"offers {limit / gib:.1f} GiB; use {_FIXES}, or pass --no-memory-check")

