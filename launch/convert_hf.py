"""Hugging Face GPT-2 / BERT <-> jax3d checkpoints. `python launch/convert_hf.py {import,export} --help`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # conversion runs on one CPU device; leave accelerators alone

from jax3d.cli.convert_hf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
