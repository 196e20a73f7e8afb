"""The `specter-gguf` command line on the shipped model: `run` (JSON and streaming), `inspect`, `--help`; user
mistakes (bad options, files, output paths) end in one `Error:` line, before any work."""

from __future__ import annotations

import json
import os
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


def test_run_quiet_prints_the_text_as_generated(shipped_model: Path, greedy8: dict) -> None:
    """-q: the generated text and nothing else, no newline of ours after it (its stdout is no terminal here)."""
    result = invoke("run", str(shipped_model), "-p", PROMPT, "--device", "cpu", "-n", "8", "--temp", "0", "-q")
    assert result.exit_code == 0 and result.stdout == greedy8["text"] and result.stderr == "", result.output


def test_run_json_after_ctrl_c_has_what_was_generated(shipped_model: Path, greedy8: dict,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (here after three pieces of text) under --json prints the object of what was generated until then,
    finish_reason null, and exits 130 as without --json."""
    from specter_gguf.engine import Generation

    def interrupted_wait(gen: Generation) -> Generation:
        for _, _ in zip(range(3), gen):
            pass
        raise KeyboardInterrupt

    monkeypatch.setattr(Generation, "wait", interrupted_wait)
    result = invoke("run", str(shipped_model), "-p", PROMPT, "--device", "cpu", "-n", "8", "--temp", "0", "--json")
    out = json.loads(result.stdout)
    assert result.exit_code == 130 and "interrupted" in result.stderr
    assert out["finish_reason"] is None and 0 < len(out["text"]) < len(greedy8["text"])
    assert greedy8["text"].startswith(out["text"]) and out["stats"]["generated_tokens"] == len(out["tokens"]) >= 3


def test_run_ignore_eos_reaches_the_generation(shipped_model: Path, greedy8: dict,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """--ignore-eos is the engine's ignore_eos (what it does there: tests/test_engine.py); off by default."""
    from specter_gguf.engine import Model

    seen, generate = [], Model.generate
    monkeypatch.setattr(Model, "generate", lambda self, *a, **kw: (seen.append(kw["ignore_eos"]),
                                                                   generate(self, *a, **kw))[1])
    for flag in ([], ["--ignore-eos"]):
        assert run_json(shipped_model, "-n", "8", "--temp", "0", *flag)["tokens"] == greedy8["tokens"]
    assert seen == [False, True]


def test_a_seed_at_depth_auto_is_noted(shipped_model: Path) -> None:
    """The shipped model speculates at depth auto, where a seed does not repeat sampled output: run says so once,
    not at a fixed depth, greedily or without a draft."""
    def note(*args: str) -> int:
        result = invoke("run", "-p", PROMPT, "--device", "cpu", "-n", "2", *args)
        assert result.exit_code == 0, result.output
        return result.stderr.count("repeats sampled output at a fixed --n-draft")

    assert note("--seed", "3") == 1
    assert note("--seed", "3", "--n-draft", "2") == note("--seed", "3", "--temp", "0") == 0
    assert note("--seed", "3", "--draft", "none") == note() == 0


def test_draft_none_turns_the_shipped_draft_off(shipped_model: Path) -> None:
    """Without MODEL the shipped model speculates with its Q4_K_M draft; --draft none runs it alone (same tokens).
    `plan` takes none too (tests/test_speculative.py)."""
    with_draft = invoke("run", "-p", PROMPT, "--device", "cpu", "-n", "8", "--temp", "0", "--json")
    alone = invoke("run", "-p", PROMPT, "--device", "cpu", "-n", "8", "--temp", "0", "--json", "--draft", "none")
    a, b = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (with_draft, alone))
    assert a["stats"]["draft_rounds"] and b["stats"].get("draft_rounds") is None and a["tokens"] == b["tokens"]


def test_run_n_predict_zero(shipped_model: Path) -> None:
    out = run_json(shipped_model, "-n", "0", "--temp", "0")
    assert out["tokens"] == [] and out["text"] == ""
    assert out["stats"]["generated_tokens"] == 0 and out["stats"]["prompt_tokens"] == len(out["prompt_tokens"])
    result = invoke("run", str(shipped_model), "-p", PROMPT, "--device", "cpu", "-n", "0")
    assert result.exit_code == 0 and result.stdout == "\n", result.output
    assert out["stats"]["prefill_s"] > 0 and "no decode step to time" in result.stderr  # the prompt was evaluated


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


# -- user mistakes: one `Error:` line (exit 1, or 2 for click's usage errors), never a traceback ------------------

def user_error(result, code: int = 1) -> str:
    """The one `Error:` line of a refused command."""
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == code, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a model or quantizing fails the test: an error must come before either."""
    import specter_gguf.quantize
    from specter_gguf.engine import Model

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the command started its work before checking its options")

    monkeypatch.setattr(Model, "load", classmethod(forbidden))
    monkeypatch.setattr(specter_gguf.quantize, "quantize_gguf", forbidden)


@pytest.mark.parametrize("command", ["run", "chat"])
def test_n_predict_below_minus_one(shipped_model: Path, no_work: None, command: str) -> None:
    args = [command, str(shipped_model), "-n", "-5"] + (["-p", PROMPT] if command == "run" else [])
    line = user_error(invoke(*args), code=2)
    assert "-n" in line and "-1" in line, line


def test_prompt_file_not_utf8(shipped_model: Path, tmp_path: Path, no_work: None) -> None:
    prompt = tmp_path / "prompt.bin"
    prompt.write_bytes(b"\xff\xfe\x00binary")
    line = user_error(invoke("run", str(shipped_model), "-f", str(prompt)))
    assert str(prompt) in line and "UTF-8" in line, line


def test_prompt_from_both_p_and_f_is_refused(shipped_model: Path, tmp_path: Path, no_work: None) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def f():", encoding="utf-8")
    for command in ("run", "profile-depth"):
        line = user_error(invoke(command, str(shipped_model), "-p", PROMPT, "-f", str(prompt), "--draft", "q4_k_m"))
        assert "-p/--prompt or -f/--file, not both" in line, line


def test_prompt_file_dash_reads_standard_input(shipped_model: Path, greedy8: dict) -> None:
    result = CliRunner().invoke(cli, ["run", str(shipped_model), "-f", "-", "--device", "cpu", "--json", "-n", "8",
                                      "--temp", "0"], input=PROMPT)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == greedy8["tokens"]


def test_prompt_file_drops_one_trailing_newline(shipped_model: Path, greedy8: dict, tmp_path: Path) -> None:
    """As llama.cpp's -f: an editor's (or echo's) last newline is not part of the prompt; a second one is."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT + "\n", encoding="utf-8")
    for source, text in ((str(prompt), None), ("-", PROMPT + "\n")):
        result = CliRunner().invoke(cli, ["run", str(shipped_model), "-f", source, "--device", "cpu", "--json", "-n",
                                          "8", "--temp", "0"], input=text)
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["tokens"] == greedy8["tokens"]
    prompt.write_text(PROMPT + "\n\n", encoding="utf-8")
    result = CliRunner().invoke(cli, ["run", str(shipped_model), "-f", str(prompt), "--device", "cpu", "--json", "-n",
                                      "8", "--temp", "0"])
    assert json.loads(result.stdout)["prompt_tokens"] > greedy8["prompt_tokens"]


def test_fidelity_on_a_missing_file_is_one_error_line(tmp_path: Path, no_work: None) -> None:
    result = invoke("fidelity", str(tmp_path / "missing.gguf"))
    assert "missing.gguf: no such file" in user_error(result) and "generations" not in result.output  # no bar
    line = user_error(invoke("fidelity", "--drafts", "q2_k,q9"))
    assert line.startswith("Error: --drafts: draft q9: no such file, and not a draft type"), line


def test_fidelity_and_profile_depth_check_what_they_need_before_loading(shipped_model: Path, tmp_path: Path,
                                                                        no_work: None) -> None:
    """A draft file of another model, an output file that is a folder, an empty prompt and a prompt with -n past the
    context are each one error line before anything is loaded, quantized or generated."""
    from specter_gguf.synthetic.writer import write_synthetic

    pytest.importorskip("llama_cpp")  # the prompts' tokens
    other = write_synthetic(tmp_path / "mixtral.gguf", "tiny-mixtral", "f16").path
    (tmp_path / "out" / "fidelity.md").mkdir(parents=True)
    (tmp_path / "prompts.json").write_text(json.dumps(["x", ""]), encoding="utf-8")
    fidelity = ["fidelity", str(shipped_model), "--device", "cpu", "-n", "4", "-o", str(tmp_path / "f")]
    line = user_error(invoke(*fidelity, "--drafts", "q2_k,q8_0,q2_k"))
    assert line == "Error: --drafts names q2_k more than once: each draft is measured once", line
    line = user_error(invoke(*fidelity, "--drafts", f"q2_k,{other}"))
    assert line.startswith("Error: --drafts: ") and "is not a draft of" in line, line
    line = user_error(invoke(*fidelity[:-1], str(tmp_path / "out"), "--drafts", "q2_k"))
    assert "fidelity.md there is a folder" in line, line
    line = user_error(invoke(*fidelity, "--drafts", "q2_k", "--prompts", str(tmp_path / "prompts.json")))
    assert line == "Error: prompt 2 is empty: give it some text", line
    line = user_error(invoke(*fidelity, "--drafts", "q2_k", "-c", "8", "-n", "20"))
    assert "need a context of" in line and "above -c/--ctx-size 8" in line, line
    line = user_error(invoke("profile-depth", str(shipped_model), "--draft", "q2_k", "--device", "cpu", "-p", PROMPT,
                             "-n", "40", "-c", "16", "-o", str(tmp_path / "p")))
    assert "the prompt (" in line and "need a context of" in line, line


def test_profile_depth_has_no_n_draft_and_no_draft_none(shipped_model: Path, no_work: None) -> None:
    """It runs each depth of --depths and auto itself, and needs a draft: its help lists neither."""
    line = user_error(invoke("profile-depth", str(shipped_model), "--draft", "q4_k_m", "--n-draft", "3"), code=2)
    assert "No such option '--n-draft'" in line, line
    helptext = invoke("profile-depth", "--help").output
    assert "--n-draft" not in helptext and "none: no draft" not in helptext and "Required." in helptext
    assert "--n-draft" in invoke("run", "--help").output and "none: no draft" in invoke("run", "--help").output
    line = user_error(invoke("profile-depth", str(shipped_model), "--draft", "none"), code=2)
    assert "this command needs a draft" in line, line


def test_cache_options_without_offloading_are_refused(shipped_model: Path) -> None:
    line = user_error(invoke("run", str(shipped_model), "-p", PROMPT, "--device", "cpu", "--cache-policy", "lfu"))
    assert "--cache-policy" in line and "--gpu-budget" in line, line
    line = user_error(invoke("run", str(shipped_model), "-p", PROMPT, "--device", "cpu", "--cache-policy", "lfu",
                             "--gpu-budget", "1GiB"))
    assert "--cache-policy" in line and "fits the budget" in line, line


def test_plan_below_the_minimum_shows_no_shares(shipped_model: Path) -> None:
    result = invoke("plan", str(shipped_model), "--gpu-budget", "4MiB", "--device", "cpu")
    assert result.exit_code == 1 and "short of the fixed part by" in result.output, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("  ")]
    assert rows and not any("%" in line for line in rows) and "CUDA context" not in result.output, result.output
    assert user_error(result).startswith("Error: memory budget 4.00 MiB is too small")


@pytest.mark.parametrize("tokens", ["1,,5", "1,5,", ",1"])
def test_logits_tokens_with_an_empty_entry_are_refused(shipped_model: Path, tmp_path: Path, no_work: None,
                                                       tokens: str) -> None:
    line = user_error(invoke("logits", str(shipped_model), "--tokens", tokens, "--out", str(tmp_path / "l.npy")))
    assert "--tokens must be comma-separated integers" in line, line


def test_chat_stdin_not_utf8(shipped_model: Path) -> None:
    result = CliRunner().invoke(cli, ["chat", str(shipped_model), "--device", "cpu", "-n", "2"],
                                input=b"\xff\xfe hello\n")
    line = user_error(result)
    assert "standard input" in line and "UTF-8" in line, line


@pytest.mark.parametrize("budget,reason", [
    ("1" + "0" * 400 + "GiB", "too large"), ("1e400GiB", "too large"), ("-1GiB", "negative"),
    ("nan", "not a finite number"), ("inf", "not a finite number"), ("", "empty"), ("16XB", "unknown unit"),
    ("GiB", "write e.g."),
])
def test_gpu_budget_unreadable(shipped_model: Path, no_work: None, budget: str, reason: str) -> None:
    line = user_error(invoke("run", str(shipped_model), "-p", PROMPT, "--gpu-budget", budget))
    assert line.startswith("Error: --gpu-budget: cannot read the size") and reason in line, line
    line = user_error(invoke("plan", str(shipped_model), "--gpu-budget", budget))
    assert line.startswith("Error: --gpu-budget: cannot read the size") and reason in line and len(line) < 300, line


def test_plan_zero_budget(shipped_model: Path) -> None:
    assert "more than 0" in user_error(invoke("plan", str(shipped_model), "--gpu-budget", "0"))
    assert user_error(invoke("plan", str(shipped_model), "--gpu-budget", "0GiB")).startswith("Error: --gpu-budget 0GiB:")


def test_a_small_bare_budget_asks_for_its_unit(shipped_model: Path, no_work: None) -> None:
    """"16" reads as 16 bytes: for a budget below a MiB without a unit the line says that and shows a unit to add."""
    for args in (["plan", str(shipped_model)], ["run", str(shipped_model), "-p", PROMPT]):
        for budget, unit in (("16", "GiB"), ("1.5", "GiB"), ("4096", "MiB")):
            line = user_error(invoke(*args, "--gpu-budget", budget))
            assert line == (f"Error: --gpu-budget {budget}: a number without a unit counts bytes; give the unit, "
                            f"e.g. {budget}{unit}"), line


def test_plan_spare_slots_and_a_budget_below_the_minimum(shipped_model: Path) -> None:
    """--spare-slots beyond a layer's room is cut, and plan says so (run warns); below the minimum plan shows the
    split and the error, no lines on a cache that cannot exist."""
    out = invoke("plan", str(shipped_model), "--gpu-budget", "20MiB", "--device", "cpu", "--draft", "none",
                 "--spare-slots", "8").stdout
    assert "spare slots: 2 of each MoE layer's 4" in out and "(--spare-slots 8: at most 2 fit beside a token's 2" in out
    result = invoke("plan", str(shipped_model), "--gpu-budget", "10MiB", "--device", "cpu", "--draft", "none")
    assert "minimum budget" in result.stdout and "spare slots" not in result.stdout and "hybrid" not in result.stdout
    assert user_error(result).startswith("Error: memory budget 10.00 MiB is too small")
    result = invoke("plan", str(shipped_model), "--gpu-budget", "10MiB", "--device", "cpu", "--draft", "none",
                    "--json")
    got = json.loads(result.stdout.splitlines()[0])
    assert result.exit_code == 1 and got["spare_slots"] is None and got["hybrid"] is None
    assert got["lends_spares"] is None
    run = invoke("run", str(shipped_model), "-p", PROMPT, "-n", "2", "--device", "cpu", "--gpu-budget", "20MiB",
                 "--draft", "none", "--spare-slots", "8")
    assert run.exit_code == 0 and "--spare-slots 8: each MoE layer's 4 slots hold 2" in run.stderr


def output_cases(tmp_path: Path) -> dict[str, Path]:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    return {"missing folder": tmp_path / "missing" / "out.bin", "parent is a file": blocker / "out.bin"}


def output_commands(model: Path, out: Path) -> dict[str, list[str]]:
    return {
        "logits": ["logits", str(model), "--tokens", "1,2", "--out", str(out)],
        "quantize": ["quantize", str(model), "-t", "q8_0", "-o", str(out), "-q"],
        "run": ["run", str(model), "-p", PROMPT, "--save-routing-profile", str(out)],
    }


@pytest.mark.parametrize("command", ["logits", "quantize", "run"])
@pytest.mark.parametrize("case", ["missing folder", "parent is a file"])
def test_output_file_checked_before_work(shipped_model: Path, tmp_path: Path, no_work: None, command: str,
                                         case: str) -> None:
    out = output_cases(tmp_path)[case]
    if command == "quantize" and case == "missing folder":
        pytest.skip("quantize creates a missing folder (tests/test_quantize_cli.py)")
    line = user_error(invoke(*output_commands(shipped_model, out)[command]))
    assert str(out) in line, line
    assert ("does not exist" in line and "mkdir -p" in line) if case == "missing folder" else "is a file" in line
    assert not out.parent.exists() or out.parent.is_file()  # nothing was created


def test_output_folder_of_profile_depth_checked_before_work(shipped_model: Path, tmp_path: Path,
                                                            no_work: None) -> None:
    blocker = output_cases(tmp_path)["parent is a file"].parent
    line = user_error(invoke("profile-depth", str(shipped_model), "--draft", str(shipped_model),
                             "-o", str(blocker / "sub")))
    assert "is a file" in line, line
    user_error(invoke("profile-depth", str(shipped_model), "--draft", str(shipped_model), "-o", str(blocker)), 2)
    # a missing folder is fine (it is created when the profile is written): the next check speaks
    line = user_error(invoke("profile-depth", str(shipped_model), "-o", str(tmp_path / "new" / "folder")))
    assert "needs a draft" in line, line
    assert "--repeats" in user_error(invoke("profile-depth", str(shipped_model), "--repeats", "0"))


@pytest.mark.parametrize("tokens,expected", [("", "empty"), (",", "empty"), ("1,-3", "negative"),
                                             ("1,x", "comma-separated integers"), ("99999", "vocabulary has")])
def test_logits_bad_tokens(shipped_model: Path, tmp_path: Path, tokens: str, expected: str) -> None:
    out = tmp_path / "logits.npy"
    line = user_error(invoke("logits", str(shipped_model), "--tokens", tokens, "--out", str(out), "--device", "cpu"))
    assert expected in line, line
    assert not out.exists()


def test_logits_writes_the_path_given(shipped_model: Path, tmp_path: Path) -> None:
    import numpy as np

    out = tmp_path / "logits.bin"
    result = invoke("logits", str(shipped_model), "--tokens", "1,2,3", "--out", str(out), "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert out.is_file() and not (tmp_path / "logits.bin.npy").exists()
    assert np.load(out).shape[0] == 3


@pytest.mark.parametrize("command", ["run", "inspect", "plan", "logits", "quantize", "profile-depth"])
@pytest.mark.parametrize("model", ["missing.gguf", "."])
def test_model_missing_or_a_folder(shipped_model: Path, tmp_path: Path, command: str, model: str) -> None:
    path = tmp_path / model
    extra = {"run": ["-p", PROMPT], "plan": ["--gpu-budget", "1GiB"], "quantize": ["-t", "q8_0", "-q"],
             "logits": ["--tokens", "1", "--out", str(tmp_path / "o.npy")],
             "profile-depth": ["--draft", str(shipped_model)]}
    line = user_error(invoke(command, str(path), *extra.get(command, [])))
    assert any(w in line for w in ("no such file", "not a file", "does not exist", "not found")), line


@pytest.mark.parametrize("args,expected", [
    (["--top-p", "2"], "invalid --top-p 2.0"), (["--temp", "nan"], "invalid --temp nan"),
    (["--seed", "-2"], "invalid --seed -2: use -1 (random) or an integer from 0 to 2**64-1"),
    (["--ctx-size", "-1"], "context size"),
    (["--repeat-last-n", "-2"], "invalid --repeat-last-n -2"), (["--min-p", "-1"], "invalid --min-p -1.0"),
    (["--repeat-penalty", "0"], "invalid --repeat-penalty 0.0"),
])
def test_bad_sampling_and_context_options(shipped_model: Path, args: list[str], expected: str) -> None:
    line = user_error(invoke("run", str(shipped_model), "-p", PROMPT, "--device", "cpu", *args))
    assert expected in line, line


def test_bad_option_types_are_usage_errors(shipped_model: Path) -> None:
    for args in (["-n", "abc"], ["--temp", "hot"], ["--device", "tpu"], ["--n-draft", "0"]):
        user_error(invoke("run", str(shipped_model), "-p", PROMPT, *args), code=2)


def test_seed_minus_one_is_random(shipped_model: Path) -> None:
    out = run_json(shipped_model, "-n", "2", "--seed", "-1")
    assert len(out["tokens"]) <= 2


def test_nan_logits_message_names_real_options() -> None:
    from specter_gguf.sampling import NAN_LOGITS

    options = {opt for param in cli.commands["run"].params for opt in param.opts}
    named = re.findall(r"--[a-z][a-z-]*", NAN_LOGITS)
    assert named and all(o in options for o in named), (named, NAN_LOGITS)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write anywhere")
def test_output_in_unwritable_folder(shipped_model: Path, tmp_path: Path, no_work: None) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        line = user_error(invoke("logits", str(shipped_model), "--tokens", "1", "--out", str(locked / "o.npy")))
        assert "permission" in line, line
        line = user_error(invoke("profile-depth", str(shipped_model), "--draft", str(shipped_model),
                                 "-o", str(locked / "sub")))
        assert "not writable" in line, line
    finally:
        locked.chmod(0o700)


def test_verbose_after_the_command_says_where_it_goes(shipped_model: Path, no_work: None) -> None:
    line = user_error(invoke("run", str(shipped_model), "-p", PROMPT, "-v"), code=2)
    assert "No such option '-v'" in line and "goes before the command: specter-gguf -v run" in line, line
