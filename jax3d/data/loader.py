"""Global batches as sharded `jax.Array`s, read per host and prefetched in a background thread.

Step k serves samples `consumed + j`, j < global_batch (modulo len(dataset)), laid out as
`[accum_steps, global_batch // accum_steps, ...]`: micro-batch a holds samples
a*micro .. (a+1)*micro - 1. The micro-batch dim is split over the mesh axis `data`.
"""
from __future__ import annotations

import queue
import threading

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jax3d.data.indexed import DataError
from jax3d.parallel.mesh import DATA



class BatchLoader:
    """Iterator of dicts of sharded `jax.Array`s `[accum_steps, micro, ...]`, resumable to the sample.

    Pass `mesh` (with a `data` axis) or an explicit `sharding` for the leading two dims. Each process
    reads only the rows its addressable shards hold, and a row shared by several local devices
    (replicated over `stage`/`model`) is read once.
    """

    def __init__(self, dataset, global_batch_size: int, accum_steps: int = 1, mesh=None, *,
                 sharding: NamedSharding | None = None, start_sample: int = 0, prefetch: int = 2,
                 data_axis: str = DATA):
        if global_batch_size % accum_steps:
            raise DataError(f"--global-batch-size {global_batch_size} is not divisible by the "
                            f"{accum_steps} gradient accumulation steps.")
        if len(dataset) == 0:
            raise DataError("the dataset is empty; there is nothing to load.")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.accum_steps = accum_steps
        self.micro = global_batch_size // accum_steps
        if sharding is None:
            if mesh is None:
                raise DataError("BatchLoader needs a mesh or a sharding.")
            data_size = mesh.shape[data_axis]
            if self.micro % data_size:
                raise DataError(f"the micro-batch of {self.micro} samples (global batch "
                                f"{global_batch_size} / {accum_steps} accumulation steps) is not "
                                f"divisible by the {data_size}-way data-parallel axis.")
            sharding = NamedSharding(mesh, PartitionSpec(None, data_axis))
        self.sharding = sharding
        self.consumed_samples = int(start_sample)
        self._example = dataset[0]
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="jax3d-batch-loader", daemon=True)
        self._thread.start()

    # -- reading -------------------------------------------------------------------------------

    def _index(self, first_sample: int, a: int, m: int) -> int:
        return (first_sample + a * self.micro + m) % len(self.dataset)

    def numpy_batch(self, first_sample: int) -> dict[str, np.ndarray]:
        """The whole global batch starting at absolute sample `first_sample`, on the host (a reference
        for tests, and for single-process debugging)."""
        rows = [self.dataset[(first_sample + j) % len(self.dataset)]
                for j in range(self.global_batch_size)]
        return {k: np.stack([r[k] for r in rows]).reshape(self.accum_steps, self.micro,
                                                            *np.shape(rows[0][k]))
                for k in self._example}

    def _device_batch(self, first_sample: int) -> dict[str, jax.Array]:
        rows: dict[tuple[int, int], dict] = {}  # this host's rows for this step, read once

        def row(a, m):
            if (a, m) not in rows:
                rows[a, m] = self.dataset[self._index(first_sample, a, m)]
            return rows[a, m]

        out = {}
        for key, ex in self._example.items():
            ex = np.asarray(ex)
            shape = (self.accum_steps, self.micro) + ex.shape

            def cb(index, key=key, ex=ex):
                a_range = range(*index[0].indices(self.accum_steps))
                m_range = range(*index[1].indices(self.micro))
                block = np.empty((len(a_range), len(m_range)) + ex.shape, ex.dtype)
                for i, a in enumerate(a_range):
                    for j, m in enumerate(m_range):
                        block[i, j] = row(a, m)[key]
                return block[(slice(None), slice(None)) + tuple(index[2:])]

            out[key] = jax.make_array_from_callback(shape, self.sharding, cb)
        return out

    # -- prefetch thread -----------------------------------------------------------------------

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self):
        first = self.consumed_samples
        try:
            while not self._stop.is_set():
                if not self._put((first, self._device_batch(first))):
                    return
                first += self.global_batch_size
        except BaseException as e:  # handed to the consumer, which re-raises it
            self._put(e)

    # -- iteration -----------------------------------------------------------------------------

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self._stop.is_set():
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the batch loader thread stopped without a batch or an "
                                       "error.") from None
        if isinstance(item, BaseException):
            self.close()
            raise item
        first, batch = item
        self.consumed_samples = first + self.global_batch_size
        return batch

    def state_dict(self) -> dict:
        """Where to resume: pass `consumed_samples` back as `start_sample`."""
        return {"consumed_samples": self.consumed_samples}

    def close(self) -> None:
        """Stop the prefetch thread and drop queued batches; safe to call twice."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self._stop.set()
        except AttributeError:
            pass
