"""Unusable model files fail with one clear line, never a traceback.

Each case is a crafted file (or path). The CLI (`run`, and `inspect` where the problem is in the file's
header or metadata) must print one line starting with `Error:` that names the problem, exit with status 1
and show no traceback; the Python API (`Model.load`) must raise `SpecterError` with the same message.
Broken files are written from a tiny model with `gguf.GGUFWriter` (metadata edited, tensors dropped,
reshaped or stored in a type the engine does not run), cut short, or with tensor offsets patched in place.
Hostile vocabularies (a repeated token aborts llama.cpp's loader) must be refused before llama.cpp reads them.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from gguf_edit import DROP, rewrite

from specter_gguf.cli import cli
from specter_gguf.engine import Model
from specter_gguf.errors import SpecterError

BASE = ("llama", "f16")  # the tiny Mixtral-style model: every crafted file starts from it
SUPPORTED = ("llama", "olmoe", "qwen2moe", "qwen3moe")


def patch_offset(src: Path, dst: Path, name: str, offset: Callable[[dict[str, int]], int]) -> Path:
    """A copy of `src` whose tensor `name` has data offset `offset(offsets of all tensors)`, patched in place."""
    reader = GGUFReader(src)
    t = next(t for t in reader.tensors if t.name == name)
    at = t.field.offset + sum(part.nbytes for part in t.field.parts[:-1])
    data = bytearray(src.read_bytes())
    data[at:at + 8] = struct.pack("<Q", offset({t.name: int(t.field.parts[-1][0]) for t in reader.tensors}))
    dst.write_bytes(bytes(data))
    return dst


def tokens_of(base: Path) -> list[str]:
    return list(GGUFReader(base).fields["tokenizer.ggml.tokens"].contents())


def raw_blocks(qtype: GGMLQuantizationType, rows: int, row_len: int, seed: int = 0) -> np.ndarray:
    """Random raw bytes of a [rows, row_len] tensor stored as `qtype` (uint8, rows last)."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (rows, row_len // block * size), dtype=np.uint8)


# --------------------------------------------------------------------------------------------------
# The cases: name -> (make(base model path, directory) -> path, pattern the message must match,
#                     whether `inspect` must fail too)
# --------------------------------------------------------------------------------------------------


def not_gguf(base: Path, d: Path) -> Path:
    p = d / "notes.gguf"
    p.write_text("This is a text file, not a model.\n" * 10)
    return p


def empty(base: Path, d: Path) -> Path:
    p = d / "empty.gguf"
    p.write_bytes(b"")
    return p


def truncated_half(base: Path, d: Path) -> Path:
    data = base.read_bytes()
    p = d / "half.gguf"
    p.write_bytes(data[: len(data) // 2])
    return p


def truncated_after_header(base: Path, d: Path) -> Path:
    data = base.read_bytes()
    p = d / "header-only.gguf"
    p.write_bytes(data[:24])  # magic, version, tensor count, metadata count: nothing more
    return p


def truncated_in_metadata(base: Path, d: Path) -> Path:
    data = base.read_bytes()
    p = d / "cut-in-metadata.gguf"
    p.write_bytes(data[:200])
    return p


def unsupported_arch(base: Path, d: Path) -> Path:
    return rewrite(base, d / "gpt2.gguf", arch="gpt2")


def dense(base: Path, d: Path) -> Path:
    return rewrite(base, d / "dense.gguf", kv={"llama.expert_count": DROP, "llama.expert_used_count": DROP})


def no_layers(base: Path, d: Path) -> Path:
    return rewrite(base, d / "no-layers.gguf", kv={"llama.block_count": (0, GGUFValueType.UINT32)})


def missing_tensor(base: Path, d: Path) -> Path:
    return rewrite(base, d / "missing-tensor.gguf", tensors={"blk.1.ffn_up_exps.weight": DROP})


def wrong_shape(base: Path, d: Path) -> Path:
    bad = np.zeros((128, 256), dtype=np.float16)  # attn_q is [256, 256] in numpy order
    return rewrite(base, d / "wrong-shape.gguf", tensors={"blk.0.attn_q.weight": (bad, None)})


def tq2_0_tensor(base: Path, d: Path) -> Path:
    raw = raw_blocks(GGMLQuantizationType.TQ2_0, 256, 256)
    return rewrite(base, d / "tq2_0.gguf", tensors={"blk.0.attn_q.weight": (raw, GGMLQuantizationType.TQ2_0)})


def mxfp4_tensor(base: Path, d: Path) -> Path:
    raw = np.stack([raw_blocks(GGMLQuantizationType.MXFP4, 256, 256, seed=e) for e in range(8)])
    return rewrite(base, d / "mxfp4.gguf",
                   tensors={"blk.1.ffn_gate_exps.weight": (raw, GGMLQuantizationType.MXFP4)})


def duplicate_token(base: Path, d: Path) -> Path:
    tokens = tokens_of(base)
    tokens[5] = tokens[4]
    return rewrite(base, d / "dup-token.gguf", kv={"tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY)})


def nul_in_token(base: Path, d: Path) -> Path:
    tokens = tokens_of(base)
    tokens[9] = tokens[8] + "\0x"  # llama.cpp reads it as a C string: a repeat of token 8 that aborted its loader
    return rewrite(base, d / "nul-token.gguf", kv={"tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY)})


def invalid_utf8_token(base: Path, d: Path) -> Path:
    tokens: list[Any] = tokens_of(base)
    tokens[7] = b"\xff\xfe"
    edit = (tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
    return rewrite(base, d / "utf8-token.gguf", kv={"tokenizer.ggml.tokens": edit})


def empty_vocabulary(base: Path, d: Path) -> Path:
    edit = ([], GGUFValueType.ARRAY, GGUFValueType.STRING)
    return rewrite(base, d / "empty-vocab.gguf", kv={"tokenizer.ggml.tokens": edit})


def short_token_types(base: Path, d: Path) -> Path:
    types = list(GGUFReader(base).fields["tokenizer.ggml.token_type"].contents())[:-1]
    edit = (types, GGUFValueType.ARRAY, GGUFValueType.INT32)
    return rewrite(base, d / "short-types.gguf", kv={"tokenizer.ggml.token_type": edit})


def long_scores(base: Path, d: Path) -> Path:
    edit = ([0.0] * (len(tokens_of(base)) + 3), GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    return rewrite(base, d / "long-scores.gguf", kv={"tokenizer.ggml.scores": edit})


def kv_edit(key: str, value: Any, vtype: GGUFValueType) -> Callable[[Path, Path], Path]:
    def make(base: Path, d: Path) -> Path:
        return rewrite(base, d / f"{key}-{value!r}.gguf", kv={key: (value, vtype)})
    return make


def norm_as_q8_0(base: Path, d: Path) -> Path:
    raw = raw_blocks(GGMLQuantizationType.Q8_0, 1, 256)[0]
    return rewrite(base, d / "norm-q8_0.gguf", tensors={"blk.0.attn_norm.weight": (raw, GGMLQuantizationType.Q8_0)})


def misaligned(base: Path, d: Path) -> Path:
    return patch_offset(base, d / "misaligned.gguf", "blk.0.attn_q.weight", lambda o: o["blk.0.attn_q.weight"] + 2)


def out_of_file(base: Path, d: Path) -> Path:
    return patch_offset(base, d / "out-of-file.gguf", "blk.0.attn_q.weight", lambda o: max(o.values()) + (1 << 20))


def overlapping(base: Path, d: Path) -> Path:
    return patch_offset(base, d / "overlap.gguf", "blk.0.attn_q.weight", lambda o: o["blk.0.attn_k.weight"])


def gap_before_last_tensor(base: Path, d: Path) -> Path:
    last = max(GGUFReader(base).tensors, key=lambda t: t.data_offset).name
    p = patch_offset(base, d / "gap.gguf", last, lambda o: o[last] + 64)
    p.write_bytes(p.read_bytes() + bytes(64))  # in the file, overlapping nothing: only llama.cpp's order rule breaks
    return p


def nonexistent(base: Path, d: Path) -> Path:
    return d / "no-such-model.gguf"


def directory(base: Path, d: Path) -> Path:
    p = d / "a-directory.gguf"
    p.mkdir()
    return p


def experts_one_tensor_each(base: Path, d: Path) -> Path:
    """Mixtral's experts as llama.cpp's converter wrote them until early 2024: `blk.N.ffn_gate.E.weight`, ...."""
    edits: dict[str, Any] = {}
    for t in GGUFReader(base).tensors:
        if t.name.endswith("_exps.weight"):
            edits[t.name] = DROP
            for e, rows in enumerate(np.asarray(t.data)):
                edits[t.name.replace("_exps.weight", f".{e}.weight")] = (np.ascontiguousarray(rows), None)
    return rewrite(base, d / "experts-one-each.gguf", tensors=edits)


# A model split into files of at most SPLIT_TENSORS tensors each (the tiny model's 23 in four files), as llama.cpp's
# `llama-gguf-split` and its converter's --split-max-tensors split models; each case in a folder of its own.
SPLIT_TENSORS = 6


def split_model(base: Path, d: Path, name: str) -> list[Path]:
    """The files of `base` split in folder d/name, in order (`tiny-00001-of-0000N.gguf`, ...)."""
    (d / name).mkdir()
    first = rewrite(base, d / name / "tiny.gguf", split_max_tensors=SPLIT_TENSORS)
    return sorted(first.parent.glob("tiny-*-of-*.gguf"))


def split_no_past_count(base: Path, d: Path) -> Path:
    return rewrite(base, d / "split-no-past.gguf", kv={"split.count": (2, GGUFValueType.UINT16),
                                                       "split.no": (5, GGUFValueType.UINT16)})


def split_second_file(base: Path, d: Path) -> Path:
    return split_model(base, d, "split-second")[1]


def split_file_missing(base: Path, d: Path) -> Path:
    files = split_model(base, d, "split-missing")
    files[2].unlink()
    return files[0]


def split_first_renamed(base: Path, d: Path) -> Path:
    first = split_model(base, d, "split-renamed")[0]
    return first.rename(first.with_name("tiny.gguf"))


def split_file_out_of_place(base: Path, d: Path) -> Path:
    files = split_model(base, d, "split-out-of-place")
    files[2].replace(files[1])  # the third file under the second's name
    return files[0]


def split_file_short_of_a_tensor(base: Path, d: Path) -> Path:
    files = split_model(base, d, "split-short")
    last = GGUFReader(base).tensors[-1].name  # in the last file: the other three hold the same tensors either way
    (d / "split-short" / "without-last").mkdir()
    short = rewrite(base, d / "split-short" / "without-last" / "tiny.gguf", tensors={last: DROP},
                    split_max_tensors=SPLIT_TENSORS)
    short.with_name(files[3].name).replace(files[3])
    return files[0]


CASES: dict[str, tuple[Callable[[Path, Path], Path], str, bool]] = {
    "not_gguf": (not_gguf, r"not a GGUF file", True),
    "empty": (empty, r"not a GGUF file|empty", True),
    "truncated_half": (truncated_half, r"truncated", True),
    "truncated_after_header": (truncated_after_header, r"truncated", True),
    "truncated_in_metadata": (truncated_in_metadata, r"truncated", True),
    "unsupported_arch": (unsupported_arch, r"'gpt2' is not supported.*" + r".*".join(SUPPORTED), True),
    "dense": (dense, r"no experts", True),
    "no_layers": (no_layers, r"block_count is 0.*no layers", True),
    "missing_tensor": (missing_tensor, r"blk\.1\.ffn_up_exps\.weight.*missing", False),
    "wrong_shape": (wrong_shape, r"blk\.0\.attn_q\.weight.*shape", False),
    "tq2_0_tensor": (tq2_0_tensor, r"blk\.0\.attn_q\.weight.*TQ2_0.*not supported", False),
    "mxfp4_tensor": (mxfp4_tensor, r"blk\.1\.ffn_gate_exps\.weight.*MXFP4.*not supported", False),
    "duplicate_token": (duplicate_token, r"token id 5 \(.*\) repeats the text of token id 4", True),
    "invalid_utf8_token": (invalid_utf8_token, r"tokenizer\.ggml\.tokens' token id 7 is not valid UTF-8", True),
    "nul_in_token": (nul_in_token, r"token id 9 \(.*, up to its NUL\) repeats the text of token id 8", True),
    "empty_vocabulary": (empty_vocabulary, r"vocabulary is empty", True),
    "short_token_types": (short_token_types, r"token_type' has \d+ entries for \d+ tokens", True),
    "long_scores": (long_scores, r"scores' has \d+ entries for \d+ tokens", True),
    "head_count_zero": (kv_edit("llama.attention.head_count", 0, GGUFValueType.UINT32),
                        r"llama\.attention\.head_count is 0, expected from 1", True),
    "expert_count_string": (kv_edit("llama.expert_count", "8", GGUFValueType.STRING),
                            r"llama\.expert_count is '8', expected an integer", True),
    "expert_count_nan": (kv_edit("llama.expert_count", float("nan"), GGUFValueType.FLOAT32),
                         r"llama\.expert_count is nan, expected an integer", True),
    "expert_used_negative": (kv_edit("llama.expert_used_count", -1, GGUFValueType.INT32),
                             r"llama\.expert_used_count is -1, expected from 1 to 8", True),
    "expert_used_too_many": (kv_edit("llama.expert_used_count", 9, GGUFValueType.UINT32),
                             r"llama\.expert_used_count is 9, expected from 1 to 8", True),
    "rms_eps_inf": (kv_edit("llama.attention.layer_norm_rms_epsilon", float("inf"), GGUFValueType.FLOAT32),
                    r"layer_norm_rms_epsilon is inf, expected a finite number", True),
    "invalid_utf8_value": (kv_edit("general.name", b"tiny\xc3\x28", GGUFValueType.STRING),
                           r"metadata 'general\.name' is not valid UTF-8", True),
    "norm_as_q8_0": (norm_as_q8_0, r"blk\.0\.attn_norm\.weight' is a vector.*Q8_0", False),
    "misaligned_data": (misaligned, r"blk\.0\.attn_q\.weight' data at offset \d+ is not aligned", True),
    "data_out_of_file": (out_of_file, r"blk\.0\.attn_q\.weight' data .* runs past the end of the file", True),
    "overlapping_data": (overlapping, r"tensors '.*' and '.*' overlap", True),
    "gap_in_data": (gap_before_last_tensor, r"output\.weight' data is at offset \d+, where llama\.cpp expects", True),
    "nonexistent": (nonexistent, r"no such file|does not exist", True),
    "directory": (directory, r"directory|not a file", True),
    "experts_one_tensor_each": (experts_one_tensor_each, r"routed experts are stored one tensor each \('blk\.0\."
                                r"ffn_gate\.0\.weight', \.\.\.\).*convert the model again with a current llama\.cpp",
                                False),
    "split_count_string": (kv_edit("split.count", "4", GGUFValueType.STRING),
                           r"split\.count is '4', expected a whole number", True),
    "split_no_past_count": (split_no_past_count, r"split\.no is 5, not below split\.count \(2\)", True),
    "split_second_file": (split_second_file, r"tiny-00002-of-00004\.gguf: file 2 of a model split into 4 files; "
                          r"give the first one, tiny-00001-of-00004\.gguf", True),
    "split_file_missing": (split_file_missing, r"tiny-00003-of-00004\.gguf: no such file; tiny-00001-of-00004\.gguf "
                           r"is the first of 4 files of a split model", True),
    "split_first_renamed": (split_first_renamed, r"tiny\.gguf: file 1 of a model split into 4 files, but not named "
                            r"'<name>-00001-of-00004\.gguf'.*llama-gguf-split --merge", True),
    "split_file_out_of_place": (split_file_out_of_place, r"tiny-00002-of-00004\.gguf: has split number 3 where file 2 "
                                r"of tiny-00001-of-00004\.gguf's split model belongs", True),
    "split_file_short_of_a_tensor": (split_file_short_of_a_tensor, r"the 4 split files hold \d+ tensors where the "
                                     r"first says \d+", True),
}


@pytest.fixture(scope="module")
def crafted(tiny_models, tmp_path_factory) -> dict[str, Path]:
    base = tiny_models[BASE]
    d = tmp_path_factory.mktemp("broken-models")
    return {name: make(base, d) for name, (make, _, _) in CASES.items()}


def assert_one_error_line(result, pattern: str, only: bool = True) -> None:
    """Exit status 1, no traceback, exactly one line `Error: ...` matching `pattern`; with `only`, nothing
    else but a (cleared) loading bar. `inspect` may print what it could read before the error."""
    out = result.output  # stdout and stderr together
    assert "Traceback" not in out, out
    assert result.exit_code == 1, f"exit code {result.exit_code}; output:\n{out}\nexception: {result.exception!r}"
    # what a terminal shows: each line's text after its last carriage return (progress bars redraw)
    lines = [line.rsplit("\r", 1)[-1] for line in out.split("\n")]
    errors = [line for line in lines if "Error" in line]
    assert len(errors) == 1 and errors[0].startswith("Error: "), f"want one 'Error: ...' line, got:\n{out}"
    assert re.search(pattern, errors[0], re.S), f"{errors[0]!r} does not name the problem ({pattern})"
    assert not only or not [line for line in lines if line.strip() and line is not errors[0]
                and not line.strip().startswith("loading")], f"unexpected output besides the error:\n{out}"


@pytest.mark.parametrize("case", CASES)
def test_run_fails_with_one_line(case: str, crafted: dict[str, Path]) -> None:
    _, pattern, _ = CASES[case]
    result = CliRunner().invoke(cli, ["run", "-p", "hi", "-n", "1", "--device", "cpu", str(crafted[case])])
    assert_one_error_line(result, pattern)


@pytest.mark.parametrize("case", [c for c, (_, _, header_level) in CASES.items() if header_level])
def test_inspect_fails_with_one_line(case: str, crafted: dict[str, Path]) -> None:
    _, pattern, _ = CASES[case]
    result = CliRunner().invoke(cli, ["inspect", str(crafted[case])])
    assert_one_error_line(result, pattern, only=False)


@pytest.mark.parametrize("case", [c for c, (_, _, header_level) in CASES.items() if not header_level])
def test_inspect_describes_files_with_tensor_problems(case: str, crafted: dict[str, Path]) -> None:
    """A bad tensor does not stop `inspect` from describing the file (it reads no tensor data), and
    never gives a traceback."""
    result = CliRunner().invoke(cli, ["inspect", str(crafted[case])])
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    if result.exit_code != 0:
        assert_one_error_line(result, CASES[case][1], only=False)
    else:
        assert "architecture  llama" in result.output


@pytest.mark.parametrize("case", CASES)
def test_model_load_raises_specter_error(case: str, crafted: dict[str, Path]) -> None:
    _, pattern, _ = CASES[case]
    with pytest.raises(SpecterError) as info:
        Model.load(crafted[case], device="cpu", progress=False)
    message = str(info.value)
    assert "\n" not in message, f"multi-line message: {message!r}"
    assert re.search(pattern, message, re.S), f"{message!r} does not name the problem ({pattern})"


def test_base_model_loads(tiny_models) -> None:
    """The crafted files differ from a model that loads: the failures come from the edits alone."""
    base = tiny_models[BASE]
    ok = rewrite(base, base.with_name("rewritten-unchanged.gguf"))
    for path in (base, ok):
        m = Model.load(path, device="cpu", progress=False)
        assert m.logits([1, 2, 3]).shape == (3, m.config.n_vocab)
    a = Model.load(base, device="cpu", progress=False).logits([1, 2, 3])
    b = Model.load(ok, device="cpu", progress=False).logits([1, 2, 3])
    assert np.array_equal(a, b)


@pytest.mark.parametrize("kind", ["f16", "q4_k_m"])
def test_trailing_dimensions_of_one_load_as_llama_cpp_loads_them(kind: str, tiny_models, tmp_path: Path) -> None:
    """llama.cpp's converter writes qwen2moe's shared-expert gate as a 2-D [n_embd, 1] tensor (ggml order), and
    llama.cpp compares shapes up to trailing dimensions of 1: such files load and give the same logits. Vectors
    stored as [n, 1, 1], and a matrix with an extra trailing 1, load too; a real mismatch is still refused."""
    base = tiny_models[("qwen2moe", kind)]
    reader = GGUFReader(base)
    gate = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_inp_shexp.weight")
    norm = next(t for t in reader.tensors if t.name == "blk.1.attn_norm.weight")
    router = next(t for t in reader.tensors if t.name == "blk.1.ffn_gate_inp.weight")
    edits = {"blk.0.ffn_gate_inp_shexp.weight": (np.asarray(gate.data).reshape(1, -1), None),
             "blk.1.attn_norm.weight": (np.asarray(norm.data).reshape(1, 1, -1), None),
             "blk.1.ffn_gate_inp.weight": (np.asarray(router.data).reshape(1, *router.data.shape), None)}
    padded = rewrite(base, tmp_path / "padded.gguf", tensors=edits)
    stored = {t.name: tuple(int(d) for d in t.shape) for t in GGUFReader(padded).tensors}
    assert stored["blk.0.ffn_gate_inp_shexp.weight"][1:] == (1,)  # ggml order: [n_embd, 1]
    assert stored["blk.1.attn_norm.weight"][1:] == (1, 1)
    tokens = [1, 2, 3, 4]
    want = Model.load(base, device="cpu", progress=False).logits(tokens)
    got = Model.load(padded, device="cpu", progress=False).logits(tokens)
    assert np.array_equal(want, got)
    gate_2 = np.concatenate([np.asarray(gate.data).reshape(1, -1)] * 2)  # [n_embd, 2]: not a shape llama.cpp takes
    bad = rewrite(base, tmp_path / "two-gates.gguf", tensors={"blk.0.ffn_gate_inp_shexp.weight": (gate_2, None)})
    with pytest.raises(SpecterError, match=r"ffn_gate_inp_shexp\.weight' has shape \[2, \d+\]"):
        Model.load(bad, device="cpu", progress=False)
