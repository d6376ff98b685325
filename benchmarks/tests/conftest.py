"""The benchmarks' tests share the suite's setup (tests/conftest.py: 8 emulated CPU devices, set before JAX starts
its backends, and the compilation cache)."""
import tests.conftest  # noqa: F401
