"""Inference on trained models: text generation with a KV cache (`generate`)."""
from jax3d.inference.generate import (Generator, Sampling, generator_for, greedy_without_cache, load_gpt_checkpoint,
                                      pick)
from jax3d.inference.text import generate_text

__all__ = ["Generator", "Sampling", "generate_text", "generator_for", "greedy_without_cache", "load_gpt_checkpoint",
           "pick"]
