"""The tiny models' tokenizer: a small byte-level BPE (GPT-2 byte-to-unicode alphabet, ``pre = qwen2``) trained
by :func:`train_bpe` on ``models/tokenizer-corpus.txt``, with the tokenizer.* keys a GGUF file carries for it."""

from __future__ import annotations

import functools
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from specter_gguf.chat import CHATML_TEMPLATE
from specter_gguf.errors import SpecterError

CORPUS_PATH = Path(__file__).resolve().parents[2] / "models" / "tokenizer-corpus.txt"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Approximation of Qwen2's pre-tokenizer regex with the `re` module (\p{L} -> [^\W\d_], \p{N} -> \d).
# Merges are learned inside these pieces; llama.cpp applies its own (exact) qwen2 split at run time.
_PRETOKENIZE = re.compile(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|(?:[^\r\n\w]|_)?[^\W\d_]+"
    r"|\d"
    r"| ?(?:[^\s\w]|_)+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


@functools.lru_cache(maxsize=None)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@dataclass(frozen=True)
class BPETokenizer:
    """A byte-level BPE vocabulary: tokens (id order), merges (rank order) and special tokens."""

    tokens: tuple[str, ...]
    merges: tuple[str, ...]
    specials: tuple[str, ...] = SPECIAL_TOKENS

    def gguf_metadata(self) -> dict[str, tuple[Any, Any, Any]]:
        """tokenizer.* keys as {key: (value, GGUFValueType, array sub-type)}."""
        import gguf

        T = gguf.GGUFValueType
        ttype = [int(gguf.TokenType.CONTROL) if t in self.specials else int(gguf.TokenType.NORMAL)
                 for t in self.tokens]
        eos = self.tokens.index("<|endoftext|>")
        return {
            "tokenizer.ggml.model": ("gpt2", T.STRING, None),
            "tokenizer.ggml.pre": ("qwen2", T.STRING, None),
            "tokenizer.ggml.tokens": (list(self.tokens), T.ARRAY, T.STRING),
            "tokenizer.ggml.token_type": (ttype, T.ARRAY, T.INT32),
            "tokenizer.ggml.merges": (list(self.merges), T.ARRAY, T.STRING),
            "tokenizer.ggml.eos_token_id": (eos, T.UINT32, None),
            "tokenizer.ggml.bos_token_id": (eos, T.UINT32, None),
            "tokenizer.ggml.padding_token_id": (eos, T.UINT32, None),
            "tokenizer.ggml.add_bos_token": (False, T.BOOL, None),
            "tokenizer.chat_template": (CHATML_TEMPLATE, T.STRING, None),
        }

    def to_json(self) -> str:
        return json.dumps({"tokens": list(self.tokens), "merges": list(self.merges),
                           "specials": list(self.specials)}, ensure_ascii=False, indent=0)


def train_bpe(text: str, vocab_size: int = 1024, min_count: int = 2,
              specials: Sequence[str] = SPECIAL_TOKENS) -> BPETokenizer:
    """Train byte-level BPE merges on `text` until `vocab_size` tokens (256 bytes + merges + specials)
    or no pair occurs `min_count` times. Deterministic (ties broken by the pair's text)."""
    for sp in specials:  # special tokens are not learned from
        text = text.replace(sp, "\n")
    b2u = bytes_to_unicode()
    words = Counter("".join(b2u[b] for b in piece.encode("utf-8"))
                    for piece in _PRETOKENIZE.findall(text))
    syms: list[list[str]] = [list(w) for w in words]
    freq: list[int] = list(words.values())
    pairs: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for wi, s in enumerate(syms):
        for a, b in zip(s, s[1:]):
            pairs[(a, b)] += freq[wi]
            where[(a, b)].add(wi)

    base = [b2u[b] for b in sorted(b2u, key=lambda b: ord(b2u[b]))]
    n_merges = vocab_size - len(base) - len(specials)
    merges: list[tuple[str, str]] = []
    vocab = set(base)
    new_tokens: list[str] = []
    while len(merges) < n_merges and pairs:
        best, count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if count < min_count:
            break
        merged = best[0] + best[1]
        merges.append(best)
        if merged not in vocab:
            vocab.add(merged)
            new_tokens.append(merged)
        for wi in list(where.pop(best, ())):
            s, f = syms[wi], freq[wi]
            for a, b in zip(s, s[1:]):  # remove this word's old pairs
                pairs[(a, b)] -= f
                if pairs[(a, b)] <= 0:
                    del pairs[(a, b)]
                where.get((a, b), set()).discard(wi)
            out, j = [], 0
            while j < len(s):
                if j + 1 < len(s) and s[j] == best[0] and s[j + 1] == best[1]:
                    out.append(merged)
                    j += 2
                else:
                    out.append(s[j])
                    j += 1
            syms[wi] = out
            for a, b in zip(out, out[1:]):
                pairs[(a, b)] += f
                where[(a, b)].add(wi)
        pairs.pop(best, None)
    tokens = tuple(base + new_tokens + list(specials))
    return BPETokenizer(tokens, tuple(f"{a} {b}" for a, b in merges), tuple(specials))


@functools.lru_cache(maxsize=4)
def tiny_tokenizer(corpus: str | Path | None = None, vocab_size: int = 1024) -> BPETokenizer:
    """The tiny models' tokenizer, trained on the corpus shipped in models/ (cached per process)."""
    path = Path(corpus) if corpus is not None else CORPUS_PATH
    if not path.is_file():
        raise SpecterError(f"tokenizer corpus {path} not found; it ships in the repository's models/")
    return train_bpe(path.read_text(encoding="utf-8"), vocab_size=vocab_size)
