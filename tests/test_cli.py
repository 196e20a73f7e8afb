"""The `specter-gguf` command line on the shipped model: `run` (JSON and streaming), `inspect`, `--help`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from specter_gguf.cli import cli

PROMPT = "Once upon a time"
STATS_KEYS = {"prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "tpot_ms", "tokens_per_s"}
SUMMARY = re.compile(r"prompt \d+ tokens, generated \d+ tokens, .*tokens/s")


def invoke(*args: str):
    result = CliRunner().invoke(cli, list(args))
    assert "Traceback" not in result.output, result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def run_json(model: Path | None, *args: str) -> dict:
    base = ["run"] + ([str(model)] if model is not None else [])
    result = invoke(*base, "-p", PROMPT, "--device", "cpu", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def greedy8(shipped_model: Path) -> dict:
    return run_json(shipped_model, "-n", "8", "--temp", "0")


def test_run_json_greedy(greedy8: dict) -> None:
    out = greedy8
    assert {"text", "tokens", "prompt_tokens", "stats"} <= set(out), out
    assert set(out["stats"]) >= STATS_KEYS, out["stats"]
    assert isinstance(out["text"], str) and all(isinstance(t, int) for t in out["tokens"])
    assert out["prompt_tokens"] and all(isinstance(t, int) for t in out["prompt_tokens"])
    if out.get("finish_reason") == "stop":  # an end-of-generation token came first
        assert len(out["tokens"]) < 8
    else:
        assert len(out["tokens"]) == 8 and out.get("finish_reason", "length") == "length"
    stats = out["stats"]
    assert stats["prompt_tokens"] == len(out["prompt_tokens"])
    assert stats["generated_tokens"] == len(out["tokens"])
    assert stats["prefill_s"] > 0 and stats["decode_s"] >= 0
    assert stats["tpot_ms"] >= 0 and stats["tokens_per_s"] >= 0
    if len(out["tokens"]) > 1:
        assert stats["tpot_ms"] > 0 and stats["tokens_per_s"] > 0


def test_run_json_greedy_is_deterministic(shipped_model: Path, greedy8: dict) -> None:
    again = run_json(shipped_model, "-n", "8", "--temp", "0")
    assert again["tokens"] == greedy8["tokens"] and again["text"] == greedy8["text"]


def test_run_default_model_is_the_shipped_one(greedy8: dict) -> None:
    assert run_json(None, "-n", "8", "--temp", "0")["tokens"] == greedy8["tokens"]


def test_run_sampling_same_seed_same_tokens(shipped_model: Path) -> None:
    a = run_json(shipped_model, "-n", "16", "--temp", "1", "--seed", "1234")
    b = run_json(shipped_model, "-n", "16", "--temp", "1", "--seed", "1234")
    assert a["tokens"] == b["tokens"] and a["text"] == b["text"]
    others = [run_json(shipped_model, "-n", "16", "--temp", "1", "--seed", str(s))["tokens"] for s in (1, 2, 3)]
    assert any(o != a["tokens"] for o in others), "the seed does not change what is sampled"


def test_run_streaming_prints_text_then_summary(shipped_model: Path, greedy8: dict) -> None:
    result = invoke("run", str(shipped_model), "-p", PROMPT, "--device", "cpu", "-n", "8", "--temp", "0")
    assert result.exit_code == 0, result.output
    assert result.stdout == greedy8["text"] + "\n"
    last = [line for line in result.stderr.replace("\r", "\n").splitlines() if line.strip()][-1]
    assert SUMMARY.search(last), f"no summary line at the end of stderr: {result.stderr!r}"
    assert f"generated {len(greedy8['tokens'])} tokens" in last


def test_run_n_predict_zero(shipped_model: Path) -> None:
    out = run_json(shipped_model, "-n", "0", "--temp", "0")
    assert out["tokens"] == [] and out["text"] == ""
    assert out["stats"]["generated_tokens"] == 0 and out["stats"]["prompt_tokens"] == len(out["prompt_tokens"])
    result = invoke("run", str(shipped_model), "-p", PROMPT, "--device", "cpu", "-n", "0")
    assert result.exit_code == 0 and result.stdout == "\n", result.output


def test_run_stop_truncates(shipped_model: Path) -> None:
    full = run_json(shipped_model, "-n", "24", "--temp", "0")
    text = full["text"]
    # a stop string that first occurs strictly inside the text
    stop = next((text[i:i + 3] for i in range(1, len(text) - 3)
                 if text[i:i + 3].strip() and text.find(text[i:i + 3]) == i), None)
    if stop is None:
        pytest.skip(f"greedy text too short or repetitive for a stop string: {text!r}")
    cut = run_json(shipped_model, "-n", "24", "--temp", "0", "--stop", stop)
    assert cut["text"] == text[:text.index(stop)], (stop, text, cut["text"])
    assert cut.get("finish_reason", "stop") == "stop"
    assert len(cut["tokens"]) < len(full["tokens"]) and cut["tokens"] == full["tokens"][:len(cut["tokens"])]
    # streaming mode stops at the same place and never prints the stop string
    result = invoke("run", str(shipped_model), "-p", PROMPT, "--device", "cpu", "-n", "24", "--temp", "0",
                    "--stop", stop)
    assert result.exit_code == 0 and result.stdout == cut["text"] + "\n", result.output


def test_inspect(shipped_model: Path) -> None:
    result = invoke("inspect", str(shipped_model))
    assert result.exit_code == 0, result.output
    out = result.output
    assert re.search(r"^architecture\s+qwen2moe$", out, re.M), out
    assert re.search(r"^layers\s+\d+", out, re.M), out
    assert re.search(r"^experts\s+\d+ routed, \d+ used per token", out, re.M), out
    assert re.search(r"\d+(\.\d+)? (B|KiB|MiB|GiB)", out), out  # sizes in bytes
    assert "F16" in out  # bytes per tensor type


@pytest.mark.parametrize("command", [None, "run", "logits", "inspect"])
def test_help(command: str | None) -> None:
    args = ["--help"] if command is None else [command, "--help"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_help_of_every_command() -> None:
    for name in cli.commands:
        result = invoke(name, "--help")
        assert result.exit_code == 0 and "Usage:" in result.output, (name, result.output)


def test_run_without_prompt_is_an_error(shipped_model: Path) -> None:
    result = invoke("run", str(shipped_model), "--device", "cpu", "-n", "1")
    assert result.exit_code == 1 and result.output.startswith("Error: ") and "prompt" in result.output
