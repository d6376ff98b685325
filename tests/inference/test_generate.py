"""Generation with a KV cache against transformers' greedy `generate` on an imported tiny GPT-2, against
jax3d's own forward pass without a cache, and with tensor parallelism; the device-side token loop against
the tokens of one long run (chunks, token counts, end-of-document, per-row budgets, compiles, the cache
updated in place); sampling against itself on other layouts. The command line: tests/inference/test_generate_cli.py."""
import re

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jax3d.config import ConfigError  # noqa: E402
from jax3d.checkpoint.export import load_params  # noqa: E402
from jax3d.hf import import_hf  # noqa: E402
from jax3d.inference import Generator, Sampling, greedy_without_cache  # noqa: E402
from jax3d.inference.generate import PAD  # noqa: E402
from jax3d.parallel.mesh import MeshConfig  # noqa: E402
from tests.helpers import interpreted, only  # noqa: E402
from jax3d.models import build_model  # noqa: E402
from jax3d.config import config_from_dict  # noqa: E402
from benchmarks.profile_decode import loop_body_kernels  # noqa: E402
from tests.hf_fixtures import tiny_gpt2  # noqa: E402

NEW = 32
PROMPTS = [[5, 17, 300, 41, 9, 77, 2], [11], [400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 12], [88, 3, 3, 250]]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    hf = tiny_gpt2(str(d / "hf"), n_layer=3, n_embd=48, n_head=6, vocab=1000, n_positions=64)
    hf.generation_config.eos_token_id = None  # always 32 tokens
    import_hf(str(d / "hf"), str(d / "ckpt"))
    params, meta = load_params(str(d / "ckpt"))
    return hf, params, config_from_dict(meta["config"]).model


def _hf_greedy(hf, prompts, use_cache=True):
    t = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (t - len(p)) + p for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (t - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                          use_cache=use_cache)
    return out[:, t:].tolist()


def _gen(cfg, params, batch, tp=1, **kw):
    mesh_cfg = MeshConfig(1, 1, tp)
    return Generator(cfg, params, mesh_cfg.build(jax.devices()[:tp]), batch=batch, max_len=64, **kw)


def test_the_decode_kernel_gives_transformers_tokens_for_a_ragged_batch(imported, monkeypatch):
    """Decode's attention as jax3d.kernels.decode_attention (Pallas' interpreter standing in for the GPU), walking
    the 64 slots in blocks of 16 from each row's first token, whole or (the default at 4 rows of 6 heads,
    decode_attention.Tuning.parts_for) in 8 parts: transformers' greedy tokens, as from XLA's attention with the
    kernel off."""
    from jax3d.kernels import decode_attention

    hf, params, cfg = imported
    calls = interpreted(monkeypatch, "decode_attention")
    want = _hf_greedy(hf, PROMPTS)
    for tuning in (decode_attention.Tuning(block=16, parts=1), decode_attention.Tuning(block=16)):
        kernels = only("decode_attention", tuning)
        assert _gen(cfg, params, batch=len(PROMPTS), kernels=kernels).generate(PROMPTS, NEW) == want
    assert calls, "the kernel did not run"
    calls.clear()
    assert _gen(cfg, params, batch=len(PROMPTS)).generate(PROMPTS, NEW) == want  # this CPU's policy: no kernel
    assert not calls


def test_the_decode_kernel_reads_a_grouped_projection_as_it_lies(monkeypatch):
    """A GPT with grouped-query attention and learned positions (no rotary embedding, so the kernel reads the
    QKV projection itself, 2 query heads per KV head), rows whole and in 2 parts: the tokens of the forward pass
    without a cache."""
    from jax3d.config import ModelConfig
    from jax3d.kernels import decode_attention

    # weights large enough that attention, not the residual stream, picks the tokens
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                      seq_length=64, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                      init_method_std=0.3)
    model = build_model(cfg)
    params = model.init(jax.random.key(3))
    want = [greedy_without_cache(model, params, p, 12, cfg.vocab_size) for p in PROMPTS]
    calls = interpreted(monkeypatch, "decode_attention")
    for parts in (1, 2):
        kernels = only("decode_attention", decode_attention.Tuning(block=16, parts=parts))
        assert _gen(cfg, params, batch=4, kernels=kernels).generate(PROMPTS, 12) == want
    assert calls, "the kernel did not run"


def test_an_fp8_cache_gives_one_set_of_tokens_from_the_kernel_xla_and_two_devices(imported, monkeypatch):
    """A float8_e4m3fn KV cache: the decode kernel (interpreted) and XLA's attention read it to the same tokens,
    as do heads split over 2 devices; the compiled decode keeps the cache in fp8. (XLA on a CPU updates an fp8
    array through f16, a copy; compiled for an H100 by benchmarks/gpu_compile.py, decode copies none.) Against
    transformers' fp32 tokens it is an approximation: greedy picks part at near-ties (this tiny random model's
    logits are nearly flat), so only most of the tokens are asserted equal."""
    from jax3d.kernels import decode_attention

    hf, params, cfg = imported
    fp8 = jax.numpy.float8_e4m3fn
    xla = _gen(cfg, params, batch=4, cache_dtype=fp8).generate(PROMPTS, NEW)
    assert _gen(cfg, params, batch=4, tp=2, cache_dtype=fp8).generate(PROMPTS, NEW) == xla
    calls = interpreted(monkeypatch, "decode_attention")
    kernels = only("decode_attention", decode_attention.Tuning(block=16))
    assert _gen(cfg, params, batch=4, cache_dtype=fp8, kernels=kernels).generate(PROMPTS, NEW) == xla
    assert calls, "the kernel did not run"
    want = _hf_greedy(hf, PROMPTS)
    same = np.mean([x == y for got, row in zip(xla, want) for x, y in zip(got, row)])
    assert same >= 0.75, same
    hlo = _gen(cfg, params, batch=4, cache_dtype=fp8).decode_hlo(PROMPTS)
    cache = f"[4,{cfg.kv_heads},64,{cfg.head_dim}]"
    assert f"f8e4m3fn{cache}" in hlo


def test_an_fp8_cache_is_refused_on_a_gpu_without_fp8(imported, monkeypatch):
    """A GPU below compute capability 8.9 (an A100) has no FP8 conversions for the decode kernel: one sentence
    naming the flag to drop (both, with fp8 weights too), before anything is placed; Ada and Hopper GPUs and CPUs
    take the cache."""
    from types import SimpleNamespace

    from jax3d.parallel import precision
    from jax3d.parallel.precision import without_fp8

    a100 = SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100-SXM4-80GB")
    h100 = SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H100")
    assert (without_fp8([a100]), without_fp8([h100]), without_fp8(jax.devices()[:1])) == ("8.0", "", "")
    _, params, cfg = imported
    monkeypatch.setattr(precision, "without_fp8", lambda devices: without_fp8([a100]))
    with pytest.raises(ConfigError, match=r"^jax3d's fp8 KV cache \(--kv-cache-dtype fp8\) is built for GPUs with "
                                          r"FP8 \(compute capability 8.9 or later: Ada, Hopper\) and this cpu has "
                                          r"8.0; drop --kv-cache-dtype fp8$"):
        _gen(cfg, params, batch=1, cache_dtype=jax.numpy.float8_e4m3fn)
    with pytest.raises(ConfigError, match=r"^jax3d's fp8 KV cache and weights \(--kv-cache-dtype fp8 and "
                                          r"--quantization fp8\) are built .* and this cpu has 8.0; drop "
                                          r"--kv-cache-dtype fp8 and --quantization fp8$"):
        _gen(cfg, params, batch=1, cache_dtype=jax.numpy.float8_e4m3fn, weight_dtype=jax.numpy.float8_e4m3fn)
    _gen(cfg, params, batch=1)  # a bf16 or fp32 cache is not asked about


def test_greedy_batch1_equals_transformers_with_and_without_cache(imported):
    hf, params, cfg = imported
    prompt = PROMPTS[0]
    want = _hf_greedy(hf, [prompt])[0]
    assert _hf_greedy(hf, [prompt], use_cache=False)[0] == want
    gen = _gen(cfg, params, batch=1)
    assert gen.generate([prompt], NEW) == [want]
    assert greedy_without_cache(build_model(cfg), params, prompt, NEW, cfg.unpadded_vocab_size) == want
    assert gen.compile_counts() == {"prefill": 1, "decode": 1}


def test_ragged_batch_of_4_left_padded_equals_transformers(imported):
    hf, params, cfg = imported
    want = _hf_greedy(hf, PROMPTS)
    gen = _gen(cfg, params, batch=4)
    assert gen.generate(PROMPTS, NEW) == want
    # Each row alone gives the same tokens: padding changes nothing.
    alone = _gen(cfg, params, batch=1)
    assert [alone.generate([p], NEW)[0] for p in PROMPTS] == want
    assert gen.compile_counts()["decode"] == 1


def test_tensor_parallel_2_same_tokens(imported):
    hf, params, cfg = imported
    single = _gen(cfg, params, batch=4).generate(PROMPTS, NEW)
    tp = _gen(cfg, params, batch=4, tp=2)
    assert tp.params["blocks"][0]["attn"]["qkv_kernel"].sharding.spec[2] == "model"
    assert tp.generate(PROMPTS, NEW) == single
    # a token's collectives: one all-reduce per block half, one for the vocab-parallel embedding, and the
    # argmax's gather of each half's best (value, index)
    body = loop_body_kernels(tp.decode_hlo(PROMPTS))
    assert (body["all-reduce"], body["all-gather"]) == (2 * cfg.num_layers + 1, 2), body


def test_a_make_mesh_mesh_with_data_rows_gives_the_same_tokens(imported):
    """A mesh from `jax.make_mesh` (Explicit axes by default) with rows over `data` and heads over
    `model`: the tokens of one device; a batch the data axis can't split, and a layer stack of another
    length (a pipelined state's), are refused with one sentence each."""

    _, params, cfg = imported
    single = _gen(cfg, params, batch=4).generate(PROMPTS, NEW)
    mesh = jax.make_mesh((2, 1, 2), ("data", "stage", "model"), devices=jax.devices()[:4])
    assert Generator(cfg, params, mesh, batch=4, max_len=64).generate(PROMPTS, NEW) == single
    with pytest.raises(ConfigError, match="a batch of 3 does not split over the mesh's 2 data devices"):
        Generator(cfg, params, mesh, batch=3, max_len=64)
    padded = {**params, "blocks": jax.tree.map(lambda a: np.concatenate([a, np.zeros_like(a[:1])]),
                                               params["blocks"])}
    with pytest.raises(ConfigError, match=r"stacks 4 layers but the model has 3.*logical_params"):
        Generator(cfg, padded, mesh, batch=4, max_len=64)


def test_sampling_is_seeded_and_respects_top_k(imported):
    _, params, cfg = imported
    gen = _gen(cfg, params, batch=2)
    s = Sampling(temperature=0.8, top_k=5, top_p=0.9)
    a = gen.generate(PROMPTS[:2], 8, s, seed=3)
    assert a == gen.generate(PROMPTS[:2], 8, s, seed=3)
    assert all(0 <= t < cfg.unpadded_vocab_size for row in a for t in row)
    one = gen.generate(PROMPTS[:2], 8, Sampling(top_k=1), seed=4)  # top-1 sampling is greedy
    assert one == gen.generate(PROMPTS[:2], 8)


def test_prompt_longer_than_context(imported):
    _, params, cfg = imported
    gen = _gen(cfg, params, batch=1)
    with pytest.raises(ConfigError, match="shorten the prompt"):
        gen.generate([list(range(60))], NEW)
    with pytest.raises(ConfigError, match="longer than the model's 64 positions"):
        Generator(cfg, params, gen.mesh, batch=1, max_len=65)


def test_cli_streams_the_greedy_text_with_tp2_and_rejects_bad_input(tmp_path):
    import subprocess
    import sys

    from tests.hf_fixtures import gpt2_folder_with_tokenizer, tiny_bert
    from tests.helpers import ROOT, subprocess_env

    hf, tok = gpt2_folder_with_tokenizer(tmp_path / "hf")
    hf.generation_config.eos_token_id = None
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    prompt = "def add(a, b):"
    ids = tok.tokenize(prompt)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = tok.detokenize(out[0, len(ids):].tolist())
    gen = [sys.executable, f"{ROOT}/launch/generate.py", "--cpu-devices", "2"]
    r = subprocess.run([*gen, "--load", str(tmp_path / "ckpt"), "--prompt", prompt, "--greedy", "--max-new-tokens", "12",
                        "--ignore-eod", "--tensor-model-parallel-size", "2"],
                       capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.rstrip("\n") == prompt + want  # as a batch prints each prompt and its continuation
    from jax3d.inference import generate_text
    assert generate_text(str(tmp_path / "ckpt"), [prompt], 12) == [want]
    assert "compiled prefill 1x and decode 1x" in r.stderr

    tiny_bert(str(tmp_path / "bert"), "BertForPreTraining", dict(num_hidden_layers=1, hidden_size=24,
                                                                 num_attention_heads=3, intermediate_size=40,
                                                                 vocab_size=99))
    import_hf(str(tmp_path / "bert"), str(tmp_path / "bert_ckpt"))
    blank = tmp_path / "blank_prompts.txt"
    blank.write_text("\n  \n")
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(bytes(range(128, 256)))
    for argv, words in [(["--load", str(tmp_path / "bert_ckpt"), "--prompt", "x"], "holds a bert checkpoint"),
                        (["--load", str(tmp_path / "ckpt"), "--prompt", "fox " * 60], "exceeds the model's 64 positions"),
                        (["--load", str(tmp_path / "ckpt")], "no prompt given"),
                        (["--load", str(tmp_path / "ckpt"), "--prompt-file", str(blank)], "holds no prompt"),
                        (["--load", str(tmp_path / "ckpt"), "--prompt-file", str(binary)], "is not UTF-8 text"),
                        (["--load", str(tmp_path / "ckpt"), "--prompt", "x", "--top-k", "100000", "--max-new-tokens", "4"],
                         "--top-k 100000 exceeds the model's"),
                        (["--load", str(tmp_path / "ckpt"), "--prompt", "x", "--greedy", "--temperature", "0.7"],
                         "--greedy takes the most likely token, so --temperature 0.7 would go unused"),
                        (["--load", str(tmp_path / "ckpt"), "--prompt", "x", "--temperature", "nan"],
                         "--temperature nan must be positive and finite")]:  # it printed nothing, exit 0
        r = subprocess.run([*gen, *argv], capture_output=True, text=True, env=subprocess_env(), timeout=300)
        assert r.returncode == 2 and r.stdout == "", (argv, r.stderr[-500:])
        assert r.stderr.startswith("error: ") and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_train_py_checkpoint_never_generates_its_padding_ids(imported):
    """A train.py run records no unpadded vocabulary (0): its rows past the tokenizer's are padding, which
    generation must never pick, even where their logits are the largest."""
    import dataclasses
    from types import SimpleNamespace


    from jax3d.inference.generate import generator_for

    _, params, cfg = imported
    cfg = dataclasses.replace(cfg, unpadded_vocab_size=0)  # 1024 rows, as train.py pads a 1000-token vocabulary
    wte = np.array(params["embed"]["word"])
    wte[1000:] = 100 * np.abs(wte[:24]).max()  # the padding rows win every argmax
    params = {**params, "embed": {**params["embed"], "word": wte}}
    assert max(_gen(cfg, params, batch=1).generate([PROMPTS[0]], 4)[0]) >= 1000  # the unguarded generator picks them
    gen = generator_for(cfg, params, SimpleNamespace(vocab_size=1000, eod=None), [PROMPTS[0]], 4)
    assert all(t < 1000 for t in gen.generate([PROMPTS[0]], 4)[0])


def test_chunks_and_token_counts_give_the_tokens_of_one_run_from_one_decode_compile(imported):
    """Decode runs up to `chunk` tokens per call in a device loop: 5-token chunks, and 1, 7 or 32 tokens
    asked, give the prefixes of one 32-token run, from one decode program."""
    _, params, cfg = imported
    want = _gen(cfg, params, batch=4).generate(PROMPTS, NEW)
    gen = _gen(cfg, params, batch=4, chunk=5)
    chunks = list(gen.stream(PROMPTS, NEW))
    assert [c.shape for c in chunks] == [(4, 1)] + [(4, 5)] * 6 + [(4, 1)]  # prefill's token, then 31 in chunks
    assert np.concatenate(chunks, axis=1).tolist() == want
    for n in (1, 7, NEW):
        assert gen.generate(PROMPTS, n) == [row[:n] for row in want]
    assert gen.compile_counts() == {"prefill": 1, "decode": 1}


def test_end_of_document_and_budgets_end_each_row_at_its_token(imported):
    """A row ends right after its end-of-document token, or after its own number of tokens; its later
    tokens are PAD, and once every row is done the loop stops."""
    _, params, cfg = imported
    want = _gen(cfg, params, batch=4).generate(PROMPTS, NEW)
    # the token that ends the most rows, at different steps
    eod = max({t for row in want for t in row}, key=lambda t: (sum(t in row[1:] for row in want), -t))
    ends = [row.index(eod) + 1 if eod in row else NEW for row in want]
    assert len(set(ends)) > 1 and min(ends) < NEW, (eod, ends)
    gen = _gen(cfg, params, batch=4, eod=eod, chunk=4)
    assert gen.generate(PROMPTS, NEW, stop_at_eod=True) == [row[:e] for row, e in zip(want, ends)]
    assert gen.generate(PROMPTS, NEW) == want  # stop_at_eod off: the token is one like any other
    budgets = [3, NEW, 10, 1]
    assert gen.generate(PROMPTS, budgets) == [row[:n] for row, n in zip(want, budgets)]
    chunks = list(gen.stream(PROMPTS, budgets))
    assert chunks[-1].shape[1] < 4 or (chunks[-1][[0, 2, 3]] == PAD).all()
    assert sum(c.shape[1] for c in chunks) == NEW  # ended with its longest row
    assert gen.compile_counts()["decode"] == 1


def test_a_halted_row_ends_within_one_chunk_and_the_others_go_on(imported):
    """The host ends a row (a stop string) by setting `halt`; the device learns it with the next chunk it
    dispatches, so the row gets at most one more chunk."""
    _, params, cfg = imported
    want = _gen(cfg, params, batch=4).generate(PROMPTS, NEW)
    gen = _gen(cfg, params, batch=4, chunk=4)
    halt = np.zeros(4, bool)
    rows = [[] for _ in PROMPTS]
    for chunk in gen.stream(PROMPTS, NEW, halt=halt):
        for r, c in zip(rows, chunk):
            r += [int(t) for t in c if t != PAD]
        halt[1] = len(rows[1]) >= 5
    assert 5 <= len(rows[1]) <= 5 + 2 * 4 and rows[1] == want[1][:len(rows[1])]
    assert [rows[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]


@pytest.mark.parametrize("batch", [1, 4])
def test_the_decode_program_updates_the_cache_in_place(imported, batch):
    """The compiled decode aliases every cache buffer to its output and copies none of them."""
    _, params, cfg = imported
    gen = _gen(cfg, params, batch=batch)
    hlo = gen.decode_hlo(PROMPTS[:batch])
    cache_shape = f"f32[{batch},{cfg.kv_heads},64,{cfg.head_dim}]"
    assert hlo.count(cache_shape) > 0
    aliased = hlo.split("input_output_alias={", 1)[1].split("\n", 1)[0]
    assert aliased.count("may-alias") + aliased.count("must-alias") >= 2 * cfg.num_layers, aliased[:300]
    # any copy of as many elements, in any layout (the old (batch, slot, head, dim) cache was copied transposed)
    size = batch * cfg.kv_heads * 64 * cfg.head_dim
    copies = [line for line in hlo.splitlines() if " copy(" in line
              and np.prod([int(d) for d in re.search(r"= \w+\[([\d,]*)\]", line).group(1).split(",") if d]) == size]
    assert not copies, copies[:3]


@pytest.mark.parametrize("sampling", [Sampling(temperature=0.8), Sampling(temperature=0.9, top_k=20, top_p=0.8),
                                      Sampling(top_p=0.7)], ids=["temperature", "top_k_top_p", "top_p"])
def test_sampled_tokens_are_the_same_on_every_layout(imported, sampling):
    """One seed samples the same tokens on one device, with heads over 2 devices, and with rows over 2 data
    devices as well; another seed samples others."""
    _, params, cfg = imported
    one = _gen(cfg, params, batch=4).generate(PROMPTS, 12, sampling, seed=7)
    assert _gen(cfg, params, batch=4, tp=2).generate(PROMPTS, 12, sampling, seed=7) == one
    mesh = jax.make_mesh((2, 1, 2), ("data", "stage", "model"), devices=jax.devices()[:4])
    assert Generator(cfg, params, mesh, batch=4, max_len=64).generate(PROMPTS, 12, sampling, seed=7) == one
    assert _gen(cfg, params, batch=4).generate(PROMPTS, 12, sampling, seed=8) != one


def test_decode_compiles_with_its_command_buffers_unless_xla_flags_set_them():
    from jax3d.inference.generate import DECODE_COMPILER_OPTIONS, decode_compiler_options

    assert decode_compiler_options({}) == DECODE_COMPILER_OPTIONS
    assert decode_compiler_options({"XLA_FLAGS": "--xla_gpu_autotune_level=4"}) == DECODE_COMPILER_OPTIONS
    assert decode_compiler_options({"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION"}) == {}
    # the option's value is one XLA parses: an unknown command-buffer kind fails to compile even on a CPU
    bad = jax.jit(lambda x: x + 1, compiler_options={"xla_gpu_enable_command_buffer": "FUSION,NOT_A_KIND"})
    with pytest.raises(Exception, match="not a valid enum value"):
        bad(np.ones(2))
    jax.jit(lambda x: x + 1, compiler_options=DECODE_COMPILER_OPTIONS)(np.ones(2))
