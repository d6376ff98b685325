"""Captures the arguments Megatron-DeepSpeed's example scripts pass to pretrain_gpt.py / pretrain_bert.py.

Each script runs under bash in a scratch copy of `examples_deepspeed/`, with its launchers (`deepspeed`,
`torchrun`, `python`, ...) and cluster tools (`nvidia-smi`, `ds_ssh`, `ssh`, `wget`, `date`) replaced by shell
functions: a launcher prints its arguments as one JSON list, the others answer with harmless fixed values (8
GPUs on one node, no earlier checkpoint, a fixed date). What the scripts passed, and the DeepSpeed JSON they
wrote, are stored as data beside this file, one JSON file a script:

    python tests/data/megatron_ds_scripts/capture.py /work/.mirror/microsoft+Megatron-DeepSpeed/repo
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

SCRIPTS = (
    "rebase/ds_pretrain_gpt_125M.sh", "rebase/ds_pretrain_gpt_125M_flashattn.sh", "rebase/ds_pretrain_gpt_1.3B.sh",
    "rebase/ds_pretrain_gpt_1.3B_megatron_checkpointing.sh", "rebase/ds_pretrain_gpt_1.3B_rope.sh",
    "rebase/ds_pretrain_gpt_1.3B_rope_slw.sh", "rebase/ds_pretrain_gpt_13B.sh",
    "bert_with_pile/ds_pretrain_bert.sh", "pretrain_llama_distributed.sh", "pretrain_llama2_distributed.sh",
    "zero_bubble_pp/zbh1_pretrain_gpt_1.3b.sh",
    "universal_checkpointing/megatron_gpt/run_bf16.sh", "universal_checkpointing/megatron_gpt/run_fp16.sh",
    "universal_checkpointing/megatron_gpt/run_universal_bf16.sh",
    "universal_checkpointing/megatron_gpt/run_universal_fp16.sh",
    "universal_checkpointing/llama/run_llama_bf16.sh", "universal_checkpointing/llama/run_universal_llama_bf16.sh",
    "MoE/ds_pretrain_gpt_125M_MoE64.sh", "MoE/ds_pretrain_gpt_1.3B_PR-MoE64or128.sh",
    "offload_pp/ds_pretrain_gpt_350M.sh", "sequence_parallel/ds_pretrain_gpt_1.3B_seq_parallel_32k.sh",
)

# The stand-ins. A launcher appends {"cwd", "argv"} to $CAPTURE_LOG as one JSON line.
STUBS = r"""
_capture() { /usr/bin/python3 -c 'import json, os, sys; print(json.dumps({"cwd": os.getcwd(), "argv": sys.argv[1:]}))' "$@" >> "$CAPTURE_LOG"; }
deepspeed() { _capture "$@"; }
torchrun() { _capture "$@"; }
python() { _capture "$@"; }
python3() { _capture "$@"; }
srun() { _capture "$@"; }
nvidia-smi() { for i in 1 2 3 4 5 6 7 8; do echo "NVIDIA H100 80GB HBM3"; done; }
ds_ssh() { echo "host: ssh header"; echo "host: ssh header"; eval "$@"; }
ssh() { return 1; }
wget() { return 0; }
date() { echo "2026.01.01_00.00.00"; }
hostname() { echo host; }
whoami() { echo user; }
export -f _capture deepspeed torchrun python python3 srun nvidia-smi ds_ssh ssh wget date hostname whoami
"""

TRAINERS = ("pretrain_gpt.py", "pretrain_bert.py")


def capture(mirror: str, script: str, commit: str = "HEAD") -> dict:
    """The arguments `examples_deepspeed/<script>` of git dir `mirror` passes to its pretrain_*.py, and the
    DeepSpeed JSON it wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "repo")
        tree = subprocess.run(["git", "-C", mirror, "archive", commit, "examples_deepspeed"], check=True,
                              capture_output=True).stdout
        os.makedirs(root)
        subprocess.run(["tar", "-x", "-C", root], input=tree, check=True)
        where = os.path.join(root, "examples_deepspeed", os.path.dirname(script))
        for folder in ("tmp", "dataset"):  # where the Llama and universal-checkpointing scripts write their JSON
            os.makedirs(os.path.join(where, folder), exist_ok=True)
        log = os.path.join(tmp, "capture.jsonl")
        env = {"PATH": os.environ["PATH"], "HOME": tmp, "HOSTNAME": "host", "USER": "user", "CAPTURE_LOG": log}
        run = subprocess.run(["bash", "-c", STUBS + f'\nbash "{os.path.basename(script)}" </dev/null'], cwd=where,
                             env=env, capture_output=True, text=True)
        calls = [json.loads(line) for line in open(log)] if os.path.exists(log) else []
        launch = [c for c in calls if any(os.path.basename(a) in TRAINERS for a in c["argv"])]
        if len(launch) != 1:
            raise SystemExit(f"{script}: {len(launch)} launches found (exit {run.returncode}): {run.stderr[-2000:]}")
        argv, cwd = launch[0]["argv"], launch[0]["cwd"]
        at = next(i for i, a in enumerate(argv) if os.path.basename(a) in TRAINERS)
        args = [a.replace(root, "<repo>") for a in argv[at + 1:]]
        config = None
        for i, a in enumerate(argv[at + 1:]):
            path = a.split("=", 1)[1] if a.startswith("--deepspeed_config=") else \
                argv[at + 2 + i] if a == "--deepspeed_config" else None
            if path:
                with open(os.path.join(cwd, path)) as f:
                    text = f.read()
                try:
                    config = json.loads(text)
                except json.JSONDecodeError:
                    config = {"unparsed": text}
        return {"script": f"examples_deepspeed/{script}", "commit": commit_of(mirror, commit),
                "trainer": os.path.basename(argv[at]), "args": args, "deepspeed_config": config}


def commit_of(mirror: str, rev: str) -> str:
    return subprocess.run(["git", "-C", mirror, "rev-parse", rev], check=True, capture_output=True,
                          text=True).stdout.strip()


def main(argv) -> int:
    mirror = argv[0]
    out = os.path.dirname(os.path.abspath(__file__))
    for script in SCRIPTS:
        rec = capture(mirror, script)
        name = os.path.basename(script)[:-3] + ".json"
        with open(os.path.join(out, name), "w") as f:
            json.dump(rec, f, indent=1)
            f.write("\n")
        print(f"{name}: {sum(a.startswith('--') for a in rec['args'])} flags", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["/work/.mirror/microsoft+Megatron-DeepSpeed/repo"]))
