"""jax3d's benchmarks, run from the checkout's root as `python -m benchmarks.NAME ...` (the checkout's own
jax3d then comes first on the path), or as `python benchmarks/NAME.py ...` with the root on PYTHONPATH.
What they share is `benchmarks.harness`."""
