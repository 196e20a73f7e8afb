"""Tokenizer read from a GGUF file, through llama.cpp's own vocabulary code (``llama_cpp``, vocab only).

Decoding rule (the same for ``Tokenizer.decode`` and ``StreamDecoder``): the text of a token sequence is the
concatenation of the tokens' piece bytes, decoded as UTF-8 with invalid or unfinished sequences replaced by
U+FFFD. Control tokens (BOS, EOS, chat markers, ...) render as nothing unless ``special=True``.
SentencePiece vocabs with ``add_space_prefix`` put a space before the first word of a text when encoding
("Hello" -> "▁Hello"); unless ``continuation=True`` the ids are taken to start a text, and that one space is
removed from the first non-control token's piece, so that ``decode(encode(s)) == s``. Tokens generated after
a prompt are a continuation: decode or stream them with ``continuation=True`` to keep their leading space.

``IdsOnlyTokenizer`` stands in where llama-cpp-python is missing and only token ids go in and out
(``Model.load(..., tokenizer=IdsOnlyTokenizer())``: the benchmark worker and the GPU tests on the GPU machine).
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import logging
import os
from functools import cached_property
from typing import Iterable, Sequence

from .errors import SpecterError

__all__ = ["Tokenizer", "StreamDecoder", "IdsOnlyTokenizer", "llama_cpp_available", "ids_only_unless_llama_cpp"]

_log = logging.getLogger("specter_gguf.llama_cpp")
_quiet_callback = None  # the ctypes callback must outlive every call into llama.cpp that may log


def llama_cpp_available() -> bool:
    """Whether llama-cpp-python imports here (`Tokenizer` needs it)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SpecterError(
            f"llama-cpp-python is needed to read the tokenizer ({e}): pip install llama-cpp-python==0.3.36"
        ) from None
    return llama_cpp


@contextlib.contextmanager
def _llama_cpp_logs_to_debug(lc):
    """Route llama.cpp's log to ``logging`` at DEBUG level for the duration, then restore the previous
    callback. (llama-cpp-python 0.3.36 maps ggml's WARN level to ERROR, so ``verbose=False`` alone still
    prints warnings such as the context-size one on every vocab-only load.)"""
    global _quiet_callback
    if _quiet_callback is None:
        def forward(level, text, user_data):  # noqa: ARG001
            try:
                _log.debug("%s", text.decode("utf-8", errors="replace").rstrip("\n"))
            except Exception:  # never raise into C
                pass

        _quiet_callback = lc.llama_log_callback(forward)
    prev_cb, prev_ud = lc.llama_log_callback(), ctypes.c_void_p()
    try:
        lc.llama_log_get(ctypes.byref(prev_cb), ctypes.byref(prev_ud))
    except Exception:
        prev_cb = None
    lc.llama_log_set(_quiet_callback, ctypes.c_void_p(0))
    try:
        yield
    finally:
        if prev_cb is not None:
            lc.llama_log_set(prev_cb, prev_ud)


class Tokenizer:
    """A GGUF file's tokenizer. Build it with :meth:`from_gguf`."""

    def __init__(self, llama, path: str) -> None:
        self._lc = _import_llama_cpp()
        self._llama = llama  # keeps the model, hence the vocab pointer, alive
        self.path = path
        self._vocab = llama._model.vocab
        self._n_vocab = int(self._lc.llama_vocab_n_tokens(self._vocab))
        self._piece_cache: dict[tuple[int, bool], bytes] = {}

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        lc = _import_llama_cpp()
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise SpecterError(f"model file not found: {path}: check the path")
        from .gguf_file import check_file

        check_file(path)  # llama.cpp's vocabulary loader aborts the process on some malformed files
        try:
            # verbose=False: llama.cpp's log is kept to errors and its load-time output is silenced.
            with _llama_cpp_logs_to_debug(lc):
                llama = lc.Llama(model_path=path, vocab_only=True, verbose=False)
        except Exception as e:
            raise SpecterError(
                f"llama.cpp could not read a tokenizer from {path} ({e}): check that it is a complete GGUF file"
            ) from None
        return cls(llama, path)

    # -- properties ----------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    def _opt(self, tok: int) -> int | None:
        tok = int(tok)
        return None if tok < 0 or tok >= self._n_vocab else tok

    @property
    def bos_id(self) -> int | None:
        return self._opt(self._lc.llama_vocab_bos(self._vocab))

    @property
    def eos_id(self) -> int | None:
        return self._opt(self._lc.llama_vocab_eos(self._vocab))

    @property
    def eot_id(self) -> int | None:
        return self._opt(self._lc.llama_vocab_eot(self._vocab))

    @property
    def add_bos(self) -> bool:
        """Whether the file asks for a BOS token in front of a prompt (llama.cpp's ``add_bos``)."""
        return bool(self._lc.llama_vocab_get_add_bos(self._vocab)) and self.bos_id is not None

    @cached_property
    def add_space_prefix(self) -> bool:
        """Whether encoding puts a space in front of the text (SentencePiece ``add_space_prefix``)."""
        ids = self.encode("a", add_bos=False, special=False)
        return bool(ids) and self.token_bytes(ids[0]).startswith(b" ")

    def is_eog(self, token_id: int) -> bool:
        """True for llama.cpp's end-of-generation tokens (EOS, EOT, ``<|im_end|>``-like ones, ...)."""
        return 0 <= token_id < self._n_vocab and bool(self._lc.llama_vocab_is_eog(self._vocab, int(token_id)))

    def is_control(self, token_id: int) -> bool:
        return 0 <= token_id < self._n_vocab and bool(self._lc.llama_vocab_is_control(self._vocab, int(token_id)))

    @cached_property
    def eog_ids(self) -> frozenset[int]:
        """Every end-of-generation token id (a scan of the vocabulary, done once)."""
        f, v = self._lc.llama_vocab_is_eog, self._vocab
        return frozenset(i for i in range(self._n_vocab) if f(v, i))

    # -- encoding ------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_bos=None`` follows the file; ``special`` parses special-token text
        such as ``<|im_start|>`` into its token. An EOS is never appended."""
        if add_bos is None:
            add_bos = self.add_bos
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (self._lc.llama_token * n_max)()
        n = self._lc.llama_tokenize(self._vocab, data, len(data), buf, n_max, False, bool(special))
        if n < 0:
            n_max = -n
            buf = (self._lc.llama_token * n_max)()
            n = self._lc.llama_tokenize(self._vocab, data, len(data), buf, n_max, False, bool(special))
            if n < 0:  # pragma: no cover
                raise SpecterError(f"llama.cpp failed to tokenize a text of {len(data)} bytes: report this as a bug")
        ids = list(buf[:n])
        if add_bos:
            bos = self.bos_id
            if bos is None:
                raise SpecterError(f"{self.path} has no BOS token: encode with add_bos=False")
            ids.insert(0, bos)
        return ids

    # -- decoding ------------------------------------------------------------------------------

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        """The raw bytes of one token's piece (not UTF-8 complete for byte-fallback / byte-level pieces).
        Control tokens render as their text unless ``special=False`` (then as ``b""``)."""
        token_id = int(token_id)
        key = (token_id, bool(special))
        cached = self._piece_cache.get(key)
        if cached is not None:
            return cached
        if not 0 <= token_id < self._n_vocab:
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self._n_vocab} tokens")
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._lc.llama_token_to_piece(self._vocab, token_id, buf, size, 0, bool(special))
            if n >= 0:
                piece = buf.raw[:n]
                break
            size = -n
        self._piece_cache[key] = piece
        return piece

    def decode_bytes(self, ids: Iterable[int], special: bool = False, continuation: bool = False) -> bytes:
        """The bytes of ``ids`` under the module's decoding rule."""
        out = bytearray()
        strip = not continuation and self.add_space_prefix
        for t in ids:
            piece = self.token_bytes(t, special)
            if strip and not self.is_control(int(t)):
                strip = False
                if piece.startswith(b" "):
                    piece = piece[1:]
            out += piece
        return bytes(out)

    def decode(self, ids: Iterable[int], special: bool = False, continuation: bool = False) -> str:
        """Text of ``ids``; see the module docstring for ``special`` and ``continuation``."""
        return self.decode_bytes(ids, special, continuation).decode("utf-8", errors="replace")

    def stream(self, special: bool = False, continuation: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, special=special, continuation=continuation)


class StreamDecoder:
    """Turns tokens into text one at a time, never emitting a broken UTF-8 sequence.

    ``"".join(push(t) for t in ids) + flush()`` equals ``tokenizer.decode(ids, special, continuation)``.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False, continuation: bool = False) -> None:
        self.tokenizer = tokenizer
        self.special = special
        self._strip = not continuation and tokenizer.add_space_prefix
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty while a character is unfinished)."""
        piece = self.tokenizer.token_bytes(token_id, self.special)
        if self._strip and not self.tokenizer.is_control(int(token_id)):
            self._strip = False
            if piece.startswith(b" "):
                piece = piece[1:]
        return self._utf8.decode(piece, final=False)

    def push_many(self, ids: Sequence[int]) -> str:
        return "".join(self.push(t) for t in ids)

    def flush(self) -> str:
        """End of stream: whatever is still held, a dangling partial sequence becoming U+FFFD."""
        return self._utf8.decode(b"", final=True)


class IdsOnlyTokenizer:
    """A tokenizer without a vocabulary, for callers that give token ids and read token ids: no text comes out
    (every piece is empty), no token ends generation, and encoding text is refused."""

    bos_id: int | None = None
    eos_id: int | None = None
    add_bos = False

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:  # noqa: ARG002
        raise SpecterError("this model was loaded without a tokenizer (token ids only): give token ids, or load it "
                           "with llama-cpp-python installed")

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:  # noqa: ARG002
        return b""

    def decode(self, ids: Iterable[int], special: bool = False, continuation: bool = False) -> str:  # noqa: ARG002
        return ""

    def is_eog(self, token_id: int) -> bool:  # noqa: ARG002
        return False

    def stream(self, special: bool = False, continuation: bool = False) -> "_NoText":  # noqa: ARG002
        return _NoText()


def ids_only_unless_llama_cpp() -> IdsOnlyTokenizer | None:
    """`Model.load`'s `tokenizer` for callers that give and read token ids only: an `IdsOnlyTokenizer` where
    llama-cpp-python is missing, else None (the file's own)."""
    return None if llama_cpp_available() else IdsOnlyTokenizer()


class _NoText:
    """`IdsOnlyTokenizer`'s stream decoder: every token completes no text."""

    def push(self, token_id: int) -> str:  # noqa: ARG002
        return ""

    def flush(self) -> str:
        return ""
