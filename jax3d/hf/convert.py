"""Hugging Face model folders <-> jax3d checkpoints.

Import reads `config.json` plus `model.safetensors` (or shards listed in `model.safetensors.index.json`)
and writes a jax3d checkpoint (step 0, fresh optimizer state) that `launch/train.py --load` fine-tunes on
any layout; tokenizer files come along under `<checkpoint>/tokenizer/`. Export restores a checkpoint's
parameters onto one CPU device and writes a folder `transformers` loads. Pickled weights are never read.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys

import numpy as np

from jax3d.file_util import dir_problem
from jax3d.config import TOKENIZER_FILE_KEYS, Config, ConfigError, DataConfig, TrainConfig
from jax3d.hf.mapping import from_hf, hf_config_from_model, model_config_from_hf, to_hf

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ITEMSIZE = {"BF16": 2, **{k: np.dtype(v).itemsize for k, v in _DTYPES.items()}}  # the dtypes read
_PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
# The HF tokenizer files an import copies (`_tokenizer_of` says which tokenizer type a set of them means).
_TOKENIZER_FILES = ("vocab.json", "merges.txt", "vocab.txt", "tokenizer.json", "tokenizer.model",
                    "tokenizer_config.json", "special_tokens_map.json")


def read_safetensors_file(path: str) -> dict[str, np.ndarray]:
    """All tensors of one safetensors file as numpy arrays; bf16 becomes fp32 (numpy has no bf16).

    Read directly from the documented layout (u64 header length, JSON header, raw little-endian data),
    so no deep-learning framework is needed.
    """
    def damaged(why):
        return ConfigError(f"{path} is not a complete safetensors file ({why}); download or write it again")

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or 8 + n > size:
            raise damaged("its header runs past the end of the file")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise damaged("its header is not JSON") from None
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if info["dtype"] not in _ITEMSIZE:
            raise ConfigError(f"{path} stores {name} as {info['dtype']}, a dtype jax3d does not read")
        if end > raw.size or end - start != math.prod(info["shape"]) * _ITEMSIZE[info["dtype"]]:
            raise damaged(f"{name}'s data is cut short")
        buf = raw[start:end]
        if info["dtype"] == "BF16":
            arr = (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = buf.view(_DTYPES[info["dtype"]])
        out[name] = np.array(arr.reshape(info["shape"]))
    return out


def _weight_files(hf_dir: str) -> list[str]:
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [p for p in files if not os.path.exists(os.path.join(hf_dir, p))]
        if missing:
            raise ConfigError(f"--hf-dir {hf_dir} lacks shard {missing[0]} that model.safetensors.index.json lists; "
                              "download the whole folder")
        return [os.path.join(hf_dir, p) for p in files]
    if os.path.exists(single):
        return [single]
    if any(os.path.exists(os.path.join(hf_dir, p)) for p in _PICKLES):
        raise ConfigError(f"--hf-dir {hf_dir} has weights only in a pickle or framework format, which jax3d never "
                          "loads; convert them to model.safetensors first (in transformers: "
                          "model.save_pretrained(dir, safe_serialization=True))")
    raise ConfigError(f"--hf-dir {hf_dir} has no model.safetensors; pass a Hugging Face model folder")


def read_hf_folder(hf_dir: str, divisible_by: int = 128):
    """(jax3d ModelConfig, HF config dict, weight file paths) of an HF model folder; ConfigError if it
    is not one jax3d can import. Reads no tensors."""
    if not os.path.isdir(hf_dir):
        raise ConfigError(f"--hf-dir {hf_dir} is not a directory; pass a Hugging Face model folder")
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise ConfigError(f"--hf-dir {hf_dir} has no config.json, so it is not a Hugging Face model folder")
    try:
        with open(cfg_path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{cfg_path} is not readable JSON ({e}); pass an intact model folder") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{cfg_path} holds a JSON {type(hf).__name__}, not an object of model settings; pass "
                          "an intact model folder")
    try:
        cfg = model_config_from_hf(hf, divisible_by)
    except KeyError as e:
        raise ConfigError(f"{cfg_path} lacks {e.args[0]!r}, which its architecture needs; add it, or save the "
                          "model again with transformers' save_pretrained") from None
    return cfg, hf, _weight_files(hf_dir)


def load_hf_params(hf_dir: str, divisible_by: int = 128, into: dict | None = None):
    """(jax3d ModelConfig, numpy fp32 parameter tree) of an HF folder, with no checkpoint in between.

    `into` supplies values for parameters the HF class lacks (default: zeros)."""
    cfg, _, files = read_hf_folder(hf_dir, divisible_by)
    tensors = {}
    for p in files:
        tensors.update(read_safetensors_file(p))
    if into is None:
        import jax

        from jax3d.checkpoint.export import abstract_params
        into = jax.tree.map(lambda a: np.zeros(a.shape, np.float32), abstract_params(cfg))
    return cfg, from_hf(tensors, cfg, into)


def _tokenizer_of(hf_dir: str, model_type: str) -> tuple[dict, list[str]]:
    """(DataConfig tokenizer fields, files to copy) for the tokenizer files in `hf_dir` (may be none)."""
    have = [p for p in _TOKENIZER_FILES if os.path.exists(os.path.join(hf_dir, p))]
    kw = {}
    if model_type == "gpt" and {"vocab.json", "merges.txt"} <= set(have):
        kw = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "vocab.json", "merge_file": "merges.txt"}
    elif model_type == "bert" and "vocab.txt" in have:
        lower = True
        if "tokenizer_config.json" in have:
            with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
                lower = json.load(f).get("do_lower_case", True)
        kw = {"tokenizer_type": "BertWordPieceLowerCase" if lower else "BertWordPieceCase", "vocab_file": "vocab.txt"}
    elif "tokenizer.json" in have:
        kw = {"tokenizer_type": "HFTokenizer", "tokenizer_file": "tokenizer.json"}
    elif "tokenizer.model" in have:  # a SentencePiece model without its tokenizers-library conversion
        kw = {"tokenizer_type": "GPTSentencePieceTokenizer", "tokenizer_model": "tokenizer.model"}
        print(f"jax3d: {hf_dir} has no tokenizer.json; its tokenizer is tokenizer.model, read by SentencePiece "
              "(--tokenizer-type GPTSentencePieceTokenizer)", file=sys.stderr)
    return kw, have


def _check_new_dir(flag: str, path: str) -> None:
    """ConfigError unless `path` is an empty or new directory that can be written."""
    problem = dir_problem(path) or ("is not empty" if os.path.isdir(path) and os.listdir(path) else None)
    if problem:
        raise ConfigError(f"{flag} {path} {problem}; pass a new directory you can write")
    from jax3d.checkpoint.read import check_outside_checkpoint
    check_outside_checkpoint(flag, path)


def import_hf(hf_dir: str, save: str, *, divisible_by: int = 128, seed: int = 0) -> dict:
    """Writes HF folder `hf_dir` as jax3d checkpoint `save` (step 0, fresh optimizer state); returns a
    summary. Everything is checked before anything is written."""
    cfg_m, hf, files = read_hf_folder(hf_dir, divisible_by)
    _check_new_dir("--save", save)
    tensors = {}
    for p in files:
        tensors.update(read_safetensors_file(p))

    import jax

    from jax3d.checkpoint.checkpointer import Checkpointer
    from jax3d.checkpoint.tokenizer import NO_TOKENIZER
    from jax3d.models import build_model
    from jax3d.parallel.plan import resolve

    tok_kw, tok_files = _tokenizer_of(hf_dir, cfg_m.model_type)
    tokenizer = None
    if tok_kw:  # built from the source folder first, so a bad tokenizer fails before anything is written
        from jax3d.data import build_tokenizer
        src = {k: os.path.join(hf_dir, v) for k, v in tok_kw.items() if k in TOKENIZER_FILE_KEYS}
        tokenizer = build_tokenizer(tok_kw["tokenizer_type"], **src)
    tok_dir = os.path.join(os.path.abspath(save), "tokenizer")
    tok_kw = {k: (os.path.join(tok_dir, v) if k in TOKENIZER_FILE_KEYS else v) for k, v in tok_kw.items()}
    cfg = Config(model=cfg_m, data=DataConfig(**tok_kw),
                 train=TrainConfig(micro_batch_size=1, global_batch_size=1, train_iters=1, save=save, seed=seed))
    plan = resolve(cfg, 1)  # one device; the checkpoint records `cfg` as imported, its open fields open
    # A fresh init supplies the heads an HF class may lack (BertForMaskedLM has no sentence-order head); its key
    # is the one a training run of `seed` initializes its parameters with (its train state's `seed_keys`).
    init_key = jax.random.split(jax.random.key(seed))[0]
    fresh = jax.jit(build_model(cfg_m, plan.rules).init)(init_key)
    params = from_hf(tensors, cfg_m, jax.tree.map(lambda a: np.array(a, np.float32), jax.device_get(fresh)))
    on_one = jax.sharding.NamedSharding(plan.mesh.build(jax.devices()[:1]), jax.sharding.PartitionSpec())
    os.makedirs(tok_dir, exist_ok=True)
    for p in tok_files:
        shutil.copy(os.path.join(hf_dir, p), os.path.join(tok_dir, p))
    ck = Checkpointer(cfg, tokenizer=tokenizer, async_save=False)
    if not tok_kw:  # or generation would fall back to the bundled corpus's tokenizer, another vocabulary
        ck.tokenizer = {**ck.tokenizer, "note": NO_TOKENIZER}
    ck.save_params(0, jax.device_put(params, on_one))
    ck.close()
    return {"save": save, "architecture": hf.get("architectures", [hf.get("model_type")])[0],
            "model": cfg_m.model_type, "parameters": int(sum(a.size for a in jax.tree.leaves(params))),
            "tokenizer": tok_kw.get("tokenizer_type", "none")}


def export_hf(load: str, hf_dir: str, *, step: int = -1, dtype: str = "float32", max_shard_bytes: int = 5 * 10**9) -> dict:
    """Writes checkpoint `load` (latest or `step`) as an HF folder `hf_dir`: config.json, the weights with the
    embedding and head cut to the tokenizer's size (`write_weights`: in `dtype`, float32 or bfloat16, in shards of
    at most `max_shard_bytes`), the run's tokenizer files with their tokenizer_config.json and
    special_tokens_map.json, and a GPT's generation_config.json; returns a summary. Nothing is written when the
    model can't be expressed."""
    if dtype not in _EXPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype} must be one of {', '.join(_EXPORT_DTYPES)}")
    from jax3d.config import config_from_dict
    from jax3d.checkpoint.export import load_params
    from jax3d.hf import tokenizer as hf_tok

    _check_new_dir("--hf-dir", hf_dir)
    params, meta = load_params(load, step)
    cfg = config_from_dict(meta["config"])
    from jax3d.checkpoint.tokenizer import BUNDLED_TOKENIZER, checkpoint_tokenizer, tokenizer_record

    record = tokenizer_record(meta)
    if record.get("note") == BUNDLED_TOKENIZER and not any(record.get(k) for k in TOKENIZER_FILE_KEYS):
        print("jax3d: the bundled corpus's tokenizer is not in its cache any more, so the export has no tokenizer "
              "files and no special tokens; rebuild the cache with a short launch/train.py run on the Python "
              "version that trained it (another version's sources give another tokenizer), with the run's "
              "--data-cache-path if it had one, and export again", file=sys.stderr)
    tokenizer = checkpoint_tokenizer(meta, required=False)
    model = dataclasses.replace(cfg.model, unpadded_vocab_size=hf_tok.export_vocab(cfg.model, record, tokenizer))
    specials = hf_tok.special_tokens(tokenizer, model.model_type)
    token_ids = hf_tok.special_token_ids(tokenizer, specials) if specials else {}
    hf_cfg = hf_config_from_model(model, token_ids)
    tensors = to_hf(params, model)
    os.makedirs(hf_dir, exist_ok=True)
    weights = write_weights(tensors, hf_dir, dtype, max_shard_bytes)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    files = hf_tok.copy_tokenizer_files(record, hf_dir, model.model_type)
    files += hf_tok.write_tokenizer_config(record, tokenizer, hf_dir, model)
    if model.model_type == "gpt":  # transformers writes none for a class that cannot generate (BERT)
        files.append(hf_tok.write_generation_config(hf_dir, token_ids, model))
    return {"hf_dir": hf_dir, "architecture": hf_cfg["architectures"][0], "step": meta["step"],
            "tensors": len(tensors), "vocab_size": hf_cfg["vocab_size"], "dtype": dtype, "weights": weights,
            "files": files}


_EXPORT_DTYPES = ("float32", "bfloat16")


def write_weights(tensors: dict[str, np.ndarray], hf_dir: str, dtype: str = "float32",
                  max_shard_bytes: int = 5 * 10**9) -> list[str]:
    """Writes fp32 `tensors` in `dtype` as model.safetensors, or, past `max_shard_bytes`, as the shards
    model-00001-of-0000N.safetensors with the model.safetensors.index.json transformers reads; returns the files."""
    from jax3d.checkpoint.export import save_safetensors

    if dtype == "bfloat16":
        import ml_dtypes
        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    shards, size = [{}], 0
    for name, arr in tensors.items():  # in table order: a layer's tensors stay together
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if len(shards) == 1:
        save_safetensors(shards[0], os.path.join(hf_dir, "model.safetensors"), {"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_safetensors(shard, os.path.join(hf_dir, name), {"format": "pt"})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
    with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return names + ["model.safetensors.index.json"]
