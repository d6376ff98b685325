"""Hugging Face import / export against transformers itself: logits of tiny random GPT-2 and BERT models
(odd shapes), exact round trips, and a model trained at (data, stage, model) = (2, 2, 2) read back by
transformers."""
import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jax3d.config import ConfigError  # noqa: E402
from jax3d.checkpoint.export import load_params  # noqa: E402
from jax3d.hf import export_hf, import_hf, read_safetensors_file  # noqa: E402
from jax3d.cli.convert_hf import main as convert_main  # noqa: E402
from jax3d.models import build_model  # noqa: E402
from jax3d.config import config_from_dict  # noqa: E402
from tests.hf_fixtures import causal_lm_gap, tiny_bert, tiny_gpt2  # noqa: E402
from jax3d.parallel.plan import Plan  # noqa: E402

TOL = 1e-4


def _jax3d_model(ckpt):
    params, meta = load_params(ckpt)
    cfg = config_from_dict(meta["config"]).model
    return build_model(cfg), params, cfg


GPT_SHAPES = {
    "3L-6heads-v1000": dict(n_layer=3, n_embd=48, n_head=6, vocab=1000),
    "1L-3heads-v517-erf": dict(n_layer=1, n_embd=36, n_head=3, vocab=517, act="gelu", n_inner=70),
}


@pytest.mark.parametrize("shape", list(GPT_SHAPES))
def test_gpt2_logits_and_round_trip(tmp_path, shape):
    hf = tiny_gpt2(str(tmp_path / "hf"), **GPT_SHAPES[shape])
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    model, params, cfg = _jax3d_model(str(tmp_path / "ckpt"))
    v = hf.config.vocab_size
    assert cfg.vocab_size % 128 == 0 and cfg.unpadded_vocab_size == v
    tokens = np.random.RandomState(0).randint(0, v, (3, 17)).astype(np.int32)
    assert max(causal_lm_gap(hf, model, params, tokens)) < TOL

    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    a = read_safetensors_file(str(tmp_path / "hf" / "model.safetensors"))
    b = read_safetensors_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # The weights are bit-exact above; a second torch model may pick other CPU kernels (attention implementation,
    # thread split), so its logits are held to the same tolerance against ours.
    assert max(causal_lm_gap(back.eval(), model, params, tokens)) < TOL


BERT_CASES = {
    "pretraining-postLN-3L-v301": ("BertForPreTraining", dict(num_hidden_layers=3, hidden_size=40, num_attention_heads=5,
                                                              intermediate_size=72, vocab_size=301)),
    "maskedlm-postLN-1L": ("BertForMaskedLM", dict(num_hidden_layers=1, hidden_size=24, num_attention_heads=3,
                                                    intermediate_size=50, vocab_size=211)),
    "megatron-preLN-3L-tanh": ("MegatronBertForPreTraining", dict(num_hidden_layers=3, hidden_size=40,
                                                                   num_attention_heads=5, intermediate_size=72,
                                                                   vocab_size=301, hidden_act="gelu_new")),
}


def _bert_batch(v, b=3, s=13, seed=1):
    rs = np.random.RandomState(seed)
    text = rs.randint(0, v, (b, s)).astype(np.int32)
    types = (np.arange(s)[None] >= rs.randint(3, s, (b, 1))).astype(np.int32)
    lengths = np.array([s, s - 4, 6])[:b]
    pad = (np.arange(s)[None] < lengths[:, None]).astype(np.int32)
    return {"text": text, "types": types, "padding_mask": pad}


@pytest.mark.parametrize("case", list(BERT_CASES))
def test_bert_logits_and_round_trip(tmp_path, case):
    arch, kw = BERT_CASES[case]
    hf = tiny_bert(str(tmp_path / "hf"), arch, kw)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    model, params, cfg = _jax3d_model(str(tmp_path / "ckpt"))
    assert cfg.post_layernorm == (arch != "MegatronBertForPreTraining")
    v = kw["vocab_size"]
    mb = _bert_batch(v)
    mlm, sop = (np.asarray(x) for x in model.forward(params, mb))
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(mb["text"], dtype=torch.long),
                 token_type_ids=torch.tensor(mb["types"], dtype=torch.long),
                 attention_mask=torch.tensor(mb["padding_mask"], dtype=torch.long))
    ref_mlm = (out.prediction_logits if hasattr(out, "prediction_logits") else out.logits).numpy()
    assert np.max(np.abs(mlm[..., :v] - ref_mlm)) < TOL
    if arch != "BertForMaskedLM":
        assert np.max(np.abs(sop - out.seq_relationship_logits.numpy())) < TOL
        # The training objective (MLM over masked positions + sentence order) equals HF's pre-training loss.
        rs = np.random.RandomState(2)
        loss_mask = (rs.rand(*mb["text"].shape) < 0.3).astype(np.int32) * mb["padding_mask"]
        labels = rs.randint(0, v, mb["text"].shape).astype(np.int32)
        is_random = np.array([0, 1, 1], np.int32)
        loss, _ = model.loss(params, {**mb, "labels": labels, "loss_mask": loss_mask, "is_random": is_random})
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor(mb["text"], dtype=torch.long),
                     token_type_ids=torch.tensor(mb["types"], dtype=torch.long),
                     attention_mask=torch.tensor(mb["padding_mask"], dtype=torch.long),
                     labels=torch.tensor(np.where(loss_mask == 1, labels, -100), dtype=torch.long),
                     next_sentence_label=torch.tensor(is_random, dtype=torch.long)).loss
        assert abs(float(loss) - float(ref)) < TOL

    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    a = read_safetensors_file(str(tmp_path / "hf" / "model.safetensors"))
    b = read_safetensors_file(str(tmp_path / "out" / "model.safetensors"))
    # BertForMaskedLM has no sentence-order head; the export adds jax3d's (freshly initialised) one.
    assert set(a) <= set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    cls = getattr(transformers, json.load(open(tmp_path / "out" / "config.json"))["architectures"][0])
    assert cls.__name__ == ("MegatronBertForPreTraining" if arch.startswith("Megatron") else "BertForPreTraining")
    _, info = cls.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_sharded_and_bf16_safetensors(tmp_path):
    """An index with several shards, stored in bf16, imports to the bf16 values upcast exactly."""
    hf = tiny_gpt2(str(tmp_path / "src"), n_layer=2, n_embd=32, n_head=4, vocab=300)
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path / "hf"), max_shard_size="20KB")
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    _, params, _ = _jax3d_model(str(tmp_path / "ckpt"))
    want = hf.transformer.h[1].mlp.c_fc.weight.float().detach().numpy()
    np.testing.assert_array_equal(params["blocks"]["mlp"]["up_kernel"][1], want)
    # That folder has no tokenizer files: generating from the import is refused, not done with the bundled
    # corpus's tokenizer (another vocabulary).
    from jax3d.config import ConfigError
    from jax3d.inference import generate_text
    with pytest.raises(ConfigError, match="imported without tokenizer files"):
        generate_text(str(tmp_path / "ckpt"), ["x"], 2)


def test_trained_at_222_exported_matches_transformers(tmp_path):
    """20 steps at (data, stage, model) = (2, 2, 2), saved, exported: transformers' logits equal jax3d's."""
    import jax

    from jax3d.checkpoint.checkpointer import Checkpointer
    from jax3d.train.step import build_steps
    from tests.helpers import random_text, tiny_config

    cfg, mesh_cfg, mesh = tiny_config(data=2, stage=2, model=2, micro=2, global_batch=8)
    cfg = cfg.replace(train={"save": str(tmp_path / "ckpt")}, optim={"lr": 3e-3})
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    state = steps.init_state(0)
    m = cfg.model
    for i in range(20):
        text = random_text(8, m.seq_length, m.vocab_size, seed=i).reshape(steps.accum_steps, -1, m.seq_length + 1)
        state, _ = steps.train_step(state, jax.device_put({"text": text}, steps.batch_sharding()))
    Checkpointer(cfg).save(20, state, {"consumed_samples": 160}, wait=True)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    model, params, _ = _jax3d_model(str(tmp_path / "ckpt"))
    tokens = random_text(2, m.seq_length - 1, m.vocab_size, seed=99)
    ours = np.asarray(model.logits(params, tokens))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.max(np.abs(ours - ref)) < TOL


@pytest.fixture(scope="module")
def bundled_run(tmp_path_factory):
    """A checkpoint of launch/train.py on the bundled corpus, whose tokenizer files only its cache holds."""
    from jax3d.cli.train import main as train_main
    d = tmp_path_factory.mktemp("bundled")
    assert train_main(["--preset", "gpt-tiny", "--train-iters", "1", "--global-batch-size", "8", "--micro-batch-size",
                       "1", "--seq-length", "32", "--eval-interval", "0", "--no-progress", "--save", str(d / "ckpt"),
                       "--log-dir", str(d / "log")]) == 0
    return d


def test_bundled_corpus_export_has_its_tokenizers_eos(bundled_run, tmp_path):
    """config.json's eos/bos are the end-of-document id of the bundled tokenizer, as transformers' own tokenizer
    reads it from the exported files (before, they were left out and transformers took 50256, past the 4096-token
    vocabulary, so generate never stopped), and transformers' pipeline runs on the export."""
    from jax3d.data import default_corpus
    out = str(tmp_path / "out")
    assert convert_main(["export", "--load", str(bundled_run / "ckpt"), "--hf-dir", out]) == 0
    eod = default_corpus(kind="gpt")[1].eod
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert hf_tok.eos_token_id == hf_tok.pad_token_id == eod == 0 and len(hf_tok) == hf.config.vocab_size
    assert hf.config.eos_token_id == hf.config.bos_token_id == hf.generation_config.eos_token_id == eod
    # A launch/train.py checkpoint's export runs in transformers' pipeline given only a length. The export's
    # generation_config.json has no max_length (transformers warned of it on every generate that passes
    # max_new_tokens), so the pipeline's default of 256 new tokens would run past this model's 32 positions.
    generated = transformers.pipeline("text-generation", model=out)("def main", max_new_tokens=8)[0]["generated_text"]
    assert generated.startswith("def main")


def test_bundled_corpus_checkpoint_keeps_its_tokenizer_files(bundled_run, tmp_path, monkeypatch):
    """The checkpoint holds the bundled tokenizer's files, and generation reads them there: with the corpus
    cache gone (another machine, or another Python, whose sources would train another tokenizer), nothing is
    rebuilt and the tokenizer is the one the run trained with."""
    from jax3d.data import default_corpus
    from jax3d.checkpoint.export import load_params
    from jax3d.checkpoint.tokenizer import checkpoint_tokenizer
    ck = bundled_run / "ckpt"
    assert sorted(os.listdir(ck / "tokenizer")) == ["merges.txt", "vocab.json"]
    trained = default_corpus(kind="gpt")[1]
    empty = tmp_path / "no-cache"
    empty.mkdir()
    monkeypatch.setenv("JAX3D_CACHE", str(empty))
    tok = checkpoint_tokenizer(load_params(str(ck))[1])
    assert os.listdir(empty) == []
    text = "def main(argv=None):\n    return 0\n"
    assert tok.tokenize(text) == trained.tokenize(text) and tok.vocab_size == trained.vocab_size
    # Moved (or copied to another machine): the recorded paths are gone, and the copies in the checkpoint serve.
    moved = tmp_path / "moved"
    shutil.copytree(ck, moved)
    os.rename(ck / "tokenizer", tmp_path / "away")
    try:
        tok = checkpoint_tokenizer(load_params(str(moved))[1])
    finally:
        os.rename(tmp_path / "away", ck / "tokenizer")
    assert tok.tokenize(text) == trained.tokenize(text) and os.listdir(empty) == []


def test_hf_export_files_have_a_plain_writes_mode(bundled_run, tmp_path):
    """model.safetensors is readable by others like config.json and the tokenizer files (it was 0600 before)."""
    import stat
    old = os.umask(0o022)
    try:
        export_hf(str(bundled_run / "ckpt"), str(tmp_path / "out"))
    finally:
        os.umask(old)
    mode = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in (tmp_path / "out").iterdir()}
    assert set(mode.values()) == {"0o644"} and "model.safetensors" in mode, mode


def test_hf_folders_are_refused_inside_a_checkpoint_directory(bundled_run):
    """An HF folder or an imported checkpoint named by a number directly in a checkpoint directory would be read
    as a step of it, which --load then fails on: refused, and the directory keeps its steps."""
    from jax3d.checkpoint.read import list_steps
    ck = str(bundled_run / "ckpt")
    steps = list_steps(ck)
    with pytest.raises(ConfigError, match="--hf-dir .*98 would be read as step 98 of the checkpoint in"):
        export_hf(ck, os.path.join(ck, "98"))
    hf = os.path.join(str(bundled_run), "hf")
    export_hf(ck, hf)
    with pytest.raises(ConfigError, match="--save .*97 would be read as step 97 of the checkpoint in"):
        import_hf(hf, os.path.join(ck, "97"))
    assert list_steps(ck) == steps and load_params(ck)[1]["step"] == steps[-1]


def _no_files(d):
    return not os.path.exists(d) or not os.listdir(d)


def test_bad_inputs_one_sentence_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_layer": 1, "n_embd": 8,
                                                      "n_head": 2, "vocab_size": 10, "n_positions": 8}))
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    other = tmp_path / "qwen"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    no_width = tmp_path / "no_width"
    no_width.mkdir()
    (no_width / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_layer": 1,
                                                        "n_head": 2, "vocab_size": 10, "n_positions": 8}))
    wrong = {}  # config.json values of the wrong type: tracebacks before
    for name, text in (("a_list", "[1, 2]"), ("text_layers", json.dumps({"architectures": ["GPT2LMHeadModel"],
                       "n_layer": "2", "n_embd": 8, "n_head": 2, "vocab_size": 10, "n_positions": 8})),
                       ("no_layers", json.dumps({"architectures": ["GPT2LMHeadModel"], "n_layer": 0, "n_embd": 8,
                                                 "n_head": 2, "vocab_size": 10, "n_positions": 8}))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
        wrong[str(tmp_path / name)] = {"a_list": "holds a JSON list, not an object",
                                       "text_layers": "gives n_layer '2'; it must be a whole number",
                                       "no_layers": "gives n_layer 0; it must be a whole number"}[name]
    cut = tmp_path / "cut"
    tiny_gpt2(str(cut), n_layer=1, n_embd=8, n_head=2, vocab=10)
    weights = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(weights[: len(weights) - 100])
    capsys.readouterr()  # transformers' progress bars
    cases = {str(tmp_path / "empty"): "has no config.json", str(tmp_path / "nope"): "is not a directory",
             str(pickled): "convert them to model.safetensors", str(other): "Qwen2ForCausalLM",
             str(cut): "model.safetensors is not a complete safetensors file",
             str(no_width): "lacks 'n_embd', which its architecture needs; add it", **wrong}
    for src, words in cases.items():
        out = str(tmp_path / "ckpt")
        assert convert_main(["import", "--hf-dir", src, "--save", out]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and len(err.strip().splitlines()) == 1, err
        assert _no_files(out)
    assert convert_main(["export", "--load", str(tmp_path / "none"), "--hf-dir", str(tmp_path / "o")]) == 2
    assert "--load" in capsys.readouterr().err and _no_files(str(tmp_path / "o"))
    (tmp_path / "a_file").write_text("kept")
    assert convert_main(["export", "--load", str(tmp_path / "none"), "--hf-dir", str(tmp_path / "a_file")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err and (tmp_path / "a_file").read_text() == "kept"


def test_export_of_inexpressible_model_names_the_field():
    from jax3d.hf import hf_config_from_model
    from tests.helpers import tiny_model
    with pytest.raises(ConfigError, match="post_layernorm"):
        hf_config_from_model(tiny_model(post_layernorm=True))
    with pytest.raises(ConfigError, match="embedding_layernorm"):
        hf_config_from_model(tiny_model(model_type="bert", embedding_layernorm=True))


def test_train_py_fine_tunes_an_import_from_transformers_loss(tmp_path):
    """train.py --load of an imported GPT-2 (no shape flags) starts at exactly transformers' loss on its first
    batch, at (data, stage, model) = (4, 1, 2), and its checkpoint exports again."""
    from tests.hf_fixtures import fine_tune_import, gpt2_folder_with_tokenizer

    hf, tok = gpt2_folder_with_tokenizer(tmp_path / "hf", act="gelu")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    td = str(tmp_path / "ckpt" / "tokenizer")
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", f"{td}/vocab.json", "--merge-file", f"{td}/merges.txt"]
    assert fine_tune_import(tmp_path, hf, tok, flags, (2, 1)) < TOL
    _, _, cfg = _jax3d_model(str(tmp_path / "tuned"))
    assert cfg.activation == "gelu_erf" and cfg.unpadded_vocab_size == tok.vocab_size
    shutil.rmtree(tmp_path / "ckpt")  # the fine-tune keeps its own tokenizer files (it read the base's)
    export_hf(str(tmp_path / "tuned"), str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "generation_config.json", "merges.txt",
                                                    "model.safetensors", "special_tokens_map.json",
                                                    "tokenizer_config.json", "vocab.json"]


def test_jax3d_bert_exports_to_megatron_bert(tmp_path):
    """jax3d's own pre-LN BERT, saved from (data, stage, model) = (2, 1, 4), is MegatronBertForPreTraining."""
    import jax

    from jax3d.checkpoint.checkpointer import Checkpointer
    from jax3d.train.step import build_steps
    from tests.helpers import tiny_config

    cfg, mesh_cfg, mesh = tiny_config(data=2, model=4, micro=2, global_batch=4,
                                      model_kw=dict(model_type="bert", num_layers=3))
    cfg = cfg.replace(train={"save": str(tmp_path / "ckpt")})
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    state = steps.init_state(5)
    # Random biases and norms too, so a misplaced tensor shows.
    params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(a.size), a.shape), state.params)
    Checkpointer(cfg).save(1, state.replace(params=params), {"consumed_samples": 4}, wait=True)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    hf, info = transformers.MegatronBertForPreTraining.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model, params, _ = _jax3d_model(str(tmp_path / "ckpt"))
    mb = _bert_batch(cfg.model.vocab_size, s=16)
    mlm, sop = (np.asarray(x) for x in model.forward(params, mb))
    with torch.no_grad():
        out = hf.eval()(input_ids=torch.tensor(mb["text"], dtype=torch.long),
                        token_type_ids=torch.tensor(mb["types"], dtype=torch.long),
                        attention_mask=torch.tensor(mb["padding_mask"], dtype=torch.long))
    assert np.max(np.abs(mlm - out.prediction_logits.numpy())) < TOL
    assert np.max(np.abs(sop - out.seq_relationship_logits.numpy())) < TOL
