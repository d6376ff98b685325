"""jax3d: GPT and BERT training with 3D parallelism on one named device mesh."""
__version__ = "0.1.0"
