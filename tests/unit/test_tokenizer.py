"""The shipped tokenizer round-trips text; `recover-hsdp tokenizer train` makes a working model."""
from __future__ import annotations

import json

import pytest

from recover_hsdp.data.tokenizer import EMBEDDED_TOKENIZER, Tokenizer, training_sentences
from recover_hsdp.tools import tokenizer as tokenizer_cli

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

SAMPLES = [
    "To be, or not to be: that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "In the beginning God created the heaven and the earth.",
    "  indented   spaces,\n\nblank lines, digits 1611 and 2048, tabs\tand unicode: café — Æsir ✓",
    "",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer()


@pytest.mark.parametrize("text", SAMPLES)
def test_embedded_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_embedded_model_facts(tok):
    assert tok.path == EMBEDDED_TOKENIZER
    assert tok.vocab_size == 4096
    assert (tok.sp.unk_id(), tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.sp.unk_id() not in tok.encode(SAMPLES[2])      # byte fallback, never <unk>
    assert len(tok.encode(SAMPLES[0])) < len(SAMPLES[0]) / 2.5  # it actually compresses
    assert tok.encode_batch(SAMPLES[:2]) == [tok.encode(s) for s in SAMPLES[:2]]


def test_training_sentences_cut_long_lines(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps({"text": "Short line.\n\n" + "Word word. " * 2000}) + "\n")
    lines = list(training_sentences([p]))
    assert lines[0] == "Short line."
    assert all(len(s.encode()) <= 4096 for s in lines) and len(lines) > 3
    assert "".join(lines[1:]).replace(" ", "") == ("Word word. " * 2000).replace(" ", "")


def test_cli_train_then_round_trip(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    body = "\n".join(SAMPLES[:2] * 40 + [f"line {i}: the quick brown fox." for i in range(200)])
    text.write_text(body)
    jl = tmp_path / "more.jsonl"
    jl.write_text(json.dumps({"body": "Jumps over the lazy dog.\nAgain and again."}) + "\n")
    out = tmp_path / "tok" / "m"
    assert tokenizer_cli.main(["train", "--input", str(text), "--vocab-size", "320",
                               "--out", str(out)]) == 0
    assert "vocab 320" in capsys.readouterr().out
    t = Tokenizer(str(out) + ".model")
    assert t.vocab_size == 320
    for s in SAMPLES:
        assert t.decode(t.encode(s)) == s
    # same inputs, same model bytes
    assert tokenizer_cli.main(["train", "--input", str(text), "--vocab-size", "320",
                               "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again.model").read_bytes() == (out.parent / "m.model").read_bytes()
    # a JSONL input with a custom field; a bad field is a one-line error, not a traceback
    assert tokenizer_cli.main(["train", "--input", str(jl), str(text), "--text-field", "body",
                               "--vocab-size", "320", "--out", str(tmp_path / "j")]) == 0
    assert tokenizer_cli.main(["train", "--input", str(jl), "--vocab-size", "300",
                               "--out", str(tmp_path / "k")]) == 1
    assert "KeyError" in capsys.readouterr().err
    assert tokenizer_cli.main(["encode", "To be"]) == 0
    assert "round trip exact" in capsys.readouterr().out
