"""What `--load` takes from a checkpoint where no flag says otherwise: its model, and when the run resumes, its
data, tokenizer, optimizer settings, global batch size, precision and seed.

A run resumed with `--load` continues the run it loads: where the command line leaves one of those flags out,
the checkpoint's value is taken, and a data or tokenizer flag that names other
data than the checkpoint's is refused unless `--override-data` or `--finetune` says the change is meant.
Files are compared by fingerprint, not path, so data or tokenizer files that moved are still theirs.
"""
from __future__ import annotations

import dataclasses
import os

from jax3d.checkpoint.checkpointer import FREE_MODEL_FIELDS, check_model_compatible
from jax3d.checkpoint.read import list_steps, read_meta, resolve_step
from jax3d.checkpoint.record import file_fingerprint, idx_fingerprint
from jax3d.config import (TOKENIZER_FILE_KEYS, Config, ConfigError, DataConfig, ModelConfig, OptimConfig, as_tuple,
                          config_from_dict, is_number)
from jax3d.counts import uses_counts

# The data flags a resumed run adopts or checks (argparse dests, which are DataConfig's field names). The path
# flags go together: one given names the run's data, and none of the others is taken from the checkpoint.
PATH_FIELDS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
DATA_FIELDS = (*PATH_FIELDS, "split", "tokenizer_type", *TOKENIZER_FILE_KEYS, "mask_prob", "short_seq_prob")


# Command-line flags (argparse dests) -> the model fields each one sets explicitly.
_FLAG_FIELDS = {"preset": ("model_type", "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"),
                "model": ("model_type",), "layernorm_epsilon": ("layernorm_epsilon",),
                "openai_gelu": ("activation",), "squared_relu": ("activation",)}


def adopted_fields(given_flags: set[str]) -> set[str]:
    """The model fields `--load` takes from its checkpoint: every one that no flag given sets."""
    explicit = set(FREE_MODEL_FIELDS)
    for flag in given_flags:
        explicit.update(_FLAG_FIELDS.get(flag, (flag,)))
    return {f.name for f in dataclasses.fields(ModelConfig)} - explicit


def adopt_saved_model(cfg: Config, load_dir: str, step: int, given_flags: set[str]) -> tuple[Config, set[str]]:
    """(`cfg` with the model of checkpoint `load_dir` wherever the command line did not set that field, the
    fields it took), or (`cfg`, none) when `load_dir` holds no checkpoint yet.

    So `train.py --load CKPT` fine-tunes an imported model without restating its shape (and fields such
    as `activation` that have no flag); a flag given explicitly still has to match the checkpoint.
    """
    found = list_steps(load_dir)
    if not found:
        return cfg, set()
    saved = read_meta(load_dir, resolve_step(load_dir, found, step))["config"]["model"]
    adopted = adopted_fields(given_flags)
    kw = {k: as_tuple(v) for k, v in saved.items() if k in adopted}
    model = dataclasses.replace(cfg.model, **kw)
    # A shape a flag or --preset gave must be the checkpoint's; said now, before a layout or memory check
    # could blame a field the checkpoint supplied (a vocabulary still to come from the tokenizer is left out).
    check_model_compatible(saved, model if model.vocab_size else dataclasses.replace(
        model, vocab_size=saved.get("vocab_size", 0)), load_dir)
    if "seq_length" not in given_flags and "preset" not in given_flags:
        model = dataclasses.replace(model, seq_length=min(saved.get("seq_length", model.seq_length),
                                                          model.max_position_embeddings))
    return dataclasses.replace(cfg, model=model), set(kw)


@dataclasses.dataclass
class Adopted:
    """A resumed run's config with the checkpoint's data, optimizer and seed taken in, and what to tell."""

    cfg: Config
    notes: list[str]


def adopt_saved_run(cfg: Config, load_dir: str, meta: dict, given: set[str]) -> Adopted:
    """`cfg` as a run resuming checkpoint `load_dir` (whose metadata is `meta`) trains: the checkpoint's data,
    tokenizer, optimizer settings, global batch size, precision and seed wherever no flag in `given` (argparse
    dests) set them; ConfigError when a data or tokenizer flag names other data than the checkpoint's and neither --override-data nor
    --finetune says that is meant. A fine-tune (--finetune) takes none of them, nor does a run from a checkpoint
    at step 0 (an import: it has trained on no data and its settings are the import tool's)."""
    if cfg.train.finetune or int(meta.get("step", 0)) == 0:
        return Adopted(cfg, [])
    saved = config_from_dict(meta["config"])
    notes = []
    optim = _adopt_optim(cfg, saved, meta, given, notes)
    train = dataclasses.replace(cfg.train, **_unless_given(saved.train, _TRAIN_FIELDS, given))
    precision = dataclasses.replace(cfg.precision, **_unless_given(saved.precision, _PRECISION_FIELDS, given))
    data = cfg.data
    if not cfg.train.override_data:
        data = _adopt_data(cfg.data, saved.data, meta, load_dir, given, notes)
    new = dataclasses.replace(cfg, optim=optim, data=data, train=train, precision=precision)
    taken = [f"--{f.replace('_', '-')} {getattr(getattr(new, group), f)}"
             for group, fields in (("train", _TRAIN_FIELDS), ("precision", _PRECISION_FIELDS),
                                   ("optim", {f.name: () for f in dataclasses.fields(OptimConfig)}))
             for f in fields if f not in ("lr_decay_iters", "weight_decay_incr_iters", "weight_decay_incr_samples")
             and getattr(getattr(new, group), f) != getattr(getattr(cfg, group), f)]
    if taken:
        notes.insert(0, f"the run's own settings where no flag gave them: {', '.join(taken)}")
    return Adopted(new, notes)


def adopt_saved_tokenizer(cfg: Config, load_dir: str, meta: dict, given: set[str]) -> tuple[Config, str | None]:
    """(`cfg` reading its --data-path with the tokenizer checkpoint `load_dir` (metadata `meta`) records, a note
    saying so) where no tokenizer flag in `given` names one: a fine-tune, a resume with --override-data, a run
    from an import. A plain resume took it with the checkpoint's data already (`adopt_saved_run`). (`cfg`, None)
    where it records none, or the run reads the bundled corpus."""
    from jax3d.checkpoint.tokenizer import recorded_tokenizer_fields

    d = cfg.data
    if not d.all_paths or d.tokenizer_type or given & {"tokenizer_type", *TOKENIZER_FILE_KEYS}:
        return cfg, None
    fields = recorded_tokenizer_fields(meta)
    if not fields:
        return cfg, None
    files = [os.path.relpath(fields[k]) for k in TOKENIZER_FILE_KEYS if fields[k]]
    flags = " and ".join(["--data-path"] * bool(d.data_path) + [f"--{k}-data-path" for k in d.split_paths])
    note = (f"{flags} {'is' if ' and ' not in flags else 'are'} read with its tokenizer ({fields['tokenizer_type']}: "
            f"{', '.join(files)}); pass --tokenizer-type and its files for another")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **fields)), note


# Fields a resumed run takes from its checkpoint unless one of the flags (argparse dests) listed sets them. The
# micro-batch size is not one: it changes memory, not the loss curve, and a new layout may need another.
_TRAIN_FIELDS = {"seed": ("seed",), "global_batch_size": ("global_batch_size", "preset")}
_PRECISION_FIELDS = {"dtype": ("bf16", "fp16"), "loss_scale": ("loss_scale",),
                     "initial_loss_scale": ("initial_loss_scale",), "loss_scale_window": ("loss_scale_window",),
                     "hysteresis": ("hysteresis",), "min_loss_scale": ("min_loss_scale",)}


def _unless_given(saved, fields: dict, given: set[str]) -> dict:
    return {f: getattr(saved, f) for f, flags in fields.items() if not given & set(flags)}


def _adopt_optim(cfg: Config, saved: Config, meta: dict, given: set[str], notes: list[str]) -> OptimConfig:
    """The optimizer settings no flag gave, from the checkpoint; its learning-rate decay keeps its length
    when a longer --train-iters extends a finished run (Megatron keeps a checkpoint's schedule too)."""
    # counted_batch is derived from the run's own batch sizes (jax3d.counts.settle, in the plan), never adopted
    kw = {f.name: getattr(saved.optim, f.name) for f in dataclasses.fields(OptimConfig)
          if f.name not in given and f.name != "counted_batch"}
    if "lr" in given and "min_lr" not in given:
        kw.pop("min_lr", None)  # the command line derived it from this run's --lr
    if given & {"lr_warmup_iters", "lr_warmup_samples"} and "lr_warmup_fraction" not in given:
        kw.pop("lr_warmup_fraction", None)  # the warm-up the command line gives replaces the checkpoint's fraction
    if "lr_warmup_fraction" in given:  # and a fraction given replaces the checkpoint's warm-up in steps or samples
        for f in ("lr_warmup_iters", "lr_warmup_samples"):
            if f not in given:
                kw.pop(f, None)
    if "weight_decay_incr_iters" not in given and saved.optim.weight_decay_incr_style != "constant":
        # Megatron keeps a checkpoint's weight-decay schedule, its length included
        kw["weight_decay_incr_iters"] = saved.optim.weight_decay_incr_iters or saved.train.train_iters
    if "lr_decay_iters" not in given:
        kw["lr_decay_iters"] = saved.optim.lr_decay_iters or saved.train.train_iters
        # (a run counted in samples decays over samples, and its --train-iters is the plan's to derive)
        if not saved.optim.lr_decay_iters and saved.train.train_iters != cfg.train.train_iters \
                and saved.optim.lr_decay_style != "constant" and not (uses_counts(saved) or uses_counts(cfg)):
            notes.append(f"the learning rate keeps the checkpoint's {saved.optim.lr_decay_style} decay over "
                         f"{kw['lr_decay_iters']} iterations (its --train-iters); pass --lr-decay-iters to set another")
    return dataclasses.replace(cfg.optim, **kw)


def _adopt_data(d: DataConfig, saved: DataConfig, meta: dict, load_dir: str, given: set[str],
                notes: list[str]) -> DataConfig:
    record = meta.get("data")
    tok_record = meta.get("tokenizer") or {}
    paths_given = bool(given & set(PATH_FIELDS))
    kw = {f: getattr(saved, f) for f in DATA_FIELDS if f not in given and not (paths_given and f in PATH_FIELDS)}
    if "data_cache_path" not in given and saved.cache_dir:
        kw["cache_dir"] = saved.cache_dir if record is None else record["cache_dir"]
    out = dataclasses.replace(d, **{k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()})
    if record is None:  # written before checkpoints kept fingerprints: what the config says, unchecked
        return out
    out = _check_data_paths(out, record, load_dir, paths_given)
    out = _check_tokenizer(out, saved, tok_record, load_dir, given)
    if out.split != record["split"] and not out.split_paths:  # separate datasets are read whole, whatever --split
        _refuse(load_dir, f"--split {out.split}", f"--split {record['split']}")
    adopted = [f for f in ("data_path", "tokenizer_type") if f not in given and getattr(saved, f)]
    if not paths_given and out.split_paths:
        adopted.append("split_paths")
    if adopted:
        files = [os.path.relpath(getattr(out, k)) for k in TOKENIZER_FILE_KEYS if getattr(out, k)]
        where = f"{' '.join(_shown(out.data_path))}, split {out.split}" if not out.split_paths else _paths_shown(
            {f: getattr(out, f) for f in PATH_FIELDS})
        notes.append(f"continuing on its data ({where}) and tokenizer ({out.tokenizer_type}: {', '.join(files)}); "
                     "--override-data or --finetune trains on other data")
    return out


def _shown(data_path) -> list[str]:
    return [p if is_number(p) else os.path.relpath(p) for p in data_path]


def _paths_shown(paths: dict) -> str:
    """{path field: paths} as flags (`--train-data-path a --valid-data-path b`), or the bundled corpus."""
    return " ".join(f"--{f.replace('_', '-')} {' '.join(_shown(p))}" for f, p in paths.items() if p) or \
        "the bundled corpus"


def _refuse(load_dir: str, this: str, recorded: str) -> None:
    raise ConfigError(f"{this} is not what --load {load_dir} was trained on ({recorded}); leave it out to continue "
                      "on the checkpoint's, add --override-data to resume on this, or --finetune to start a new run "
                      "from its weights")


def _records(record: dict) -> dict:
    """{path field: its record (data_path, prefixes, idx_fingerprints)} of a checkpoint's data record; a split
    it gave no data of its own has an empty one."""
    empty = {"data_path": [], "prefixes": [], "idx_fingerprints": []}
    split = record.get("split_paths") or {}
    return {"data_path": record, **{f"{k}_data_path": split.get(k, empty) for k in ("train", "valid", "test")}}


def _check_data_paths(d: DataConfig, record: dict, load_dir: str, given: bool) -> DataConfig:
    """`d` with each prefix of the checkpoint's data (by .idx fingerprint) found where it is now; given
    --data-path / --*-data-path flags that name other data are refused, a recorded prefix that moved is
    looked for where it was given."""
    records = _records(record)
    if not given:
        return dataclasses.replace(d, **{f: _found(getattr(d, f), r, load_dir, f) for f, r in records.items()})
    if any(not _same_data(getattr(d, f), r) for f, r in records.items()):
        if not d.split_paths and not record.get("split_paths"):  # the message --data-path alone has always had
            shown = " ".join(d.data_path) if d.data_path else "no --data-path (the bundled corpus)"
            _refuse(load_dir, f"--data-path {shown}",
                    f"--data-path {' '.join(_shown(record['data_path'])) or 'the bundled corpus'}")
        _refuse(load_dir, _paths_shown({f: getattr(d, f) for f in records}),
                _paths_shown({f: r["data_path"] for f, r in records.items()}))
    return d


def _found(data_path, r: dict, load_dir: str, field: str) -> tuple:
    """`data_path` (the checkpoint's, as its config has it) with each recorded prefix found by fingerprint, at
    its absolute path or where it was given."""
    from jax3d.data.sampling import parse_data_paths

    recorded = r["prefixes"]
    found = []
    for absolute, as_given, fp in zip(recorded, parse_data_paths(r["data_path"])[1] if recorded else [],
                                      r["idx_fingerprints"]):
        here = next((p for p in (absolute, as_given) if idx_fingerprint(p) == fp), None)
        if here is None:
            flag = "--" + field.replace("_", "-")
            raise ConfigError(f"--load {load_dir} was trained on {flag} {as_given}, and {absolute}.idx is "
                              f"gone or holds another corpus; pass {flag} where that corpus is now")
        found.append(here)
    weights = list(data_path[0::2]) if len(data_path) > 1 else []
    return tuple(x for pair in zip(weights, found) for x in pair) if weights else tuple(found)


def _same_data(data_path, r: dict) -> bool:
    """Whether `data_path` names the data of record `r`: the same weights and .idx fingerprints."""
    from jax3d.data.sampling import parse_data_paths

    weights, prefixes = parse_data_paths(list(data_path)) if data_path else ([], [])
    rec_weights = parse_data_paths(r["data_path"])[0] if r["data_path"] else []
    return len(prefixes) == len(r["prefixes"]) and all(abs(a - b) <= 1e-9 for a, b in zip(weights, rec_weights)) \
        and all(idx_fingerprint(p) == fp for p, fp in zip(prefixes, r["idx_fingerprints"]))


def _check_tokenizer(d: DataConfig, saved: DataConfig, tok_record: dict, load_dir: str,
                     given: set[str]) -> DataConfig:
    """`d` with the checkpoint's tokenizer files found (where recorded, else the copies kept in the
    checkpoint); given tokenizer flags must name the same tokenizer (type and file contents)."""
    fps = tok_record.get("fingerprints") or {}
    if d.tokenizer_type != saved.tokenizer_type:
        _refuse(load_dir, f"--tokenizer-type {d.tokenizer_type or '(none)'}",
                f"--tokenizer-type {saved.tokenizer_type or '(the bundled corpus tokenizer)'}")
    kw = {}
    for key in TOKENIZER_FILE_KEYS:
        flag = "--" + key.replace("_", "-")
        path, want = getattr(d, key), fps.get(key)
        if key in given:
            if want and (not os.path.isfile(path) or file_fingerprint(path) != want):
                _refuse(load_dir, f"{flag} {path}", f"other file contents, kept in {os.path.join(load_dir, 'tokenizer')}")
            continue
        if not path or not want:
            continue
        kept = os.path.join(os.path.abspath(load_dir), "tokenizer", os.path.basename(path))
        here = next((p for p in (path, kept) if os.path.isfile(p) and file_fingerprint(p) == want), None)
        if here is None:
            raise ConfigError(f"--load {load_dir} was trained with {flag} {path}, which is gone or changed, and "
                              f"the checkpoint keeps no copy; pass {flag} with the original file")
        kw[key] = here
    return dataclasses.replace(d, **kw)


def checkpoint_data_path(load_dir: str, step: int = -1, which: str = "valid") -> tuple[list[str], str | None]:
    """(the `--data-path` checkpoint `load_dir` (step `step`, -1 the latest) was trained on, each corpus found by
    its fingerprint where it is now, or the bundled corpus's prefix; None), or where it was trained on
    separate datasets, (split `which`'s, the --split that reads it whole). ConfigError when it recorded no data
    (an import), no data for `which`, or a corpus is gone."""
    from jax3d.checkpoint.read import saved_step_meta
    from jax3d.config import DataConfig
    from jax3d.train.inputs import WHOLE_SPLIT

    step, meta = saved_step_meta(load_dir, step)
    saved = config_from_dict(meta["config"])
    record = meta.get("data")
    if record is None or int(meta.get("step", 0)) == 0:
        raise ConfigError(f"--load {load_dir} records no data it was trained on; pass --data-path or --text-file")
    if record.get("split_paths"):
        field = f"{which}_data_path"
        if which not in record["split_paths"]:
            raise ConfigError(f"--load {load_dir} was trained without --{which}-data-path, so it has no {which} "
                              "data of its own; pass --data-path or --text-file")
        return list(_found(getattr(saved.data, field), record["split_paths"][which], load_dir, field)), \
            WHOLE_SPLIT[which]
    if not record["prefixes"]:
        from jax3d.data import default_corpus
        return [default_corpus(cache_dir=saved.data.cache_dir or None, kind=saved.model.model_type)[0]], None
    found = _check_data_paths(DataConfig(data_path=tuple(saved.data.data_path)), record, load_dir, given=False)
    return list(found.data_path), None
