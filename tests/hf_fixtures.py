"""Tiny random Hugging Face models for the import / export / generation tests (transformers and torch)."""
import torch
import transformers


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

    text = ["def add(a, b):\n    return a + b\n", "the quick brown fox jumps over the lazy dog\n"] * 50
    train_tokenizer([], str(path), "bpe", vocab_size=300, min_frequency=1, texts=iter(text))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(path / "vocab.json"), merge_file=str(path / "merges.txt"))
    model = tiny_gpt2(str(path), vocab=tok.vocab_size, n_positions=64, seed=seed, **kw)
    return model, tok
