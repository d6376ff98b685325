"""Export a checkpoint's parameters for one device. `python launch/export.py --help` lists the flags."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # export restores onto one CPU device; leave accelerators alone

from jax3d.cli.export import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
