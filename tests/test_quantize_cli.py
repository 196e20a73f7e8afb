"""`specter-gguf quantize` (output, default name, progress, errors), and the CLI's usability options:
`run --quiet`, `-v` logging, and `--help` of every command showing its defaults."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from specter_gguf.cli import cli
from specter_gguf.gguf_file import GGUFFile

pytest.importorskip("llama_cpp")


def invoke(*args: str):
    result = CliRunner().invoke(cli, list(args))
    assert "Traceback" not in result.output, result.output
    return result


def tensor_types(path: Path) -> set[str]:
    return {t.type.name for t in GGUFFile(path).tensors.values()}


def test_quantize_to_output(shipped_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "sub" / "q8.gguf"
    out.parent.mkdir()
    result = invoke("quantize", str(shipped_model), "--type", "Q8_0", "-o", str(out), "--threads", "2")
    assert result.exit_code == 0, result.output
    assert tensor_types(out) == {"F32", "Q8_0"}
    assert f"wrote {out}" in result.stderr and "quant size" in result.stderr
    n = len(GGUFFile(shipped_model).tensors)
    assert re.search(rf"{n}/{n} \[", result.stderr)  # the tqdm bar over tensors reached the end
    assert "llama_model_loader" not in result.stderr  # llama.cpp's own log is kept for -vv


def test_quantize_default_output_and_quiet(shipped_model: Path, tmp_path: Path) -> None:
    src = tmp_path / "tiny-f16.gguf"
    shutil.copy(shipped_model, src)
    result = invoke("quantize", str(src), "-t", "q4_k_m", "-q")
    assert result.exit_code == 0, result.output
    out = tmp_path / "tiny-q4_k_m.gguf"
    assert out.is_file() and "Q4_K" in tensor_types(out)
    assert "tensor/s" not in result.stderr


def test_quantize_errors(shipped_model: Path, tmp_path: Path) -> None:
    r = invoke("quantize", str(shipped_model), "-t", "q5_k")
    assert r.exit_code == 2 and "'q5_k' is not one of" in r.output and "q4_k_m" in r.output
    r = invoke("quantize", str(shipped_model), "-t", "IQ2_XXS")  # llama.cpp's quantizer would need an imatrix file
    assert r.exit_code == 2 and "iq2_xxs needs an importance matrix" in r.output
    assert "`llama-quantize --imatrix IMATRIX.gguf MODEL OUT IQ2_XXS`" in r.output and "Traceback" not in r.output
    r = invoke("quantize", str(tmp_path / "missing.gguf"), "-t", "q8_0")
    assert r.exit_code == 1 and "missing.gguf: no such file" in r.output
    r = invoke("quantize", str(shipped_model), "-t", "q8_0", "-o", str(shipped_model))
    assert r.exit_code == 1 and "onto itself" in r.output
    r = invoke("quantize", str(shipped_model), "-t", "q8_0", "-o", str(tmp_path / "no" / "such" / "x.gguf"))
    assert r.exit_code == 1 and "does not exist; create it (mkdir -p" in r.output and not (tmp_path / "no").exists()
    q = tmp_path / "q8.gguf"
    assert invoke("quantize", str(shipped_model), "-t", "q8_0", "-o", str(q), "-q").exit_code == 0
    r = invoke("quantize", str(q), "-t", "q2_k")  # refused before llama.cpp starts: no progress bar, no output
    assert r.exit_code == 1 and r.output.startswith(f"Error: cannot quantize {q}: it is quantized already (Q8_0 "
                                                    "tensors); start from its F32/F16/BF16 file, or allow "
                                                    "requantizing (--allow-requantize; quality suffers)")
    assert len(r.output.splitlines()) == 1
    assert not (tmp_path / "q8-q2_k.gguf").exists()
    assert invoke("quantize", str(q), "-t", "q2_k", "-q", "--allow-requantize").exit_code == 0
    assert (tmp_path / "q8-q2_k.gguf").is_file()
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    r = invoke("quantize", str(not_gguf), "-t", "q8_0")
    assert r.exit_code == 1 and "notes.gguf: not a GGUF file" in r.output  # our reason and fix, not llama.cpp's
    r = invoke("quantize", str(shipped_model), "-t", "q8_0", "--threads", "-1")
    assert r.exit_code == 1 and "--threads must be 0 (every core) or more" in r.output


def test_run_quiet(shipped_model: Path) -> None:
    loud = invoke("run", str(shipped_model), "-p", "Hello", "-n", "3", "--temp", "0", "--device", "cpu")
    quiet = invoke("run", str(shipped_model), "-p", "Hello", "-n", "3", "--temp", "0", "--device", "cpu", "--quiet")
    assert loud.exit_code == quiet.exit_code == 0
    # --quiet prints the text as generated; without it a newline follows, before the summary (stdout is no terminal)
    assert quiet.stdout + "\n" == loud.stdout and quiet.stdout.strip()
    assert "tokens/s" in loud.stderr
    assert quiet.stderr == ""


def test_verbose_logging(shipped_model: Path) -> None:
    args = ["chat", str(shipped_model), "--device", "cpu", "-n", "2", "--temp", "0"]
    plain = CliRunner().invoke(cli, args, input="hi\n")
    verbose = CliRunner().invoke(cli, ["-v", *args], input="hi\n")
    assert plain.exit_code == verbose.exit_code == 0
    assert "INFO specter_gguf.chat: chat template: the one in" in verbose.stderr
    assert "INFO" not in plain.stderr
    # without MODEL: the shipped model with its draft
    run = ["run", "-p", "Hello", "-n", "2", "--device", "cpu", "--gpu-budget", "64MiB"]
    verbose = CliRunner().invoke(cli, ["-v", *run])
    assert verbose.exit_code == 0, verbose.output
    assert f"INFO specter_gguf.engine: loaded {shipped_model.resolve()}: qwen2moe, 4 layers" in verbose.stderr
    assert "INFO specter_gguf.engine: memory budget 64.00 MiB: the whole model fits" in verbose.stderr
    assert "INFO specter_gguf.engine: speculative decoding with the experts of" in verbose.stderr
    assert "INFO specter_gguf.speculation.draft_files: " in verbose.stderr  # the draft made, or made before


@pytest.mark.parametrize("command", ["", "run", "serve", "chat", "quantize", "inspect", "logits"])
def test_help_shows_defaults(command: str) -> None:
    result = invoke(*([command] if command else []), "--help")
    assert result.exit_code == 0
    text = result.output
    flat = " ".join(text.split())  # help lines wrap anywhere
    if command in ("serve",):
        assert "[default: 127.0.0.1]" in flat and "[default: 8080]" in flat
    if command in ("run", "chat"):
        assert "[default: 0.8]" in flat and "[default: 0.95]" in flat
    if command == "quantize":
        assert "q4_k_m" in flat and "[required]" in flat
    if command == "":
        for name in ("run", "serve", "chat", "quantize"):
            assert re.search(rf"^\s+{name}\s", text, re.M), text
