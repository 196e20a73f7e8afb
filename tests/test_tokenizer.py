"""Tokenizer through llama.cpp's vocab code: round trips, special ids, EOG, and UTF-8-safe streaming.

The vocabs are tiny vocab-only GGUFs written here: a SentencePiece-style one ("llama", byte fallback) and a
byte-level BPE one ("gpt2"). Set LLAMA_CPP_VOCAB_DIR to llama.cpp's ``models/`` folder (ggml-vocab-*.gguf,
e.g. from the llama-cpp-python sdist) to run the same checks on real vocabs as well.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from specter_gguf.errors import SpecterError  # noqa: E402
from specter_gguf.tokenizer import StreamDecoder, Tokenizer  # noqa: E402

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6

TEXTS = [
    "Hello world",
    "Hello  world\nhello, world!",
    "café au lait",
    "smile 😀 and 👍🏽 ok",
    "日本語テキスト",
    " leading space",
    "x",
    "",
]


def _arch_keys(w, arch: str, n_vocab: int) -> None:
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_spm_vocab(path: Path) -> Path:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [UNKNOWN, CONTROL, CONTROL]
    scores = [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(BYTE)
        scores.append(0.0)
    pieces = ["▁", "e", "l", "o", "H", "h", "w", "r", "d", "a", "c", "f", "é", ",", "!", "t", "i", "u",
              "s", "m", "n", "g",
              "ll", "llo", "ello", "▁H", "▁Hello", "▁h", "▁hello", "▁w", "▁wor", "▁world", "or", "ld",
              "▁c", "▁ca", "▁caf", "▁café", "▁a", "▁au", "▁l", "▁la", "▁lait", "ai", "it",
              "▁s", "▁sm", "▁smile", "▁o", "▁ok", "▁an", "▁and", "▁▁"]
    for i, p in enumerate(pieces):
        tokens.append(p)
        types.append(NORMAL)
        scores.append(-1.0 * i if len(p) == 1 else float(len(p)) * 10.0 - i * 0.01)
    w = gguf.GGUFWriter(str(path), "llama")
    _arch_keys(w, "llama", len(tokens))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    _finish(w)
    return path


def _byte_chars() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_bpe_vocab(path: Path) -> Path:
    bc = _byte_chars()
    enc = lambda s: "".join(bc[b] for b in s.encode("utf-8"))  # noqa: E731
    tokens = [bc[b] for b in range(256)]
    merges = []

    def merge(a: str, b: str) -> None:
        merges.append(f"{enc(a)} {enc(b)}")
        tokens.append(enc(a + b))

    merge(" ", "w")
    merge("o", "r")
    merge(" w", "or")
    merge("l", "d")
    merge(" wor", "ld")
    merge("H", "e")
    merge("l", "l")
    merge("He", "ll")
    merge("Hell", "o")
    merge("é", "t")  # a multibyte character inside a token
    tokens_bytes_partial = "😀".encode("utf-8")
    # a token holding the first half of the emoji only, so the character is split across tokens
    merges.append(f"{bc[tokens_bytes_partial[0]]} {bc[tokens_bytes_partial[1]]}")
    tokens.append(bc[tokens_bytes_partial[0]] + bc[tokens_bytes_partial[1]])
    types = [NORMAL] * len(tokens)
    for special in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]:
        tokens.append(special)
        types.append(CONTROL)
    eot = tokens.index("<|endoftext|>")
    w = gguf.GGUFWriter(str(path), "qwen2")
    _arch_keys(w, "qwen2", len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.add_add_bos_token(False)
    _finish(w)
    return path


def _real_vocabs() -> list[Path]:
    d = os.environ.get("LLAMA_CPP_VOCAB_DIR")
    if not d:
        return []
    names = ["llama-spm", "phi-3", "qwen2", "gpt-2", "llama-bpe", "deepseek-llm"]
    return [p for p in (Path(d) / f"ggml-vocab-{n}.gguf" for n in names) if p.is_file()]


@pytest.fixture(scope="module")
def spm(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_gguf(write_spm_vocab(tmp_path_factory.mktemp("spm") / "spm.gguf"))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_gguf(write_bpe_vocab(tmp_path_factory.mktemp("bpe") / "bpe.gguf"))


_loaded: dict[str, Tokenizer] = {}


@pytest.fixture(params=["spm", "bpe"] + [str(p) for p in _real_vocabs()])
def tok(request, spm, bpe) -> Tokenizer:
    if request.param == "spm":
        return spm
    if request.param == "bpe":
        return bpe
    if request.param not in _loaded:
        _loaded[request.param] = Tokenizer.from_gguf(request.param)
    return _loaded[request.param]


def stream(t: Tokenizer, ids, **kw) -> tuple[str, list[str]]:
    d = StreamDecoder(t, **kw)
    parts = [d.push(i) for i in ids]
    parts.append(d.flush())
    return "".join(parts), parts


# -- basic properties ----------------------------------------------------------------------------


def test_spm_properties(spm):
    assert spm.n_vocab == 3 + 256 + 53
    assert spm.bos_id == 1 and spm.eos_id == 2
    assert spm.add_bos and spm.add_space_prefix
    assert spm.is_eog(2) and not spm.is_eog(1) and not spm.is_eog(100)
    assert 2 in spm.eog_ids


def test_bpe_properties(bpe):
    eot = bpe.n_vocab - 3
    assert bpe.bos_id == eot and bpe.eos_id == eot
    assert not bpe.add_bos and not bpe.add_space_prefix
    assert bpe.is_eog(eot)
    assert bpe.is_eog(bpe.n_vocab - 1)  # <|im_end|> is an end-of-generation token for llama.cpp
    assert not bpe.is_eog(bpe.n_vocab - 2)
    assert not bpe.is_eog(-1) and not bpe.is_eog(bpe.n_vocab)


def test_missing_file_raises(tmp_path):
    with pytest.raises(SpecterError, match="not found"):
        Tokenizer.from_gguf(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(SpecterError, match="could not read a tokenizer|not a GGUF file"):
        Tokenizer.from_gguf(bad)


def test_loading_is_quiet(tmp_path, capfd):
    Tokenizer.from_gguf(write_spm_vocab(tmp_path / "q.gguf"))
    out, err = capfd.readouterr()
    assert out == "" and err == ""


# -- encoding ------------------------------------------------------------------------------------


def test_spm_encoding_uses_pieces_and_byte_fallback(spm):
    ids = spm.encode("Hello world")
    assert ids[0] == spm.bos_id
    assert [spm.token_bytes(i) for i in ids[1:]] == [b" Hello", b" world"]
    ids = spm.encode("😀", add_bos=False)
    # byte fallback: four one-byte tokens <0xF0> <0x9F> <0x98> <0x80> after the prefix space "▁"
    assert [spm.token_bytes(i) for i in ids] == [b" ", b"\xf0", b"\x9f", b"\x98", b"\x80"]


def test_bpe_encoding_splits_emoji_inside_a_token(bpe):
    ids = bpe.encode("Hello world 😀")
    pieces = [bpe.token_bytes(i) for i in ids]
    assert pieces[:2] == [b"Hello", b" world"]
    assert b"\xf0\x9f" in pieces  # the merged half-emoji token
    assert b"".join(pieces) == "Hello world 😀".encode()


def test_add_bos_flag(spm, bpe):
    assert spm.encode("Hello")[0] == spm.bos_id
    assert spm.encode("Hello", add_bos=False)[0] != spm.bos_id
    assert bpe.encode("Hello")[0] != bpe.bos_id
    assert bpe.encode("Hello", add_bos=True)[0] == bpe.bos_id
    assert spm.encode("", add_bos=True) == [spm.bos_id]
    assert spm.encode("", add_bos=False) == []


def test_special_parsing(bpe):
    im_start = bpe.n_vocab - 2
    assert bpe.encode("<|im_start|>Hello", special=True)[0] == im_start
    assert im_start not in bpe.encode("<|im_start|>Hello", special=False)
    assert bpe.decode([im_start]) == ""
    assert bpe.decode([im_start], special=True) == "<|im_start|>"
    assert bpe.token_bytes(im_start) == b"<|im_start|>"
    assert bpe.token_bytes(im_start, special=False) == b""


# -- decoding and streaming ----------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_bos=False)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode(tok, text):
    for ids in (tok.encode(text), tok.encode(text, add_bos=False)):
        for kw in ({}, {"continuation": True}, {"special": True}):
            whole, parts = stream(tok, ids, **kw)
            assert whole == tok.decode(ids, **kw)
            assert all("\ufffd" not in p for p in parts)  # valid input never streams a replacement char


def test_stream_holds_partial_characters(spm, bpe):
    for t in (spm, bpe):
        ids = t.encode("a😀b", add_bos=False)
        d = StreamDecoder(t)
        out = []
        for i in ids:
            s = d.push(i)
            out.append(s)
            # nothing emitted can be half a character
            s.encode("utf-8")
            assert "\ufffd" not in s
        assert "".join(out) + d.flush() == "a😀b"
        assert any(s == "" for s in out)  # some token completed no character


def test_flush_replaces_dangling_partial_sequence(spm):
    ids = spm.encode("a😀", add_bos=False)[:-1]  # drop the emoji's last byte
    whole, parts = stream(spm, ids)
    assert parts[-1] == "\ufffd"
    assert whole == "a\ufffd" == spm.decode(ids)


def test_continuation_keeps_leading_space(spm, bpe):
    prompt = spm.encode("Hello")
    full = spm.encode("Hello world")
    gen = full[len(prompt):]
    assert spm.decode(gen) == "world"
    assert spm.decode(gen, continuation=True) == " world"
    assert spm.decode(prompt) + spm.decode(gen, continuation=True) == "Hello world"
    assert stream(spm, gen, continuation=True)[0] == " world"
    # byte-level BPE never strips: the space is real text there
    ids = bpe.encode(" world")
    assert bpe.decode(ids) == " world" == bpe.decode(ids, continuation=True)


def test_decode_skips_bos_before_stripping_prefix_space(spm):
    ids = spm.encode("Hello world")
    assert spm.decode(ids) == "Hello world"
    assert spm.decode(ids, special=True) == "<s>Hello world"
    assert spm.decode(ids + [spm.eos_id]) == "Hello world"


def test_token_bytes_out_of_range(spm):
    with pytest.raises(ValueError):
        spm.token_bytes(spm.n_vocab)
