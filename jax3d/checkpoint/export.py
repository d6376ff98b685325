"""Export a training checkpoint's parameters as one unsharded fp32 tree that a single device can load.

The parameters are restored onto one CPU device (never the optimizer state), whatever layout the run
was trained on, and written as

- `safetensors`: one file; tensor names are the parameter paths joined by dots
  (`blocks.attn.qkv_kernel`), with the transformer blocks stacked on a leading layers dim as jax3d keeps
  them, or split per layer (`blocks.0.attn.qkv_kernel`) with `split_layers`. The file's metadata holds
  the model config, tokenizer and provenance as JSON strings;
- `orbax`: a directory with `params/` (an orbax StandardCheckpointer tree) and `jax3d.json`.

`docs/checkpoints.md` describes both.
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np

from jax3d.file_util import dir_problem
from jax3d.config import ConfigError, config_from_dict
from jax3d.file_util import readable_by_all
from jax3d.checkpoint.read import check_outside_checkpoint, restore_arrays, saved_step_meta

FORMATS = ("safetensors", "orbax")


def abstract_params(model_cfg):
    """Global shapes of the parameter tree of `model_cfg` (no arrays are created)."""
    from jax3d.models import build_model

    return jax.eval_shape(build_model(model_cfg).init, jax.random.key(0))  # shapes: no mesh, no sharding rules


def load_params(load_dir: str, step: int = -1, device=None):
    """(params as numpy fp32 arrays, checkpoint metadata) of `step` (default: latest) in `load_dir`."""
    step, meta = saved_step_meta(load_dir, step)
    cfg = config_from_dict(meta["config"])
    device = device or jax.devices("cpu")[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, np.float32, sharding=sharding),
                          abstract_params(cfg.model))
    params = restore_arrays(load_dir, step, {"params": target}).params
    return jax.tree.map(np.asarray, params), meta


def flat_names(params, split_layers: bool = False) -> dict[str, np.ndarray]:
    """{dotted name: array}; with `split_layers` the stacked `blocks` become `blocks.<i>.*`, one per layer."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        if split_layers and keys[0] == "blocks":
            for i in range(leaf.shape[0]):
                out[".".join([keys[0], str(i), *keys[1:]])] = np.ascontiguousarray(leaf[i])
        else:
            out[".".join(keys)] = np.ascontiguousarray(leaf)
    return out


def unflatten(flat: dict[str, np.ndarray]) -> dict:
    """Inverse of `flat_names` for either naming: the nested tree jax3d's model takes."""
    tree, layers = {}, {}
    for name, arr in flat.items():
        keys = name.split(".")
        if keys[0] == "blocks" and keys[1].isdigit():
            layers.setdefault(".".join(["blocks", *keys[2:]]), {})[int(keys[1])] = arr
        else:
            _set(tree, name, arr)
    for name, per_layer in layers.items():
        _set(tree, name, np.stack([per_layer[i] for i in range(len(per_layer))]))
    return tree


def _set(tree: dict, dotted: str, value) -> None:
    """tree[a][b][c] = value for dotted name "a.b.c", creating the dicts on the way."""
    *parents, leaf = dotted.split(".")
    for k in parents:
        tree = tree.setdefault(k, {})
    tree[leaf] = value


def export(load_dir: str, output: str, *, step: int = -1, fmt: str = "safetensors",
           split_layers: bool = False) -> dict:
    """Writes the parameters of checkpoint `step` of `load_dir` to `output`; returns a summary."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt} is not supported; choose one of {', '.join(FORMATS)}")
    if split_layers and fmt != "safetensors":
        raise ConfigError(f"--split-layers is for safetensors and --format {fmt} keeps the stacked layers; "
                          "drop one of them")
    if not output:
        raise ConfigError("--output is empty; pass a .safetensors path, or a new directory for --format orbax")
    if os.path.exists(output):  # checked before the parameters are read; an export replaces nothing
        raise ConfigError(f"--output {output} already exists; pass a new path")
    problem = dir_problem(os.path.dirname(os.path.abspath(output)))
    if problem:
        raise ConfigError(f"--output {output}: its folder {problem}; pass another path")
    check_outside_checkpoint("--output", output)
    params, meta = load_params(load_dir, step)
    info = {"format": "jax3d-params", "jax3d_version": meta["jax3d_version"], "step": meta["step"],
            "source": os.path.abspath(load_dir), "layers_stacked": not split_layers,
            "model": meta["config"]["model"], "tokenizer": meta.get("tokenizer", {})}
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    if fmt == "safetensors":
        save_safetensors(flat_names(params, split_layers), output, {k: json.dumps(v) for k, v in info.items()})
    else:
        import orbax.checkpoint as ocp

        os.makedirs(output)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(os.path.abspath(output), "params"), params)
        with open(os.path.join(output, "jax3d.json"), "w") as f:
            json.dump(info, f, indent=1)
    n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    return {"output": output, "format": fmt, "step": meta["step"], "parameters": n, "bytes": 4 * n}


def save_safetensors(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str]) -> None:
    """safetensors' `save_file`, leaving the file readable like any other the export writes (`save_file`
    leaves a temporary file's 0600)."""
    from safetensors.numpy import save_file

    save_file(tensors, path, metadata=metadata)
    readable_by_all(path)


def read_safetensors(path: str) -> tuple[dict, dict]:
    """(nested params tree, metadata with JSON values decoded) of a safetensors export."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    with safe_open(path, framework="numpy") as f:
        meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
    return unflatten(load_file(path)), meta
