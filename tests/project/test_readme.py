"""The README's library example runs exactly as printed, in a fresh process."""
import os
import re
import subprocess
import sys

from tests.helpers import ROOT, subprocess_env


def _python_blocks():
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_readme_library_example_runs(tmp_path):
    blocks = _python_blocks()
    assert len(blocks) == 1
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    env = subprocess_env(drop=("XLA_FLAGS", "JAX_PLATFORMS"))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(line.split()[1]) for line in out.stdout.strip().splitlines()]
    assert len(losses) == 5 and losses[-1] < losses[0]


def test_readme_quick_start_has_two_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    quick = text.split("## Quick start")[1].split("##")[0]
    commands = [l.strip() for l in quick.splitlines() if l.startswith("    ") and l.strip()]
    assert commands == ["pip install . && python launch/train.py",
                        "pip install '.[test]' && python -m pytest"]
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert commands[1] in ci
