"""jax3d's Pallas (Triton) kernels, the only place that writes a pallas_call. Each kernel is a module of this
package with its `Tuning` (block shapes and warps), its `DEFAULT` and its `supported` test, and a plain JAX
function it stands in for; `pallas_gpu` holds what they share. Model code calls a kernel where `supported`
says it runs, and its plain JAX function elsewhere."""
import importlib

# The kernels by module name: the train step's, and generation's.
KERNELS = ("fused_gelu", "fused_norm", "fused_qkv", "fused_xent", "fp8_cast")
DECODE_KERNELS = ("decode_attention", "row_gemv")


def module(name: str):
    """The kernel module that `name` (one of KERNELS or DECODE_KERNELS) names."""
    if name not in KERNELS + DECODE_KERNELS:
        raise ValueError(f"no kernel {name!r}; choose from {', '.join(KERNELS + DECODE_KERNELS)}")
    return importlib.import_module(f"{__name__}.{name}")
