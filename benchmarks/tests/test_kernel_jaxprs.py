"""benchmarks/kernel_jaxprs.py: a kernel's fingerprint is stable across calls and moves when the kernel's
maths or block shapes do, so equal fingerprints at two commits mean the same kernel."""
import functools

import jax

from benchmarks import kernel_jaxprs
from jax3d.kernels import fused_gelu


def test_fingerprints_are_stable_and_see_the_kernel():
    small = kernel_jaxprs.cases(tokens=256, d=256, ffn=1024, vocab=512, chunk=64)
    f, args = small["fused_gelu_bwd"]
    base = kernel_jaxprs.fingerprint(f, args)
    assert kernel_jaxprs.fingerprint(f, args) == base
    other_blocks = functools.partial(fused_gelu.gelu_bias, tuning=fused_gelu.Tuning(rows_fwd=8))
    assert kernel_jaxprs.fingerprint(lambda h, b: other_blocks(h, b), args[:2]) != \
        kernel_jaxprs.fingerprint(fused_gelu.gelu_bias, args[:2])
    # One constant of the maths changed. Kernel bodies are traced once per process (each commit is checked
    # in its own), so the caches are cleared around the change, and again once it is undone.
    real_a = fused_gelu._A
    try:
        fused_gelu._A = 0.0447
        jax.clear_caches()
        assert kernel_jaxprs.fingerprint(f, args) != base
    finally:
        fused_gelu._A = real_a
        jax.clear_caches()
    assert kernel_jaxprs.fingerprint(f, args) == base
    assert len({kernel_jaxprs.fingerprint(*c) for c in small.values()}) == len(small)


def test_step_fingerprint_sees_the_kernels_a_gpu_would_take():
    base = kernel_jaxprs.step_fingerprint("tiny")
    assert kernel_jaxprs.step_fingerprint("tiny") == base
    # The tiny step's q, k and v split into the QKV kernel's blocks, so leaving it out changes the step, and
    # so do other block settings for it.
    assert kernel_jaxprs.step_fingerprint("tiny", ("fused_qkv",)) != base
    assert kernel_jaxprs.step_fingerprint("tiny", tunings=(("fused_qkv", "rows=8"),)) != base
