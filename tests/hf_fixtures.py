"""Tiny random Hugging Face models for the import / export / generation tests (transformers and torch)."""
import torch
import transformers
from jax3d.parallel.plan import Plan

TEXT = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.\n"] * 50  # to train tokenizers on


def _perturb(model, seed=0):
    """Random values in every parameter (HF inits layer norms to 1 / 0 and biases to 0, which would hide
    a wrongly mapped tensor)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def tiny_gpt2(path, n_layer=3, n_embd=48, n_head=6, vocab=1000, n_positions=40, act="gelu_new", n_inner=None, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab,
                                  n_positions=n_positions, activation_function=act, n_inner=n_inner,
                                  bos_token_id=0, eos_token_id=0)
    model = _perturb(transformers.GPT2LMHeadModel(cfg), seed)
    model.save_pretrained(path)
    return model


def tiny_bert(path, arch, kw, seed=0):
    torch.manual_seed(seed)
    conf_cls = transformers.MegatronBertConfig if arch.startswith("Megatron") else transformers.BertConfig
    cfg = conf_cls(max_position_embeddings=32, type_vocab_size=2, **kw)
    model = _perturb(getattr(transformers, arch)(cfg), seed)
    model.save_pretrained(path)
    return model


def gpt2_folder_with_tokenizer(path, seed=0, **kw):
    """A tiny random GPT-2 saved with a byte-level BPE vocab.json / merges.txt trained on a little text."""
    from jax3d.data.tokenizers import build_tokenizer, train_tokenizer

    train_tokenizer([], str(path), "bpe", vocab_size=300, min_frequency=1, texts=iter(TEXT))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(path / "vocab.json"), merge_file=str(path / "merges.txt"))
    model = tiny_gpt2(str(path), vocab=tok.vocab_size, n_positions=64, seed=seed, **kw)
    return model, tok


def jax3d_checkpoint_with_tokenizer(path, model_type, seed=0):
    """A checkpoint as launch/train.py saves one (not an import: no `unpadded_vocab_size`), with a tokenizer of
    an odd size trained on a little text, so that its embedding ends in padding rows. Returns (checkpoint
    directory, jax3d tokenizer)."""
    import jax

    from jax3d.data.tokenizers import build_tokenizer, train_tokenizer
    from jax3d.hf.mapping import padded
    from jax3d.checkpoint.checkpointer import Checkpointer
    from jax3d.train.step import build_steps
    from tests.helpers import tiny_config

    model_kw = dict(model_type=model_type)
    if model_type == "llama":  # a Llama with a SentencePiece tokenizer.model, trained as Llama's is
        tok_type, files = "GPTSentencePieceTokenizer", {"tokenizer_model": sentencepiece_model(path / "tok")}
        model_kw = dict(model_type="gpt", normalization="rmsnorm", swiglu=True, use_rotary_position_embeddings=True,
                        add_position_embedding=False, untie_embeddings_and_output_weights=True, add_bias_linear=False)
    else:
        kind, tok_type = ("bpe", "GPT2BPETokenizer") if model_type == "gpt" else ("wordpiece", "BertWordPieceLowerCase")
        files = train_tokenizer([], str(path / "tok"), kind, vocab_size=300, min_frequency=1, texts=iter(TEXT))
    tok = build_tokenizer(tok_type, **files)
    assert tok.vocab_size % 128, tok.vocab_size  # or there would be no padding rows to cut
    cfg, mesh_cfg, mesh = tiny_config(model_kw=dict(**model_kw, vocab_size=padded(tok.vocab_size, 128)))
    cfg = cfg.replace(train={"save": str(path / "ckpt")}, data={"tokenizer_type": tok_type, **files})
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    state = steps.init_state(seed)
    # Random biases and norms too, so that a misplaced tensor shows.
    params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(a.size), a.shape), state.params)
    Checkpointer(cfg, tokenizer=tok).save(1, state.replace(params=params), {"consumed_samples": 0}, wait=True)
    return str(path / "ckpt"), tok


def sentencepiece_model(directory, llama_style: bool = True) -> str:
    """A SentencePiece BPE `tokenizer.model` trained on TEXT: as Llama's is (no normalization, byte fallback), or
    with SentencePiece's defaults (NFKC with runs of whitespace made one space, unknown characters as <unk>)."""
    import sentencepiece

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "text.txt").write_text("".join(TEXT))
    style = dict(normalization_rule_name="identity", remove_extra_whitespaces=False, byte_fallback=True,
                 split_digits=True, allow_whitespace_only_pieces=True) if llama_style else {}
    sentencepiece.SentencePieceTrainer.train(input=str(directory / "text.txt"), model_prefix=str(directory / "tokenizer"),
                                             vocab_size=300, model_type="bpe", hard_vocab_limit=False,
                                             minloglevel=2, **style)
    return str(directory / "tokenizer.model")


def tiny_llama(path, n_layer=3, hidden=64, heads=8, kv_heads=2, ffn=96, vocab=300, positions=64, theta=10000.0,
               tied=False, rope_scaling=None, seed=0, arch="LlamaForCausalLM", **kw):
    """A tiny random Llama (or Mistral) saved with transformers; `rope_scaling` as config.json holds it."""
    torch.manual_seed(seed)
    conf = transformers.MistralConfig if arch.startswith("Mistral") else transformers.LlamaConfig
    cfg = conf(num_hidden_layers=n_layer, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
               intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=positions, rope_theta=theta,
               tie_word_embeddings=tied, rope_scaling=rope_scaling, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
               **({"sliding_window": None} if arch.startswith("Mistral") else {}), **kw)
    model = _perturb(getattr(transformers, arch)(cfg), seed)
    model.save_pretrained(path)
    return model


def llama_tokenizer_json(path, vocab_size=300):
    """A byte-level BPE `tokenizer.json` (tokenizers) trained on a little text, with Llama's <s> and </s>; returns
    its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1,
                                                      special_tokens=["<unk>", "<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    return tok.get_vocab_size()


def llama_folder_with_tokenizer(path, seed=0, **kw):
    """A tiny random Llama whose vocabulary is a tokenizer.json's, both in `path`: an HF folder as downloaded."""
    path.mkdir(parents=True, exist_ok=True)
    vocab = llama_tokenizer_json(path)
    return tiny_llama(str(path), vocab=vocab, seed=seed, **kw), vocab


def causal_lm_gap(hf, model, params, tokens) -> tuple[float, float]:
    """(largest logit difference, loss difference) between a jax3d GPT and the transformers causal LM it was
    imported from, on `tokens` (batch, seq), in fp32. The training loss leaves the vocabulary's padding columns
    out, so it is transformers' loss too."""
    import numpy as np

    v = hf.config.vocab_size
    ours = np.asarray(model.logits(params, tokens))[..., :v]
    loss, _ = model.loss(params, {"text": tokens})
    ids = torch.tensor(tokens, dtype=torch.long)
    with torch.no_grad():
        ref = hf(ids).logits.numpy()
        ref_loss = hf(ids, labels=ids).loss
    return float(np.max(np.abs(ours - ref))), abs(float(loss) - float(ref_loss))


def fine_tune_import(tmp_path, hf, tok, tokenizer_flags: list[str], layout: tuple[int, int]) -> float:
    """Writes a little of TEXT through `tok` as Megatron data, fine-tunes the import in tmp_path/ckpt with
    launch/train.py for 2 steps (8 samples of 32 tokens, dropout off, tensor x pipeline `layout`) into
    tmp_path/tuned, and returns how far its first logged loss is from transformers' on the same batch."""
    import json

    import numpy as np

    from jax3d.cli.train import main as train_main
    from jax3d.data import build_gpt_datasets
    from jax3d.data.indexed import IndexedDatasetBuilder

    prefix = str(tmp_path / "data")
    b = IndexedDatasetBuilder(prefix, np.uint16)
    rs = np.random.RandomState(0)
    for _ in range(40):  # text, not random ids: train.py checks that the data reads back through the tokenizer
        b.add_item(tok.tokenize("".join(rs.choice(TEXT, rs.randint(2, 6)))))
        b.end_document()
    b.finalize()
    argv = ["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "tuned"), "--data-path", prefix,
            *tokenizer_flags, "--train-iters", "2", "--global-batch-size", "8", "--micro-batch-size", "1",
            "--seq-length", "32", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--tensor-model-parallel-size", str(layout[0]), "--pipeline-model-parallel-size", str(layout[1]),
            "--eval-interval", "0", "--log-interval", "1", "--no-progress", "--log-dir", str(tmp_path / "log"),
            "--seed", "1234"]  # the reference's (an import records seed 0)
    assert train_main(argv) == 0
    with open(tmp_path / "log" / "metrics.jsonl") as f:
        first = next(r for r in map(json.loads, f) if r.get("step") == 1)
    ds = build_gpt_datasets([prefix], "969,30,1", 32, (16, 0, 0), 1234)[0]
    text = torch.tensor(np.stack([ds[i]["text"] for i in range(8)]), dtype=torch.long)
    with torch.no_grad():
        return abs(first["loss"] - float(hf(text, labels=text).loss))
