#!/usr/bin/env python3
"""Train the tiny models' byte-level BPE on a text file and print or save it (JSON: tokens, merges).

The synthetic writer trains the same tokenizer on the fly from models/tokenizer-corpus.txt (it takes
well under a second); this script is for inspecting it or trying other corpora/sizes.

  python scripts/train_tokenizer.py                       # summary of the shipped tokenizer
  python scripts/train_tokenizer.py --vocab-size 2048 --corpus my.txt -o bpe.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import specter_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specter_gguf.synthetic.bpe import CORPUS_PATH, train_bpe  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=CORPUS_PATH)
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--min-count", type=int, default=2)
    ap.add_argument("-o", "--output", type=Path, default=None, help="write the tokenizer as JSON")
    args = ap.parse_args(argv)

    tok = train_bpe(args.corpus.read_text(encoding="utf-8"), args.vocab_size, args.min_count)
    print(f"{len(tok.tokens)} tokens: 256 bytes + {len(tok.merges)} merges + {len(tok.specials)} specials")
    print("first merges:", ", ".join(tok.merges[:20]))
    if args.output:
        args.output.write_text(tok.to_json(), encoding="utf-8")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
