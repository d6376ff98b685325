"""Which Pallas kernels a run uses, with which settings, and which attention implementation: decided once, by
the plan, and handed to the model, which picks its parts from it (jax3d.models.spec).

The kernels are not partitioned over a mesh, so they run where the step runs on one GPU; elsewhere every layer
runs its plain JAX function. Benchmarks ask for other settings, or leave a kernel out to measure it, by resolving
another policy (`KernelPolicy.resolve(..., tunings=..., off=...)`), never by a context or a patch.
"""
from __future__ import annotations

from dataclasses import dataclass

from jax3d.kernels import DECODE_KERNELS, KERNELS, kernel


def kernel_of(tuning) -> str:
    """The kernel's name ("fused_gelu") that a Tuning belongs to."""
    return type(tuning).__module__.rsplit(".", 1)[-1]


def unknown_kernels(names) -> list[str]:
    """Those of `names` that are no kernel of jax3d's (KERNELS, DECODE_KERNELS), sorted."""
    return sorted(set(names) - set(KERNELS + DECODE_KERNELS))


@dataclass(frozen=True)
class KernelPolicy:
    """The kernels that run, each with its Tuning; the platform the run traces for; and the attention
    implementation where the model's config leaves it to the run (`ModelConfig.attention_impl` "auto"):
    "cudnn" (cuDNN's fused attention for 16-bit inputs, XLA's for others) or "xla". Hashable, so Flax modules
    can hold it as a field."""

    tunings: tuple[tuple[str, object], ...] = ()
    platform: str = "cpu"
    attention: str = "xla"

    @classmethod
    def resolve(cls, platform: str, num_devices: int, *, tunings=(), off=()) -> "KernelPolicy":
        """The policy of a run on `num_devices` devices of `platform` ("cpu", "gpu", ...): every kernel at its
        DEFAULT on one GPU, none elsewhere; cuDNN's attention on GPUs; `tunings` replace defaults, `off` names
        kernels left out. Raises ValueError naming an unknown kernel."""
        unknown = unknown_kernels(list(off) + [kernel_of(t) for t in tunings])
        if unknown:
            raise ValueError(f"no kernel {', '.join(unknown)}; choose from {', '.join(KERNELS + DECODE_KERNELS)}")
        attention = "cudnn" if platform == "gpu" else "xla"
        if platform != "gpu" or num_devices != 1:
            return cls((), platform, attention)
        chosen = {name: kernel(name).DEFAULT for name in KERNELS + DECODE_KERNELS}
        chosen.update({kernel_of(t): t for t in tunings})
        for name in off:
            chosen.pop(name, None)
        return cls(tuple(sorted(chosen.items())), platform, attention)

    @classmethod
    def none(cls, platform: str | None = None) -> "KernelPolicy":
        """No kernel: every layer's plain JAX function, with the attention of `platform` (default: JAX's default
        backend's, for a model built without a plan)."""
        if platform is None:
            import jax
            platform = jax.default_backend()
        return cls((), platform, "cudnn" if platform == "gpu" else "xla")

    def tuning(self, name: str):
        """The Tuning kernel `name` runs with, or None where it does not run."""
        return dict(self.tunings).get(name)

    def uses(self, name: str) -> bool:
        return self.tuning(name) is not None

    def takes(self, name: str, *args) -> bool:
        """Whether kernel `name` runs and takes these arguments (its registered `supported` test)."""
        tuning = self.tuning(name)
        return tuning is not None and kernel(name).supported(*args, tuning)
