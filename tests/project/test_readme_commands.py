"""Every shell command in the README runs, in README order, in a fresh folder: the README cannot drift.

The folder starts with what a user brings (a `corpus.jsonl`, GPT-2-style `vocab.json` / `merges.txt`,
Hugging Face `gpt2/` and `llama/` folders, a `notes.txt`, a `prompts.jsonl`), made tiny here. Commands run as written, except that long
training gets `--train-iters 2`, and the GPU-only ones run the same flags on tiny shapes: the 1.3B
command as a `--dry-run` of two layers, the benchmarks on their `tiny` shape without the peer. Each
throughput run compiles its own step in its own process, so two benchmark commands are cut to what they
add: `--ablate all` (a run per Pallas kernel, each with that one left out) runs as `--ablate together` (one run
with every one left out; the tests/test_fused_*.py files check each alone), and the plain throughput command,
whose one run at the tiny shape is the first run of the ablation command, is not run twice.
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT, subprocess_env

FAST = ["--train-iters", "2", "--eval-interval", "0", "--no-progress"]


def readme_commands() -> list[str]:
    """Indented shell commands (`pip ...` / `python ...`), continuation lines joined, comments dropped."""
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
    commands, current = [], None
    for line in lines:
        if current is not None:
            current += " " + line.strip()
        elif line.startswith("    ") and line.strip().startswith(("python ", "pip ")):
            current = line.strip()
        else:
            continue
        if current.endswith("\\"):
            current = current[:-1].rstrip()
            continue
        commands.append(re.sub(r"\s+#.*$", "", current))
        current = None
    return commands


def adapt(command: str) -> list[str] | None:
    """The argv the test runs for one README command (None: not run here)."""
    if command.startswith("pip install '.[test]'"):
        return None  # the test suite itself
    if command.startswith("pip install ."):
        command = command.split("&&", 1)[1].strip()
    argv = shlex.split(command)
    assert argv[0] == "python", command
    argv[0] = sys.executable
    script = _script(command)
    if script == "launch/train.py" and "--dry-run" not in argv:
        if "--bf16" in argv:  # the GPU command: the same flags, compiled for two layers on the CPU
            return argv + ["--dry-run", "--num-layers", "2"]
        return argv + FAST
    if script == "benchmarks/throughput.py" and "--ablate" not in argv:
        return None  # its run is the ablation command's first
    if script.startswith("benchmarks/"):
        argv = ["together" if a == "all" and argv[i - 1] == "--ablate" else a
                for i, a in enumerate(argv) if a != "--peer"]
        i = argv.index("--shape")
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        argv[i:j] = ["--shape", "tiny"]
        return argv + (["--dtype", "float32"] if script.endswith("throughput.py") else []) + ["--steps", "1"]
    return argv


def _script(command: str) -> str:
    """The file a README command runs: `python X.py ...` or `python -m a.b ...` (as a/b.py)."""
    argv = shlex.split(command)
    return argv[2].replace(".", "/") + ".py" if argv[1] == "-m" else argv[1]


def _user_files(tmp):
    """What the README assumes a user has: made tiny."""
    from jax3d.data.tokenizers import train_tokenizer
    from tests.hf_fixtures import tiny_gpt2

    sources = [os.path.join(os.path.dirname(os.__file__), f) for f in ("abc.py", "bisect.py", "heapq.py", "types.py")]
    texts = [open(p).read() for p in sources]
    with open(tmp / "corpus.jsonl", "w") as f:
        for t in texts:
            for chunk in t.split("\n\n"):
                if chunk.strip():
                    f.write(json.dumps({"text": chunk}) + "\n")
    (tmp / "notes.txt").write_text(texts[0][:4000])
    (tmp / "prompts.jsonl").write_text('{"prompt": "def fibonacci(n):"}\n{"prompt": "import os", "max_new_tokens": 8}\n')
    train_tokenizer([], str(tmp), "bpe", vocab_size=512, min_frequency=1, texts=iter(texts))
    (tmp / "gpt2").mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(tmp / name, tmp / "gpt2" / name)
    from jax3d.data.tokenizers import build_tokenizer
    vocab = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp / "vocab.json"),
                            merge_file=str(tmp / "merges.txt")).vocab_size
    tiny_gpt2(str(tmp / "gpt2"), n_layer=2, n_embd=32, n_head=4, vocab=vocab, n_positions=512)
    from tests.hf_fixtures import llama_folder_with_tokenizer
    llama_folder_with_tokenizer(tmp / "llama", n_layer=2, positions=512)


def test_readme_commands_are_all_covered():
    commands = readme_commands()
    assert any(c.startswith("python launch/convert_hf.py import") for c in commands)
    assert all(adapt(c) is None or adapt(c)[0] == sys.executable for c in commands)
    skipped = [c for c in commands if adapt(c) is None]
    assert [_script(c) for c in skipped] == ["install", "benchmarks/throughput.py"], skipped
    ablation = [adapt(c) for c in commands if "--ablate" in c]
    assert len(ablation) == 1 and ablation[0][-6:] == ["--ablate", "together", "--dtype", "float32", "--steps", "1"]


def test_readme_gpu_command_needs_no_file_a_later_command_makes():
    """The GPU training command comes before the data section, so it reads only the bundled corpus."""
    commands = readme_commands()
    gpu = next(i for i, c in enumerate(commands) if "--bf16" in c and c.startswith("python launch/train.py"))
    made_later = {c.split("--output-prefix ")[1].split()[0] for c in commands[gpu:] if "--output-prefix" in c}
    assert made_later and not any(prefix in commands[gpu] for prefix in made_later)


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path):
    _user_files(tmp_path)
    for name in ("launch", "benchmarks"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = subprocess_env(drop=("XLA_FLAGS", "JAX_PLATFORMS"))
    env["JAX_PLATFORMS"] = "cpu"
    for command in readme_commands():
        argv = adapt(command)
        if argv is None:
            continue
        out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900)
        assert out.returncode == 0, f"{command}\n{out.stderr[-2000:]}"
        assert "Traceback" not in out.stderr, command
