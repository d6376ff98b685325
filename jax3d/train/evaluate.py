"""Loss and perplexity of a checkpoint over a whole data set, on any (data, stage, model) layout.

It runs the same jitted `eval_step` as training's validation (so on the same samples the figures equal
what `launch/train.py` logs), over every sample once: Megatron `.bin/.idx` data through the GPT / BERT
sample datasets (`--split` / `--seed` pick the same samples as training), or a plain text file cut into
windows. The last, partial batch is padded with rows whose loss weights are zero, and the per-batch
means are weighted back to sums, so every sample counts once. BERT reports MLM loss and perplexity and
sentence-order loss and accuracy.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys

import jax
import numpy as np

from jax3d.config import Config, ConfigError, ParallelConfig, PrecisionConfig, TrainConfig
from jax3d.data.indexed import DataError

SPLITS = ("train", "valid", "test")


class TextWindows:
    """GPT samples from one text file: its tokens (EOD after it) cut into windows of seq_length + 1
    that overlap by the one target token, the last one short and masked past its end."""

    def __init__(self, path: str, tokenizer, seq_length: int):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"--text-file {path} is unreadable ({e}); pass a UTF-8 text file") from None
        ids = tokenizer.tokenize(text)
        eod = getattr(tokenizer, "eod", None)
        ids = np.asarray(ids + ([eod] if eod is not None else []), np.int32)
        if len(ids) < 2:
            raise DataError(f"--text-file {path} holds fewer than two tokens; there is nothing to predict")
        self.ids, self.seq = ids, seq_length
        self.n = -(-(len(ids) - 1) // seq_length)

    def __len__(self):
        return self.n

    def __getitem__(self, i: int) -> dict:
        w = self.ids[i * self.seq: i * self.seq + self.seq + 1]
        text = np.zeros(self.seq + 1, np.int32)
        text[: len(w)] = w
        mask = (np.arange(self.seq) < len(w) - 1).astype(np.float32)
        return {"text": text, "loss_mask": mask}


def _weights(kind: str, sample: dict, seq: int) -> dict:
    """The loss-weight keys a sample gets (all ones when real), so padding rows can zero them."""
    if kind == "bert":
        return {"sop_weight": np.float32(1.0)}
    return {} if "loss_mask" in sample else {"loss_mask": np.ones(seq, np.float32)}


def _zeroed(sample: dict) -> dict:
    out = dict(sample)
    out["loss_mask"] = np.zeros_like(np.asarray(sample["loss_mask"]))
    if "sop_weight" in out:
        out["sop_weight"] = np.float32(0.0)
    return out


def build_dataset(cfg: Config, tokenizer, data_paths, text_file: str, split: str, which: str, num_samples: int,
                  validated: int = 0):
    """The sample dataset to evaluate and how many of its samples to use (all by default). A split may be
    read past its end, as training's validation of `validated` samples reads a small one, up to the larger
    of one pass and `validated`."""
    from jax3d import data

    m = cfg.model
    if text_file:
        if m.model_type != "gpt":
            raise ConfigError("--text-file evaluates GPT checkpoints; for BERT, preprocess the text with "
                              "--split-sentences and pass --data-path")
        ds = TextWindows(text_file, tokenizer, m.seq_length)
        if num_samples > len(ds):
            raise ConfigError(f"--num-samples {num_samples} is more than the {len(ds)} windows of {text_file}; "
                              "pass at most that many, or 0 for all of them")
        return ds, num_samples or len(ds)
    from jax3d.data.sampling import parse_data_paths, why_split_is_empty
    from jax3d.train.inputs import check_token_ids, check_tokenized_by

    check_token_ids(data_paths, tokenizer.vocab_size)
    check_tokenized_by(data_paths, tokenizer, "the checkpoint's",
                       "preprocess it with the checkpoint's tokenizer (a checkpoint keeps its files in its tokenizer/ "
                       "folder)")
    idx = SPLITS.index(which)

    def build(samples: int, paths=tuple(data_paths)):
        want = [0, 0, 0]
        want[idx] = samples
        if m.model_type == "bert":
            return data.build_bert_datasets(list(paths), split, m.seq_length, want, cfg.train.seed,
                                            tokenizer, cache_dir=cfg.data.cache_dir or None,
                                            masked_lm_prob=cfg.data.mask_prob,
                                            short_seq_prob=cfg.data.short_seq_prob)[idx]
        return data.build_gpt_datasets(list(paths), split, m.seq_length, want, cfg.train.seed,
                                       cache_dir=cfg.data.cache_dir or None)[idx]

    # One pass: 1 asks a single source for one epoch, every window of its split once. A blend of sources
    # is as long as asked, so one pass over it is the sum of its sources' passes.
    weights, prefixes = parse_data_paths(data_paths)
    passes = [build(1, (p,)) for w, p in zip(weights, prefixes) if w > 0]
    one_pass = sum(len(d) for d in passes if d is not None)
    if not one_pass:
        raise ConfigError(f"{why_split_is_empty(data_paths, split, which, m.model_type != 'bert')}, or pass "
                          "another --split-name")
    if num_samples > max(one_pass, validated):
        also = f" (training validated on {validated})" if validated else ""
        raise ConfigError(f"--num-samples {num_samples} is more than the {one_pass} samples of the {which} split{also}; "
                          f"pass at most {max(one_pass, validated)}, or 0 for one pass over the split")
    # Built for the count evaluated, the samples come in the order training's validation read them.
    count = num_samples or one_pass
    ds = passes[0] if len(prefixes) == 1 and not num_samples else build(count)
    return ds, count


def evaluate_params(steps, params, dataset, count: int, progress: bool = True) -> dict:
    """Token-weighted loss (and BERT's sentence-order figures) of samples 0..count-1 of `dataset`;
    `params` as the train state holds them (`steps.state_params` of logical ones)."""
    from tqdm import tqdm

    kind = steps.cfg.model.model_type
    seq = steps.cfg.model.seq_length
    gb, accum = steps.cfg.train.global_batch_size, steps.accum_steps
    sums = {"lm": 0.0, "lm_n": 0.0, "sop": 0.0, "sop_correct": 0.0, "sop_n": 0.0}
    sharding = steps.batch_sharding()
    first = None
    for start in tqdm(range(0, count, gb), desc="evaluate", unit="batch", disable=not progress, file=sys.stderr):
        rows = []
        for i in range(start, start + gb):
            if i < count:
                s = dict(dataset[i])
                s.update(_weights(kind, s, seq))
                first = first or s
            else:
                s = _zeroed(first)
            rows.append(s)
        batch = {k: np.stack([np.asarray(r[k]) for r in rows]).reshape(accum, gb // accum, *np.shape(rows[0][k]))
                 for k in rows[0]}
        n_lm = float(np.sum(batch["loss_mask"]))
        # Every process builds the same host batch and hands each local device its slice of it.
        arrays = {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in batch.items()}
        metrics = jax.device_get(steps.eval_step(params, arrays))
        if kind == "bert":
            n_sop = float(np.sum(batch["sop_weight"]))
            sums["lm"] += float(metrics["lm_loss"]) * max(n_lm, 1.0)
            sums["sop"] += float(metrics["sop_loss"]) * max(n_sop, 1.0)
            sums["sop_correct"] += float(metrics["sop_acc"]) * max(n_sop, 1.0)
            sums["sop_n"] += n_sop
        else:
            sums["lm"] += float(metrics["loss"]) * max(n_lm, 1.0)
        sums["lm_n"] += n_lm
    loss = sums["lm"] / max(sums["lm_n"], 1.0)
    out = {"samples": count, "tokens": int(sums["lm_n"])}
    if kind == "bert":
        out.update(mlm_loss=loss, mlm_ppl=math.exp(min(loss, 50.0)), sop_loss=sums["sop"] / max(sums["sop_n"], 1.0),
                   sop_acc=sums["sop_correct"] / max(sums["sop_n"], 1.0))
    else:
        out.update(loss=loss, ppl=math.exp(min(loss, 50.0)))
    return out


def evaluate_checkpoint(load: str, *, step: int = -1, data_paths=(), text_file: str = "", split: str | None = None,
                        which: str = "valid", num_samples: int = 0, micro_batch_size: int = 4, tp: int = 1,
                        pp: int = 1, dp: int = 0, dtype: str = "float32", seed: int | None = None,
                        tokenizer=None, progress: bool = True, quantization: str = "none") -> dict:
    """Loss / perplexity of checkpoint `load` over a data set on a (dp, pp, tp) layout of the devices; with
    `quantization` "fp8", of the weights generation's `--quantization fp8` holds (jax3d.models.quantized.rounded):
    what fp8 weights cost the model on this data."""
    from jax3d.parallel import with_shardings
    from jax3d.parallel.pipeline_spec import fewest_microbatches
    from jax3d.parallel.mesh import AXES
    from jax3d.parallel.plan import evaluation_mesh, resolve
    from jax3d.config import config_from_dict
    from jax3d.checkpoint.read import restore_arrays, saved_step_meta
    from jax3d.train.step import build_steps

    if bool(data_paths) == bool(text_file):
        raise ConfigError("pass exactly one of --data-path PREFIX and --text-file FILE")
    step, meta = saved_step_meta(load, step)
    saved = config_from_dict(meta["config"])
    layout = evaluation_mesh(jax.device_count(), saved.model.num_layers, tp, pp, dp)
    global_batch = micro_batch_size * layout.data * fewest_microbatches(layout.stage)
    cfg = Config(model=saved.model, parallel=ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp),
                 precision=PrecisionConfig(dtype=dtype), data=saved.data,
                 train=TrainConfig(micro_batch_size=micro_batch_size, global_batch_size=global_batch,
                                   seed=saved.train.seed if seed is None else seed))
    plan = resolve(cfg, layout.size, checkpoint=load, from_checkpoint=[f.name for f in dataclasses.fields(saved.model)])
    cfg = plan.cfg
    if tokenizer is None:
        from jax3d.checkpoint.tokenizer import checkpoint_tokenizer
        tokenizer = checkpoint_tokenizer(meta)
    split = saved.data.split if split is None else split  # by default the samples training validated on
    validated = saved.train.eval_iters * saved.train.global_batch_size if which == "valid" else 0
    dataset, count = build_dataset(cfg, tokenizer, data_paths, text_file, split, which, num_samples, validated)
    steps = build_steps(plan)
    targets = with_shardings(steps.abstract_logical_state.params, steps.logical_shardings.params)
    params = restore_arrays(load, step, {"params": targets}).params
    if quantization == "fp8":
        from jax3d.models import quantized
        params = jax.jit(functools.partial(quantized.rounded, compute_dtype=steps.precision.compute_dtype),
                         out_shardings=steps.logical_shardings.params)(params)
    params = steps.state_params(params)
    out = evaluate_params(steps, params, dataset, count, progress)
    out.update(step=int(meta["step"]), layout=dict(zip(AXES, (layout.data, pp, tp))),
               **({"quantization": quantization} if quantization != "none" else {}))
    return out
