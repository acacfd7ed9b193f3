"""`recover-hsdp tokenizer`: train a sentencepiece tokenizer on a corpus, or inspect one.

    recover-hsdp tokenizer train --input FILE... --vocab-size N --out PREFIX
                                 [--model-type bpe|unigram] [--text-field text] [--max-lines N]
    recover-hsdp tokenizer encode [--model M] TEXT      # ids and pieces, then the round trip
    recover-hsdp tokenizer info [--model M]             # vocab size, special ids, sha256

FILE: .jsonl (field --text-field, default "text") or plain text, optionally .gz/.xz. The model
goes to PREFIX.model. The shipped model was made with
    recover-hsdp tokenizer train --input recover_hsdp/data/embedded/corpus.jsonl.xz \
        --vocab-size 4096 --out recover_hsdp/data/embedded/tokenizer
"""
from __future__ import annotations

import argparse
import sys
import time

from recover_hsdp.tools._args import subparser_names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="recover-hsdp tokenizer", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a model from text files")
    t.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="text files: .jsonl (see --text-field) or plain text, optionally .gz/.xz")
    t.add_argument("--vocab-size", type=int, required=True, metavar="N",
                   help="pieces in the model (the model's vocab_size)")
    t.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.model")
    t.add_argument("--model-type", default="bpe", choices=("bpe", "unigram"),
                   help="sentencepiece model type (default: bpe)")
    t.add_argument("--text-field", default="text", help="JSON field of .jsonl inputs")
    t.add_argument("--max-lines", type=int, default=None, help="train on the first N lines only")
    t.add_argument("--threads", type=int, default=2, help="trainer threads (default: 2)")
    e = sub.add_parser("encode", help="encode a text and show the round trip")
    e.add_argument("text", help="the text to encode")
    e.add_argument("--model", default=None, help="default: the embedded tokenizer")
    i = sub.add_parser("info", help="vocab size, special ids, sha256")
    i.add_argument("--model", default=None, help="default: the embedded tokenizer")
    return p


def subcommands() -> list[str]:
    """What `recover-hsdp tokenizer` dispatches (recover_hsdp.cli.command_paths)."""
    return subparser_names(_parser())


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    # imported past the parse: `--help` and a usage error do not pay for torch
    from recover_hsdp.data.tokenizer import Tokenizer, train_tokenizer

    if args.cmd == "train":
        t0 = time.perf_counter()
        try:
            out = train_tokenizer(args.input, args.vocab_size, args.out,
                                  model_type=args.model_type, text_field=args.text_field,
                                  max_lines=args.max_lines, num_threads=args.threads)
        except (FileNotFoundError, KeyError, ValueError, RuntimeError) as exc:
            print(f"recover-hsdp tokenizer train: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        tok = Tokenizer(out)
        print(f"tokenizer: wrote {out} ({out.stat().st_size / 1e3:.0f} KB), vocab "
              f"{tok.vocab_size}, {time.perf_counter() - t0:.1f} s, sha256 {tok.sha256[:16]}")
        return 0
    tok = Tokenizer(args.model)
    if args.cmd == "encode":
        ids = tok.encode(args.text)
        print(f"{len(ids)} tokens: {ids}")
        print("pieces:", [tok.sp.id_to_piece(i) for i in ids])
        back = tok.decode(ids)
        print(f"round trip {'exact' if back == args.text else 'DIFFERS'}: {back!r}")
        return 0
    print(f"model {tok.path}\nvocab_size {tok.vocab_size}\nbos_id {tok.bos_id}\n"
          f"eos_id {tok.eos_id}\nunk_id {tok.sp.unk_id()}\nsha256 {tok.sha256}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
