"""How much memory a compiled step needs per device, how much the devices have, and the guard between them.

`--dry-run` reports `step_peak_bytes`; the train loop runs `check_fits` on the same figure before the first
step, so a run that cannot fit stops with one sentence instead of being killed by the kernel (CPU) or
failing deep inside XLA (GPU).
"""
from __future__ import annotations

import os

import jax

from jax3d.config import ConfigError

_FIXES = ("more --tensor-model-parallel-size or --pipeline-model-parallel-size, --zero-stage 3, "
          "--recompute full or a smaller --micro-batch-size")
# What shrinks the state itself, for the copy that checkpoints make of it.
STATE_FIXES = "more --tensor-model-parallel-size or --zero-stage 3"


def step_peak_bytes(compiled) -> int:
    """Peak bytes one device holds while the compiled step runs.

    The compiler's own peak is not filled in on every backend; arguments + outputs - aliased (donated)
    + temporaries bounds it everywhere.
    """
    mem = compiled.memory_analysis()
    bound = (int(mem.argument_size_in_bytes) + int(mem.output_size_in_bytes) - int(mem.alias_size_in_bytes)
             + int(mem.temp_size_in_bytes))
    return max(int(getattr(mem, "peak_memory_in_bytes", 0) or 0), bound)


# cgroup v1 writes "no limit" as 2**63 - 1 rounded down to a page.
_NO_LIMIT = 2**60
# (mount under /sys/fs/cgroup, limit file, usage file, memory.stat keys for reclaimable page cache, first found)
_CGROUP_FILES = {
    "v2": ("", "memory.max", "memory.current", ("inactive_file",)),
    "v1": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "inactive_file")),
}


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2) is no limit


def _stat(path: str, keys) -> int:
    try:
        with open(path) as f:
            stat = dict(line.split() for line in f if len(line.split()) == 2)
    except OSError:
        return 0
    return next((int(stat[k]) for k in keys if k in stat), 0)


def _own_cgroups(root: str) -> dict:
    """This process's cgroup path per hierarchy, from /proc/self/cgroup: {"v2": "/a/b", "v1": "/c"}."""
    paths = {}
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    return paths


def cgroup_headroom(root: str = "/") -> int | None:
    """Bytes this process's memory cgroup (or an ancestor of it) can still grant, or None without a limit.

    Headroom is limit - (usage - inactive page cache): the kernel reclaims inactive file pages before it
    kills anything, so they count as free. Every level from the process's own cgroup up to the mount root
    is read, since a parent's limit binds too; a path missing from the mount (a container that sees its
    cgroup as the root) falls back to the levels that exist.
    """
    headrooms = []
    for version, path in _own_cgroups(root).items():
        mount, limit_file, usage_file, cache_keys = _CGROUP_FILES[version]
        base = os.path.join(root, "sys/fs/cgroup", mount)
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            d = os.path.join(base, *parts[:depth])
            limit, usage = _read_int(os.path.join(d, limit_file)), _read_int(os.path.join(d, usage_file))
            if limit is None or usage is None or limit >= _NO_LIMIT:
                continue
            headrooms.append(limit - (usage - _stat(os.path.join(d, "memory.stat"), cache_keys)))
    return min(headrooms) if headrooms else None


def host_available_bytes(*, root: str = "/") -> int | None:
    """Memory this process can still take on the host: the lower of MemAvailable and its cgroup's headroom.

    `root` is where /proc and /sys are found (tests point it at fake files).
    """
    limits = []
    try:
        with open(os.path.join(root, "proc/meminfo")) as f:
            info = dict(line.split(":", 1) for line in f if ":" in line)
        limits.append(int(info["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    cgroup = cgroup_headroom(root)
    if cgroup is not None:
        limits.append(cgroup)
    return min(limits) if limits else None


def check_fits(compiled, what: str = "the train step", fixes: str = _FIXES) -> None:
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
                f"{need / gib:.1f} GiB, but this host has {have / gib:.1f} GiB free; use {fixes}, "
                f"or pass --no-memory-check")
        return
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    if limit and peak > limit:
        raise ConfigError(f"{what} needs {peak / gib:.1f} GiB per device, but each {devices[0].device_kind} "
                          f"offers {limit / gib:.1f} GiB; use {fixes}, or pass --no-memory-check")

