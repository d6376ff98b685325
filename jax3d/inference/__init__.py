"""Inference on trained models: text generation with a KV cache (`generate`)."""
from jax3d.inference.generate import (Generator, Sampling, generate_text, generator_for, greedy_without_cache,
                                      load_gpt_checkpoint, pick)

__all__ = ["Generator", "Sampling", "generate_text", "generator_for", "greedy_without_cache", "load_gpt_checkpoint",
           "pick"]
