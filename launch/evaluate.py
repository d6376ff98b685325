"""Loss and perplexity of a checkpoint over a data set. `python launch/evaluate.py --help` lists the flags."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax3d.cli.evaluate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
