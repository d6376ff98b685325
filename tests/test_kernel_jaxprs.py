"""benchmarks/kernel_jaxprs.py: a kernel's fingerprint is stable across calls and moves when the kernel's
maths or block shapes do, so equal fingerprints at two commits mean the same kernel."""
import functools

from benchmarks import kernel_jaxprs
from jax3d.models import fused_gelu


def test_fingerprints_are_stable_and_see_the_kernel(monkeypatch):
    small = kernel_jaxprs.cases(tokens=256, d=256, ffn=1024, vocab=512, chunk=64)
    f, args = small["fused_gelu_bwd"]
    base = kernel_jaxprs.fingerprint(f, args)
    assert kernel_jaxprs.fingerprint(f, args) == base
    other_blocks = functools.partial(fused_gelu.gelu_bias, tuning=fused_gelu.Tuning(rows_fwd=8))
    assert kernel_jaxprs.fingerprint(lambda h, b: other_blocks(h, b), args[:2]) != \
        kernel_jaxprs.fingerprint(fused_gelu.gelu_bias, args[:2])
    monkeypatch.setattr(fused_gelu, "_A", 0.0447)  # one constant of the maths
    assert kernel_jaxprs.fingerprint(f, args) != base
    assert len({kernel_jaxprs.fingerprint(*c) for c in small.values()}) == len(small)
