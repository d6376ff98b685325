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


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _preallocated(stats: dict, env=os.environ) -> bool:
    """Whether XLA claimed its whole pool when it started (JAX's default on GPUs), so that `largest_free_block_bytes`
    describes the memory the run will ever have."""
    if env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").strip().lower() in ("false", "0"):
        return False
    return bool(stats.get("pool_bytes")) and "largest_free_block_bytes" in stats


def allocator_offer(device, env=os.environ) -> tuple[int, str] | None:
    """(bytes one more buffer can have on `device`, how that was read), or None where the allocator keeps no
    statistics (XLA_PYTHON_CLIENT_ALLOCATOR=platform, or a CPU).

    With the pool claimed at start, a buffer must fit in one free block of it: the step's temporaries are a single
    buffer (52.8 GiB of the 1.3B shape at micro-batch 16), and the pool may be smaller than `bytes_limit` says
    when the claim had to back off on a card whose memory something else holds. Growing pools get up to
    `bytes_limit` less what is in use.
    """
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    if _preallocated(stats, env):
        return int(stats["largest_free_block_bytes"]), "its allocator's largest free block"
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), "its allocator's limit less what is in use"


def device_capacity(env=os.environ) -> int | None:
    """Bytes a fresh run's step can have on one local device: on an accelerator, the pool XLA claims (its
    `pool_bytes` when claimed at start, else `bytes_limit`); on emulated CPU devices, which share this process's
    host memory, their share of what the host has free. None where nothing says. Advice for the next run is
    measured against this, not against what a failed run still holds."""
    devices = jax.local_devices()
    if devices[0].platform == "cpu":
        have = host_available_bytes()
        return None if have is None else have // len(devices)
    stats = devices[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["pool_bytes"]) if _preallocated(stats, env) else int(stats["bytes_limit"])


def temporaries_bytes(compiled) -> int:
    """What a compiled program allocates when it runs, beyond its (donated) arguments: temporaries and outputs
    that do not reuse an argument's buffer."""
    mem = compiled.memory_analysis()
    return int(mem.temp_size_in_bytes) + int(mem.output_size_in_bytes) - int(mem.alias_size_in_bytes)


def largest_fitting(candidates, peak_at, have: int) -> tuple[int, int] | None:
    """(the largest of `candidates` whose `peak_at(c)` is at most `have`, that peak), or None.

    `peak_at` compiles, so it is called as little as possible: a peak falls with the micro-batch, so the candidates
    are tried from the largest down and the first that fits ends the search.
    """
    for c in sorted(candidates, reverse=True):
        peak = peak_at(c)
        if peak <= have:
            return c, peak
    return None


def fit_hint(fitting) -> str:
    """How a guard's fixes start: with the smaller micro-batch that fits, `(micro-batch, peak)` from
    `largest_fitting`, where there is one."""
    if fitting is None:
        return "use "
    micro, peak = fitting
    return (f"--micro-batch-size {micro} fits ({_gib(peak)} per device: the same global batch in more "
            "micro-batches); otherwise use ")


class DeviceOutOfMemory(ConfigError):
    """A step that cannot fit the device memory (before it runs, or when it ran out): one sentence, exit 2."""


def check_fits(compiled, what: str = "the train step", fixes: str = _FIXES, smaller=None) -> None:
    """Raises DeviceOutOfMemory when `compiled` needs more memory than the local devices have.

    Runs before anything is allocated. On a GPU the whole peak must fit in what the allocator can give one buffer.
    `smaller(have)`, when given, returns `largest_fitting`'s answer for the run at smaller micro-batches, to name
    the one that fits.
    """
    peak = step_peak_bytes(compiled)
    devices = jax.local_devices()
    hint = lambda have: fit_hint(smaller(have) if smaller is not None else None)  # noqa: E731
    if devices[0].platform == "cpu":
        # Emulated CPU devices all live in this process's host memory.
        have, need = host_available_bytes(), peak * len(devices)
        if have is not None and need > have:
            raise DeviceOutOfMemory(
                f"{what} needs {_gib(peak)} per device x {len(devices)} emulated devices = "
                f"{_gib(need)}, but this host has {_gib(have)} free; {hint(have // len(devices))}{fixes}, "
                f"or pass --no-memory-check")
        return
    offer = allocator_offer(devices[0])
    if offer is not None and peak > offer[0]:
        have, how = offer
        raise DeviceOutOfMemory(
            f"{what} needs {_gib(peak)} per device, but each {devices[0].device_kind} can give it {_gib(have)} "
            f"({how}, {_fraction_note()}); {hint(have)}{fixes}, or pass --no-memory-check")


def check_placed(compiled, what: str = "the train step") -> None:
    """Once the state is on the devices, and before the first step: raises DeviceOutOfMemory when the step's
    temporaries no longer fit in one free block (a restored state can land in another order than a fresh one)."""
    device = jax.local_devices()[0]
    offer = allocator_offer(device) if device.platform != "cpu" else None
    need = temporaries_bytes(compiled)
    if offer is not None and need > offer[0]:
        raise DeviceOutOfMemory(
            f"{what} needs {_gib(need)} of temporaries in one block beside its state, but each {device.device_kind} "
            f"has {_gib(offer[0])} left ({offer[1]}, {_fraction_note()}); use {_FIXES}, or pass --no-memory-check")


def _fraction_note(env=os.environ) -> str:
    fraction = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    return (f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction} of the card" if fraction else "JAX's default share of the card")


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is XLA failing to allocate device memory."""
    return isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e)


def ran_out(what: str, peak: int, fitting) -> DeviceOutOfMemory:
    """The sentence for a step that ran out of device memory although the guard let it through (or was told not
    to check): its compiled peak and what would fit."""
    device = jax.local_devices()[0]
    return DeviceOutOfMemory(
        f"{what} ran out of device memory on the {device.device_kind} (the train step's compiled peak is "
        f"{_gib(peak)} per device, "
        f"{_fraction_note()}); checkpoints written before are kept; {fit_hint(fitting)}{_FIXES}")
