"""Inference on trained models: text generation with a KV cache (`generate`)."""
from jax3d.inference.generate import Generator, Sampling, greedy_without_cache, pick

__all__ = ["Generator", "Sampling", "greedy_without_cache", "pick"]
