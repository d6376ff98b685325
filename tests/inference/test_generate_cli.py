"""launch/generate.py: the streamed text of one prompt against the library's batch path and the JSONL output,
stop strings cut where the text first holds them, per-prompt fields of --input-jsonl, and bad input refused
with one sentence and exit 2. Host-side text (jax3d.inference.text) against hand-made tokens."""
import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jax3d.hf import import_hf  # noqa: E402
from jax3d.inference import generate_text  # noqa: E402
from jax3d.inference.generate import PAD  # noqa: E402
from jax3d.inference.text import Completions  # noqa: E402
from tests.hf_fixtures import gpt2_folder_with_tokenizer  # noqa: E402
from tests.helpers import ROOT, subprocess_env  # noqa: E402

PROMPT, OTHER = "def add(a, b):", "the fox"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("gencli")
    hf, _ = gpt2_folder_with_tokenizer(d / "hf")
    import_hf(str(d / "hf"), str(d / "ckpt"))
    return str(d / "ckpt")


def _run(*argv):
    return subprocess.run([sys.executable, f"{ROOT}/launch/generate.py", "--cpu-devices", "2", *argv],
                          capture_output=True, text=True, env=subprocess_env(), timeout=300)


def test_streamed_text_equals_the_batch_path_and_stops_at_the_stop_string(ckpt, tmp_path):
    text = generate_text(ckpt, [PROMPT], 24)[0]
    stop = next(text[i:i + 2] for i in range(len(text) // 3, len(text)) if text[i:i + 2].strip())
    cut = text[:text.index(stop)]
    assert generate_text(ckpt, [PROMPT], 24, stop=(stop,)) == [cut]
    r = _run("--load", ckpt, "--prompt", PROMPT, "--greedy", "--max-new-tokens", "24", "--stop", stop)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == PROMPT + cut + "\n"
    assert "compiled prefill 1x and decode 1x" in r.stderr

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(o) for o in [{"prompt": PROMPT}, {"prompt": PROMPT, "stop": stop},
                                                      {"prompt": OTHER, "max_new_tokens": 5}]) + "\n\n")
    r = _run("--load", ckpt, "--input-jsonl", str(src), "--output-jsonl", str(dst), "--greedy",
             "--max-new-tokens", "24", "--batch-size", "2")
    assert r.returncode == 0 and r.stdout == "", r.stderr[-2000:]
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert rows == [{"prompt": PROMPT, "completion": text, "finish_reason": "length"},
                    {"prompt": PROMPT, "completion": cut, "finish_reason": "stop"},
                    {"prompt": OTHER, "completion": generate_text(ckpt, [OTHER], 5)[0], "finish_reason": "length"}]
    assert "compiled prefill 1x and decode 1x" in r.stderr  # two batches of one bucket


@pytest.mark.parametrize("flag, kwargs", [("--kv-cache-dtype", {"cache_dtype": "float8_e4m3fn"}),
                                          ("--quantization", {"weight_dtype": "float8_e4m3fn"})],
                         ids=["kv-cache", "weights"])
def test_fp8_flags_print_the_librarys_fp8_text(ckpt, flag, kwargs):
    """--kv-cache-dtype fp8 and --quantization fp8 stream what the library generates with a float8_e4m3fn cache
    or fp8 GEMM weights (tests/inference/test_generate.py and tests/models/test_quantized.py check those), with heads over 2
    devices; an unknown type is refused by the parser."""
    want = generate_text(ckpt, [PROMPT], 16, **kwargs)[0]
    r = _run("--load", ckpt, "--prompt", PROMPT, "--greedy", "--max-new-tokens", "16", flag, "fp8",
             "--tensor-model-parallel-size", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == PROMPT + want + "\n"
    r = _run("--load", ckpt, "--prompt", PROMPT, flag, "int4")
    assert r.returncode == 2 and flag in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("lines, flags, words", [
    ("", [], "holds no prompt"),
    ('{"prompt": "x"}\n{"text": "y"}\n', [], 'line 2 has no "prompt" text'),
    ('{"prompt": "x"\n', [], "line 1 is not valid JSON"),
    ('{"prompt": "x", "max_new_tokens": 99}\n', [], '"max_new_tokens" 99 must be a whole number from 1 to'),
    ('{"prompt": "x", "stop": 3}\n', [], '"stop" must be a string or a list of strings'),
    ('{"prompt": "x"}\n', ["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
    ('{"prompt": "x"}\n', ["--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
    ('{"prompt": "x"}\n', ["--stop", ""], "--stop was given an empty string"),
], ids=["empty", "no-prompt", "bad-json", "budget", "stop-type", "top-p-high", "top-p-zero", "empty-stop"])
def test_bad_input_is_one_sentence_and_exit_2(tmp_path, lines, flags, words):
    src = tmp_path / "in.jsonl"
    src.write_text(lines)
    r = _run("--load", str(tmp_path / "no-ckpt"), "--input-jsonl", str(src), *flags)
    assert r.returncode == 2 and r.stdout == "", r.stderr[-500:]
    assert r.stderr.startswith("error: ") and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


class _Letters:
    """A tokenizer of one letter a token (ids 0-25), 99 a byte that would end a character only with the next."""

    def detokenize(self, ids):
        return "".join("\ufffd" if t == 99 else chr(97 + t) for t in ids)


def _ids(s):
    return [ord(c) - 97 for c in s]


def test_completions_cut_at_stop_strings_hold_back_their_start_and_end_at_eod():
    c = Completions(_Letters(), [["xyz"], [], ["q"]], eod=50)
    c.add(np.array([_ids("abx"), _ids("abc"), [0, 99, PAD]]))
    assert [c.settled(i) for i in range(3)] == ["ab", "abc", "a"]  # "x" may start "xyz"; a half character waits
    assert not c.halt.any()
    c.add(np.array([_ids("yzd"), _ids("d") + [50, PAD], _ids("bqr")]))
    assert [c.text(i) for i in range(3)] == ["ab", "abcd", "a\ufffdb"]
    assert c.halt.tolist() == [True, False, True] and c.finish == ["stop", "eod", "stop"]
    c.add(np.array([_ids("efg"), _ids("efg"), _ids("efg")]))  # rows the device had not yet halted: dropped
    c.close()
    assert [c.settled(i) for i in range(3)] == ["ab", "abcd", "a\ufffdb"] and c.finish == ["stop", "eod", "stop"]
