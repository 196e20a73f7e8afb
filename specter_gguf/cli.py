"""The `specter-gguf` command line. Option names follow llama.cpp's where one exists. The commands use the engine's
public API (`engine`, `sampling`, `chat`, `server`) and the tools built on it (`quantize`, `speculation.profile`)."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import click
import numpy as np

from specter_gguf.engine import (DEFAULT_HYBRID, DRAFT_TYPES, HYBRID_CHOICES, MAX_DEPTH, MAX_FIXED_DEPTH,
                                 MAX_SPARES, OFFLOAD_CHOICES, POLICIES, SHIPPED_DRAFT, SPARES_WITH_LOOKAHEAD,
                                 draft_file_or_type, parse_depth)
from specter_gguf.errors import ContextFullError, SpecterError
from specter_gguf.gguf_file import model_name
from specter_gguf.outputs import check_output_file, check_output_folder
from specter_gguf.quantize import FTYPES, NEEDS_IMATRIX, needs_imatrix_message
from specter_gguf.runtime.budget import budget_bytes
from specter_gguf.sizes import KiB, MiB, format_size, names_unit


class Cli(click.Group):
    """Reports a `SpecterError` as one line (`Error: ...`, exit 1) instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SpecterError as e:
            raise click.ClickException(str(e)) from None
        except click.NoSuchOption as e:  # -v is the group's: `specter-gguf -v run ...`
            if e.option_name in ("-v", "-vv", "-vvv", "--verbose") and ctx.invoked_subcommand:
                e.message += f" (-v/--verbose goes before the command: specter-gguf -v {ctx.invoked_subcommand} ...)"
            raise
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            ctx.exit(130)


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="specter-gguf")
@click.option("-v", "--verbose", count=True, show_default=False,
              help="Log more: -v info, -vv debug (llama.cpp's own log included).")
def cli(verbose: int) -> None:
    """Run Mixture-of-Experts GGUF models fast on one GPU."""
    _setup_logging(verbose)


def _setup_logging(verbose: int) -> None:
    """specter_gguf's loggers print to the current stderr: warnings always, info with -v, debug with -vv."""
    import logging

    class StderrHandler(logging.StreamHandler):
        stream = property(lambda self: sys.stderr, lambda self, value: None)  # stderr as it is at each record

    logger = logging.getLogger("specter_gguf")
    if not any(type(h).__name__ == "StderrHandler" for h in logger.handlers):
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG)
    logger.propagate = False


def model_argument(required: bool) -> Any:
    # existence and file-ness are checked by the loader, which words the error and exits 1
    return click.argument("model", required=required, type=click.Path(path_type=Path))


def _check_n_predict(ctx: click.Context, param: click.Parameter, value: int) -> int:
    if value < -1:
        raise click.BadParameter(f"{value} is below -1: give a number of tokens (0 or more), or -1 for no limit "
                                 "(until the end of text or a full context)", ctx, param)
    return value


def _read_prompt_file(path: Path) -> str:
    """The text of a -f/--file prompt (`-`: standard input) without one trailing newline (as llama.cpp's -f reads
    it: an editor's or echo's last newline is not part of the prompt), or one error line naming the file."""
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
        return text[:-1] if text.endswith("\n") else text
    except UnicodeDecodeError as e:
        raise SpecterError(f"cannot read the prompt file {path}: it is not UTF-8 text (byte {e.start}); "
                           "save it as UTF-8 (e.g. iconv -t UTF-8) or give the prompt with -p") from None
    except OSError as e:
        raise SpecterError(f"cannot read the prompt file {path}: {e.strerror or e}") from None


def _check_output_file(path: Path, option: str, create_folder: bool = False) -> None:
    """`outputs.check_output_file` for `option`: before any work, so a typo does not cost a model load."""
    check_output_file(path, f"{option} {path}", create_folder)


def _check_output_folder(path: Path, option: str, files: Sequence[str] = ()) -> None:
    """`path` a folder the command can write, and each of `files` in it (e.g. not a read-only file or a folder)."""
    check_output_folder(path, f"{option} {path}")
    for name in files:
        if (path / name).is_dir():
            raise SpecterError(f"{option} {path}: {name} there is a folder, where this command writes a file; "
                               f"remove it or choose another {option}")
        _check_output_file(path / name, option, create_folder=True)


def _check_prompts_fit(f: Any, prompts: Sequence[str], n_predict: int, ctx_size: int | None,
                       name: Callable[[int], str]) -> None:
    """Each of `prompts` (the ith called `name(i)`) and `n_predict` tokens after it fit the context a load of the
    model `f` (a GGUFFile) with -c `ctx_size` gives (`config.check_room`), read from the file before anything is
    loaded."""
    from specter_gguf.config import ModelConfig, check_room
    from specter_gguf.tokenizer import Tokenizer

    ctx = ModelConfig.from_gguf(f).context_size(ctx_size)
    tokenizer = Tokenizer.from_gguf(f.path)
    for i, prompt in enumerate(prompts):
        check_room(len(tokenizer.encode(prompt)), n_predict, ctx, name(i))


ctx_size_option = click.option("-c", "--ctx-size", type=int, default=None, show_default=False,
                               help="Context size in tokens (default: the model's own, at most 4096; 0: the "
                               "model's own, llama.cpp's default).")
device_option = click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
                             help="Where to run (default: cuda when a GPU is present, else cpu).")


class DraftDepth(click.ParamType):
    """`--n-draft`: a whole number of at least 1, or auto."""

    name = "K|auto"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            return parse_depth(value)
        except SpecterError as e:  # click names the option itself
            self.fail(str(e).removeprefix("--n-draft "), param, ctx)


class DraftFile(click.ParamType):
    """`--draft`: a draft GGUF, or a type (q4_k_m, ...) whose draft the engine makes from the model on first use;
    with `allow_none`, "none" too (no draft, where one is used by default)."""

    name = "FILE|TYPE"

    def __init__(self, allow_none: bool = False) -> None:
        self.allow_none = allow_none

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "none":
            if self.allow_none:
                return "none"
            self.fail("this command needs a draft: give a draft GGUF or a type such as q4_k_m", param, ctx)
        try:
            return draft_file_or_type(value)
        except SpecterError as e:
            self.fail(str(e), param, ctx)


DRAFT_HELP = (f"Decode speculatively with the experts of a quantized copy of the model: a file, or a type (such as "
              f"{', '.join(DRAFT_TYPES)}: any of `specter-gguf quantize --type`) made from the model with llama.cpp's "
              f"quantizer on first use and kept beside it in .specter-drafts/ (or the user cache); the output is the "
              f"model's own.")


def _with_options(f: Any, options: list[Any]) -> Any:
    for option in reversed(options):
        f = option(f)
    return f


SAMPLING_FLAGS = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
                  "repeat_penalty": "--repeat-penalty", "repeat_last_n": "--repeat-last-n", "seed": "--seed"}


SEED_HELP = ("Random seed (default or -1: random). With --draft, sampled output repeats for a seed at a fixed "
             "--n-draft; auto chooses its depths from measured timings, which move the draws.")


def _note_seed_at_depth_auto(m: Any, sampling: Any) -> None:
    """A user who gives a seed expects the output to repeat: say where it will not (SEED_HELP)."""
    if sampling.seed is not None and not sampling.greedy and getattr(m.decoder, "auto_depth", False):
        click.echo(f"note: --seed {sampling.seed} repeats sampled output at a fixed --n-draft, not at depth auto "
                   "(its depths follow measured timings, which move the draws)", err=True)


def sampling_options(f: Any, seed_help: str = SEED_HELP) -> Any:
    """llama.cpp's sampling options; the command receives them as one `sampling: SamplingParams`."""

    @functools.wraps(f)
    def command(*args: Any, temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float,
                repeat_last_n: int, seed: int | None, **kwargs: Any) -> Any:
        from specter_gguf.sampling import SamplingOptionError, SamplingParams

        try:
            sampling = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                      repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                                      seed=None if seed == -1 else seed)  # -1: random, as llama.cpp
        except SamplingOptionError as e:  # named by the flag the user gave
            fix = "use -1 (random) or an integer from 0 to 2**64-1" if e.option == "seed" else e.fix
            raise SpecterError(f"invalid {SAMPLING_FLAGS.get(e.option, e.option)} {e.value!r}: {fix}") from None
        return f(*args, sampling=sampling, **kwargs)

    return _with_options(command, [
        click.option("--temp", default=0.8, help="Temperature; 0 = greedy."),
        click.option("--top-k", default=40, help="Keep the k most likely tokens (0 = off)."),
        click.option("--top-p", default=0.95, help="Nucleus sampling threshold (1.0 = off)."),
        click.option("--min-p", default=0.05, help="Drop tokens below min-p times the top probability (0 = off)."),
        click.option("--repeat-penalty", default=1.0, help="Penalty for repeated tokens (1.0 = off)."),
        click.option("--repeat-last-n", default=64, help="Tokens the repeat penalty looks back over (-1 = context)."),
        click.option("--seed", type=int, default=None, help=seed_help),
    ])


GPU_BUDGET_HELP = ("Device memory budget, e.g. 16GiB, 12000MiB, 1.5GB (GB: 10^9 bytes; G and GiB: 2^30; a bare number: "
                   "bytes, at least a MiB)")
# --spare-slots' default, as `runtime.offload.spares_per_layer` computes it (run's and plan's help)
SPARE_SLOTS_DEFAULT = (f"twice the experts a token uses, at most {MAX_SPARES} and half the layer's slots beyond one "
                       f"token's experts, {SPARES_WITH_LOOKAHEAD} with a draft")


def _gpu_budget(text: str) -> int:
    """--gpu-budget in bytes (`budget_bytes`), or one error line naming the option (and the unit a small bare number
    lacks)."""
    size = budget_bytes(text)
    if not names_unit(text) and size < MiB:
        unit = "GiB" if size < KiB else "MiB"
        raise SpecterError(f"--gpu-budget {text}: a number without a unit counts bytes; give the unit, e.g. "
                           f"{text.strip()}{unit}")
    return size


def load_options(f: Any = None, *, depth: bool = True) -> Any:
    """Where and how the model is loaded (device, context, GPU budget, offloading, draft); the command receives a
    `load(model, progress)` that loads it with them. `depth=False` (profile-depth, which runs every depth itself):
    no --n-draft, and no --draft none."""
    if f is None:
        return functools.partial(load_options, depth=depth)

    @functools.wraps(f)
    def command(*args: Any, device: str | None, ctx_size: int | None, gpu_budget: str | None, offload: str | None,
                cache_policy: str | None, routing_profile: Path | None, hybrid: str, spare_slots: int | None,
                cuda_graphs: bool, draft: Path | str | None, n_draft: int | str | None = None, **kwargs: Any) -> Any:
        def load(model: Path | None, progress: bool) -> Any:
            from specter_gguf.engine import Model

            budget = _gpu_budget(gpu_budget) if gpu_budget is not None else None  # a wrong size: before any work
            chosen = SHIPPED_DRAFT if model is None and draft is None else draft  # the shipped model speculates
            chosen = None if chosen == "none" else chosen
            return Model.load(model, device=device, ctx_size=ctx_size, progress=progress, gpu_budget=budget,
                              offload=offload, cache_policy=cache_policy, routing_profile=routing_profile,
                              cuda_graphs=cuda_graphs, draft=chosen, n_draft=n_draft, hybrid=hybrid,
                              spare_slots=spare_slots)

        return f(*args, load=load, **kwargs)

    return _with_options(command, [
        device_option,
        ctx_size_option,
        click.option("--gpu-budget", default=None, help=GPU_BUDGET_HELP + ": weights, "
                     "KV cache, workspace and an expert cache are planned within it (see `specter-gguf plan`)."),
        click.option("--offload", type=click.Choice(OFFLOAD_CHOICES), default=None,
                     help="Routed experts in host memory with a device expert cache (needs --gpu-budget). "
                     "Default: lru when the model does not fit the budget, none otherwise."),
        click.option("--cache-policy", type=click.Choice(POLICIES), default=None,
                     help="Expert-cache eviction policy (default lru; static-hot with --routing-profile)."),
        click.option("--routing-profile", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     default=None, help="Routing profile (JSON) for the static-hot policy."),
        click.option("--hybrid", type=click.Choice(HYBRID_CHOICES), default=DEFAULT_HYBRID, show_default=True,
                     help="Offloaded experts that a decode step, a verification or a short prefill misses: split "
                     "between the CPU and PCIe by their costs measured at load (on), or all read over PCIe (off); "
                     "auto turns it on where the CPU computes an expert for one token in less than two copies' "
                     "time (then the split can give it some); off on the CPU device and for experts under 1 MiB."),
        click.option("--spare-slots", type=click.IntRange(0, MAX_SPARES), default=None,
                     help="Expert-cache slots per MoE layer kept free for a forward to copy the experts it misses "
                     "into as it computes them, so that they cross PCIe once and the next token finds them "
                     f"(--offload lru; default {SPARE_SLOTS_DEFAULT}; 0: misses are read in place and copied into "
                     "the cache after the forward). With --hybrid, where routing does not repeat from token to "
                     "token, the spare slots are lent to the cache and only experts used more often than the one "
                     "they would evict are copied in."),
        click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
                     help="Replay each decode step, draft step and verification as a CUDA graph (CUDA; not with "
                     "--offload gate-prefetch)."),
        click.option("--draft", type=DraftFile(allow_none=depth), default=None,
                     help=DRAFT_HELP + (f" Where MODEL may be left out, the shipped model runs with a {SHIPPED_DRAFT} "
                                        "draft; none: no draft." if depth else " Required.")),
        *([click.option("--n-draft", type=DraftDepth(), default=None, show_default=False,
                        help=f"Tokens drafted per verification (with --draft), 1 to {MAX_FIXED_DEPTH}. Default auto: "
                        f"chosen each iteration, from 0 (a plain step, when drafting does not pay) to {MAX_DEPTH}, "
                        "from the measured acceptance and costs of drafting and verifying.")] if depth else []),
    ])


@cli.command()
@model_argument(required=False)
@click.option("-p", "--prompt", help="Prompt text.")
@click.option("-f", "--file", "prompt_file", type=click.Path(exists=True, dir_okay=False, allow_dash=True,
                                                             path_type=Path),
              help="Read the prompt from a file (-: standard input); one trailing newline is dropped, as llama.cpp "
              "does.")
@click.option("-n", "--n-predict", default=128, callback=_check_n_predict,
              help="Tokens to generate (-1: until end of text or full context).")
@sampling_options
@click.option("--stop", multiple=True, help="Stop when this text is generated (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Go on past an end-of-generation token, to -n tokens or a full "
              "context (llama.cpp's --ignore-eos).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("-q", "--quiet", is_flag=True, help="Print only the generated text: no progress bar, no summary line.")
@load_options
@click.option("--save-routing-profile", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Count the experts each layer routes to during this run and write them as a routing profile.")
@click.option("--stats", "show_stats", is_flag=True, help="Print every statistic of the run (timings, expert cache, "
              "copies, peak GPU memory) to stderr; with --json they are in its \"stats\" instead.")
def run(model: Path | None, prompt: str | None, prompt_file: Path | None, n_predict: int, sampling: Any,
        stop: tuple[str, ...], ignore_eos: bool, as_json: bool, quiet: bool, load: Any,
        save_routing_profile: Path | None, show_stats: bool) -> None:
    """Generate text from MODEL (default: the small model shipped in models/)."""
    if prompt_file is not None:
        if prompt is not None:
            raise SpecterError("give the prompt with -p/--prompt or -f/--file, not both")
        prompt = _read_prompt_file(prompt_file)
    if prompt is None:
        raise SpecterError("no prompt: give one with -p/--prompt TEXT or -f/--file PATH")
    if save_routing_profile is not None:
        _check_output_file(save_routing_profile, "--save-routing-profile")
    m = load(model, progress=not (as_json or quiet))
    _note_seed_at_depth_auto(m, sampling)  # on stderr: scripts that repeat a seed need it most
    if save_routing_profile is not None:
        m.record_routing()
    gen = m.generate(prompt, n_predict=n_predict, sampling=sampling, stop=stop, ignore_eos=ignore_eos)

    def as_json_line() -> str:
        return json.dumps({"text": gen.text, "tokens": gen.tokens, "prompt_tokens": gen.prompt_tokens,
                           "finish_reason": gen.finish_reason, "stats": gen.stats.to_dict()})

    try:
        if as_json:
            gen.wait()
        else:
            for piece in gen:
                click.echo(piece, nl=False)
                sys.stdout.flush()
    except KeyboardInterrupt:  # what was generated until then, as llama.cpp prints its timings; then "interrupted"
        gen.close()
        if as_json:
            click.echo(as_json_line())  # finish_reason null: stopped before its end
        elif not quiet:
            click.echo(f"\n{gen.stats.summary()}", err=True)
        raise
    if save_routing_profile is not None:
        m.routing_profile().save(save_routing_profile)
    if as_json:
        click.echo(as_json_line())
        return
    if not quiet or sys.stdout.isatty():  # -q: the text as generated (a terminal's next line still apart)
        click.echo()
    if not quiet:
        click.echo(gen.stats.summary(), err=True)
    if show_stats:
        for key, value in gen.stats.to_dict().items():
            if key == "iterations" and value:  # per verification pass: depth/drafts kept:verification ms
                value = " ".join(f"{k}/{kept}:{1000 * t:.2f}" for k, kept, t in value)
            elif isinstance(value, list):  # per layer
                value = " ".join("-" if v is None else f"{v:.4g}" for v in value)
            elif isinstance(value, dict):  # per draft depth
                value = " ".join(f"{k}:{v:.4g}" for k, v in value.items()) or None
            if value is not None:
                click.echo(f"  {key:<24} {value:.6g}" if isinstance(value, float) else f"  {key:<24} {value}", err=True)


DEPTH_PROMPT = ("The history of the printing press begins long before Gutenberg: in China, carved wooden blocks "
                "were used to print whole pages of text and images, and")


@cli.command("profile-depth")
@model_argument(required=True)
@click.option("-p", "--prompt", default=DEPTH_PROMPT, show_default=False,
              help="Prompt text (default: a sentence about the printing press).")
@click.option("-f", "--file", "prompt_file", type=click.Path(exists=True, dir_okay=False, allow_dash=True,
                                                             path_type=Path),
              help="Read the prompt from a file instead (-: standard input; one trailing newline dropped).")
@click.option("-n", "--n-predict", default=64, help="Tokens generated per run.")
@click.option("--depths", default=f"1-{MAX_DEPTH}", help=f"Fixed depths to measure, from 1 to {MAX_DEPTH} (auto's "
              "range), e.g. 1-8 or 1,2,4,8 (auto is always measured too).")
@click.option("--repeats", default=2, help="Measured runs per depth (after one run that is not counted).")
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), default=Path("profile-depth"),
              help="Folder for depth.md, depth.json and depth.png.")
@functools.partial(sampling_options, seed_help="Random seed (default or -1: random), the same for every run: sampled "
                   "runs at a fixed depth repeat, auto's depths follow measured timings and move the draws.")
@load_options(depth=False)
def profile_depth(model: Path, prompt: str, prompt_file: Path | None, n_predict: int, depths: str, repeats: int,
                  out: Path, sampling: Any, load: Any) -> None:
    """Measure speculative decoding of MODEL with --draft at each draft depth k and at auto: time per token,
    acceptance, tokens per verification, draft step and verification times; print the table and write it with
    a plot of time per token against k."""
    from tqdm import tqdm

    from specter_gguf.gguf_file import GGUFFile
    from specter_gguf.speculation.profile import (OUTPUT_FILES, best_fixed, markdown_table, parse_depths,
                                                  profile_depths, write_profile)

    ks = parse_depths(depths, MAX_DEPTH)
    ctx = click.get_current_context()
    if prompt_file is not None:
        if ctx.get_parameter_source("prompt") is not click.core.ParameterSource.DEFAULT:
            raise SpecterError("give the prompt with -p/--prompt or -f/--file, not both")
        prompt = _read_prompt_file(prompt_file)
    if n_predict < 2:
        raise SpecterError(f"-n/--n-predict must be at least 2 to measure decoding, got {n_predict}")
    if repeats < 1:
        raise SpecterError(f"--repeats must be at least 1, got {repeats}")
    draft = ctx.params.get("draft")
    if draft is None:
        raise SpecterError("profile-depth needs a draft: give --draft DRAFT.gguf or a type such as --draft q4_k_m")
    _check_output_folder(out, "-o/--out", OUTPUT_FILES)
    _check_prompts_fit(GGUFFile(model), [prompt], n_predict, ctx.params.get("ctx_size"), lambda i: "the prompt")
    m = load(model, progress=True)
    ids = m.tokenize(prompt)
    with tqdm(total=len(ks) + 1, desc="depths", unit="depth", leave=False) as bar:
        rows = profile_depths(m, ids, n_predict, sampling, ks, repeats, lambda row: bar.update(1))
    budget = f", budget {format_size(m.memory_plan.budget)}" if m.memory_plan is not None else ""
    decoding = "greedy" if sampling.greedy else f"temperature {sampling.temperature:g}"
    title = (f"{m.path.name}, draft {Path(draft).name}{budget}, {m.device}, {decoding}, "
             f"{len(ids)}-token prompt, {n_predict} tokens x {repeats}")
    click.echo(f"{title}\n{markdown_table(rows)}")
    best, auto = best_fixed(rows), rows[-1]
    click.echo(f"best fixed depth {best.depth}: {best.tpot_ms:.2f} ms per token; auto: {auto.tpot_ms:.2f} ms "
               f"(mean depth {auto.mean_depth:.1f})", err=True)
    files = write_profile(rows, out, title)
    click.echo("wrote " + ", ".join(str(f) for f in files), err=True)


@cli.command()
@model_argument(required=False)
@click.option("--drafts", default="q2_k,q4_k_m,q8_0", show_default=True,
              help="Comma-separated drafts: types (made from MODEL on first use, as `run --draft`) or files.")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Prompts: a JSON list of strings, or a text file of one prompt per line (default: 10 built-in "
              "prompts of Python code and docs).")
@click.option("-n", "--n-predict", default=64, show_default=True, help="Tokens generated per prompt and decoding.")
@click.option("--n-draft", type=DraftDepth(), default="4", show_default=True,
              help="Tokens drafted per verification (one depth for every draft, so that they compare).")
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), default=Path("fidelity"),
              help="Folder for fidelity.md, fidelity.json and fidelity.png.")
@functools.partial(sampling_options, seed_help="Random seed (default 0, so that tables repeat; -1: random).")
@device_option
@ctx_size_option
def fidelity(model: Path | None, drafts: str, prompts_file: Path | None, n_predict: int, n_draft: int | str,
             out: Path, sampling: Any, device: str | None, ctx_size: int | None) -> None:
    """Per draft precision: the draft's expert-id agreement with MODEL (overall, per layer, per prompt), its
    acceptance rate and tokens per verification, greedy and sampled (with the sampling options; seed 0 unless
    --seed); print the table and write it with histograms of the per-prompt agreement."""
    import dataclasses

    from tqdm import tqdm

    from specter_gguf.config import check_draft
    from specter_gguf.engine import SHIPPED_MODEL, Model
    from specter_gguf.gguf_file import GGUFFile
    from specter_gguf.speculation.fidelity import DEFAULT_PROMPTS, OUTPUT_FILES, measure, read_prompts, write

    if sampling.greedy:
        raise SpecterError("fidelity runs every prompt greedy and sampled: give a --temp above 0 for the sampled runs")
    if n_predict < 2:
        raise SpecterError(f"-n/--n-predict must be at least 2 to draft, got {n_predict}")
    if sampling.seed is None:  # seed 0 unless --seed; -1 draws one, as everywhere
        drawn = int.from_bytes(os.urandom(4), "little") if click.get_current_context().params.get("seed") == -1 else 0
        sampling = dataclasses.replace(sampling, seed=drawn)
    names = [d.strip() for d in drafts.split(",") if d.strip()]
    if not names:
        raise SpecterError("--drafts is empty: give types such as q2_k,q4_k_m,q8_0 or draft files")
    twice = sorted({d for d in names if names.count(d) > 1})
    if twice:
        raise SpecterError(f"--drafts names {', '.join(twice)} more than once: each draft is measured once")
    target_file = GGUFFile(model if model is not None else SHIPPED_MODEL)  # a broken file: its line before any work
    for d in names:
        try:
            source = draft_file_or_type(d)
            if isinstance(source, Path):  # a file: of this model? (a type is made from it)
                check_draft(target_file, GGUFFile(source))
        except SpecterError as e:
            raise SpecterError(f"--drafts: {e}") from None
    prompts = read_prompts(prompts_file) if prompts_file is not None else list(DEFAULT_PROMPTS)
    _check_output_folder(out, "-o/--out", OUTPUT_FILES)
    _check_prompts_fit(target_file, prompts, n_predict, ctx_size, lambda i: f"prompt {i + 1}")

    def load(draft: str) -> Any:
        return Model.load(model, device=device, ctx_size=ctx_size, draft=draft, n_draft=n_draft, progress=True)

    with tqdm(total=len(names) * len(prompts) * 2, desc="generations", unit="gen", leave=False) as bar:
        results = measure(load, names, prompts, n_predict, sampling, lambda: bar.update(1))
    target = model.name if model is not None else "the shipped model"
    title = (f"{target}: {len(prompts)} prompt{'s' if len(prompts) != 1 else ''} x {n_predict} tokens, {n_draft} "
             f"drafted per verification, greedy and temperature {sampling.temperature:g} (seed {sampling.seed})")
    files = write(results, out, title)
    click.echo(files[0].read_text(encoding="utf-8"))
    click.echo("wrote " + ", ".join(str(f) for f in files), err=True)


@cli.command()
@model_argument(required=True)
@click.option("--gpu-budget", required=True, help=GPU_BUDGET_HELP + ".")
@click.option("--draft", type=DraftFile(allow_none=True), default=None,
              help="Draft GGUF (the target with quantized experts), or a type made on first use as for `run`: its "
              "routed experts stay on the device; none: no draft.")
@ctx_size_option
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cuda", help="Device the plan is for.")
@click.option("--hybrid", type=click.Choice(HYBRID_CHOICES), default=DEFAULT_HYBRID, show_default=True,
              help="Also say what `run --hybrid` would choose for the offloaded experts: on a CUDA GPU measured as a "
              "load measures it (one expert on the CPU for one and for eight tokens against its copy; one layer's "
              "experts are read from the file for it).")
@click.option("--spare-slots", type=click.IntRange(0, MAX_SPARES), default=None,
              help="Also say how many of each MoE layer's slots `run --spare-slots` would set aside (default: "
              f"{SPARE_SLOTS_DEFAULT}).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
def plan(model: Path, gpu_budget: str, draft: Path | str | None, ctx_size: int | None, device: str, hybrid: str,
         spare_slots: int | None, as_json: bool) -> None:
    """Show how a GPU budget would be split for MODEL (its weights are not loaded; a --draft type not made yet is
    made first, as for `run`): non-expert weights, KV cache,
    workspace, draft experts and what speculation holds, expert-cache slots; and the minimum budget. Exits 1 when
    the budget is below it."""
    from specter_gguf.engine import plan_budget

    from specter_gguf.runtime.offload import REUSED_SHARE, spares_per_layer

    p = plan_budget(model, _gpu_budget(gpu_budget), ctx_size, device, None if draft == "none" else draft)
    if p.budget < p.minimum:  # the split, then the error (exit 1) says what is missing: no cache to say more of
        click.echo(json.dumps({**p.to_dict(), "hybrid": None, "spare_slots": None, "lends_spares": None}) if as_json
                   else p.describe())
        p.check()
    hybrid_on, hybrid_line = _hybrid_plan(model, hybrid, device, p.fits_all)
    spares = 0 if p.fits_all else spares_per_layer(p.n_slots, p.n_moe_layers, p.top_k, spare_slots,
                                                   lookahead=p.draft_experts > 0)
    spare_line = ("spare slots: none (the whole model fits the budget)" if p.fits_all else
                  f"spare slots: {spares} of each MoE layer's {p.n_slots // p.n_moe_layers} with --offload lru, for "
                  "a forward to copy its misses into (--spare-slots); the cache keeps the others")
    if spare_slots is not None and spares < spare_slots and not p.fits_all:
        spare_line += f" (--spare-slots {spare_slots}: at most {spares} fit beside a token's {p.top_k} experts)"
    # whether hybrid would lend the spares to the cache while routing does not repeat (None: auto, unmeasured here)
    lends_spares = hybrid_on if spares else False
    if lends_spares is not False:
        spare_line += (f"; {'if auto turns it on, ' if hybrid_on is None else ''}hybrid lends "
                       "them to the cache while routing does not repeat from token to token (decode steps sharing "
                       f"under {REUSED_SHARE:.0%} of their experts with the step before)")
    click.echo(json.dumps({**p.to_dict(), "hybrid": hybrid_line, "spare_slots": spares, "lends_spares": lends_spares})
               if as_json else f"{p.describe()}\n{spare_line}\n{hybrid_line}")


def _hybrid_plan(model: Path, hybrid: str, device: str, fits_all: bool) -> tuple[bool | None, str]:
    """Whether a load would turn --hybrid on on `device` (None: auto, unmeasured here; False also where the whole
    model fits), and `plan`'s line on it: what it would choose, and why."""
    import torch

    from specter_gguf.engine import plan_hybrid

    if fits_all:
        return False, f"hybrid {hybrid}: no expert is offloaded (the whole model fits the budget)"
    if hybrid == "off":
        return False, "hybrid off: the experts a forward misses are read over PCIe"
    if device == "cuda" and not torch.cuda.is_available():
        return (True if hybrid == "on" else None,
                f"hybrid {hybrid}: measured when the model loads on a CUDA GPU (none here to measure on)")
    choice = plan_hybrid(model, hybrid, device)
    return choice.on, choice.describe()


@cli.command()
@model_argument(required=True)
@click.option("--tokens", required=True, help="Comma-separated token ids, e.g. 1,5,7.")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write float32 logits [n_tokens, n_vocab] (.npy).")
@device_option
def logits(model: Path, tokens: str, out: Path, device: str | None) -> None:
    """Write the logits of every position of one forward pass over TOKENS."""
    from specter_gguf.engine import Model

    try:
        entries = tokens.replace(" ", "").split(",")
        ids = [int(t) for t in entries] if any(entries) else []  # a blank entry among ids is a mistake
    except ValueError:
        raise SpecterError(f"--tokens must be comma-separated integers, got '{tokens}'") from None
    if not ids:
        raise SpecterError("--tokens is empty: give comma-separated token ids, e.g. --tokens 1,5,7")
    if min(ids) < 0:
        raise SpecterError(f"--tokens: token id {min(ids)} is negative; token ids start at 0")
    _check_output_file(out, "--out")
    m = Model.load(model, device=device, ctx_size=len(ids), progress=False)
    result = m.logits(ids)  # ids beyond the vocabulary: one error line naming its size
    with open(out, "wb") as fh:  # exactly `out`: np.save(path) would append .npy to another suffix
        np.save(fh, result.astype(np.float32))
    click.echo(f"wrote logits {list(result.shape)} to {out}", err=True)


@cli.command()
@model_argument(required=True)
def inspect(model: Path) -> None:
    """Describe MODEL: architecture, shapes, experts, bytes per tensor type."""
    from specter_gguf.engine import read_config, summarize_file

    f = summarize_file(model)
    split = f" in {f.n_files} files: a split model" if f.n_files > 1 else ""
    click.echo(f"file          {f.path} ({format_size(f.file_bytes)}{split})")
    click.echo(f"name          {'-' if f.name is None else f.name}")
    click.echo(f"architecture  {f.architecture}")
    c = read_config(model)
    click.echo(f"layers        {c.n_layer} (hidden {c.n_embd}, vocabulary {c.n_vocab}, context {c.n_ctx_train})")
    click.echo(f"attention     {c.n_head} heads, {c.n_head_kv} KV heads, head dim {c.head_dim}")
    click.echo(f"experts       {c.n_expert} routed, {c.n_expert_used} used per token, {c.n_expert_shared} shared; "
               f"expert width {c.n_ff_exp}")
    click.echo(f"tensors       {f.n_tensors}: "
               + ", ".join(f"{k} {format_size(v)}" for k, v in f.bytes_by_type.items()))
    click.echo(f"routed experts {format_size(f.routed_expert_bytes)}; everything else {format_size(f.other_bytes)}")


# -- serve, chat, quantize (specter_gguf/server.py, chat.py, quantize.py) --------------------------------------

def _verbosity() -> int:
    ctx = click.get_current_context(silent=True)
    return int(ctx.find_root().params.get("verbose") or 0) if ctx is not None else 0


@cli.command()
@model_argument(required=False)
@click.option("--host", default="127.0.0.1",
              help="Address to listen on (0.0.0.0: every interface). Any but loopback (127.0.0.1, ::1, localhost) "
              "needs --api-key, or --insecure.")
@click.option("--port", default=8080, help="Port to listen on, 0 to 65535 (0: any free port, printed at start).")
@click.option("--api-key", default=None, envvar="SPECTER_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on every endpoint but /health (401 otherwise). The "
              "environment variable keeps the key out of the process list.  [default: none]")
@click.option("--insecure", is_flag=True, help="Allow a non-loopback --host without an API key: anyone who can "
              "reach the port may use the model.")
@click.option("--max-body-bytes", default=2 * 1024 * 1024,
              help="Largest request body in bytes (2 MiB); larger ones get 413 unread.")
@click.option("--max-prompt-tokens", type=int, default=None, show_default=False,
              help="Most prompt tokens per request, 400 above (default: the context size less one). A text of more "
              "than 16 characters per allowed token is refused before it is tokenized.")
@click.option("--max-completion-tokens", type=int, default=None, show_default=False,
              help="Largest max_tokens a request may ask for, 400 above, and the length of a chat reply that sets "
              "none (default: the context size).")
@click.option("--max-stop", default=16, help="Most stop strings per request (400 above).")
@click.option("--max-stop-chars", default=512, help="Most characters per stop string (400 above).")
@click.option("--max-queue", default=32, help="Most requests waiting for the device, the running one not counted; "
              "more get 429 with Retry-After.")
@load_options
def serve(model: Path | None, host: str, port: int, api_key: str | None, insecure: bool, max_body_bytes: int,
          max_prompt_tokens: int | None, max_completion_tokens: int | None, max_stop: int, max_stop_chars: int,
          max_queue: int, load: Any) -> None:
    """Serve MODEL (default: the shipped small model) over an OpenAI-compatible HTTP API.

    Endpoints: POST /v1/completions, POST /v1/chat/completions (set "stream": true for Server-Sent Events),
    GET /v1/models, GET /health, GET /metrics (Prometheus). Requests are served one at a time, in order of
    arrival; a client that disconnects leaves the queue or stops its generation. Errors are OpenAI error
    objects. Ctrl-C stops the server.
    """
    from specter_gguf.chat import chat_template
    from specter_gguf.server import ServerLimits, check_listen
    from specter_gguf.server import serve as run_server

    # refuse bad flags before the model loads
    check_listen(host, port, api_key or None, insecure)
    limits = ServerLimits(max_body_bytes, max_prompt_tokens, max_completion_tokens, max_stop, max_stop_chars,
                          max_queue)
    m = load(model, progress=True)

    def listening(url: str) -> None:
        click.echo(f"serving {model_name(m.path)} on {url}/v1 (device {m.device}, context {m.ctx_size}, "
                   f"{f'draft {m.draft}, ' if m.draft else ''}chat template: "
                   f"{chat_template(m).source}{', API key required' if api_key else ''}); requests are served "
                   f"one at a time; Ctrl-C stops", err=True)

    verbosity = _verbosity()
    run_server(m, host=host, port=port, log_level="warning" if verbosity == 0 else "info" if verbosity == 1
               else "debug", on_listening=listening, api_key=api_key or None, limits=limits, insecure=insecure)


@cli.command()
@model_argument(required=False)
@click.option("-s", "--system", default=None, help="System message that starts the conversation.")
@click.option("-n", "--n-predict", default=-1, callback=_check_n_predict,
              help="Most tokens per reply (-1: until the reply ends or the context is full).")
@sampling_options
@load_options
def chat(model: Path | None, system: str | None, n_predict: int, sampling: Any, load: Any) -> None:
    """Chat with MODEL (default: the shipped small model) in the terminal.

    Replies stream as they are generated and the conversation keeps its history, formatted with the chat
    template in the GGUF file (or a built-in ChatML one). Type /reset to clear the history, /exit or
    Ctrl-D to quit, /help for these; another single word starting with / is not sent. Ctrl-C stops a reply.
    Reads lines from standard input, so it can be piped.
    """
    import logging

    from specter_gguf.chat import ChatSession, chat_template

    interactive = sys.stdin.isatty()
    m = load(model, progress=interactive)
    _note_seed_at_depth_auto(m, sampling)
    session = ChatSession(m, system=system, n_predict=n_predict, sampling=sampling)
    click.echo(f"chatting with {model_name(m.path)} (context {m.ctx_size}, {f'draft {m.draft}, ' if m.draft else ''}"
               f"chat template: {chat_template(m).source}); "
               "/reset clears the history, /exit or Ctrl-D quits", err=True)
    if interactive:
        try:
            import readline  # noqa: F401 - line editing for input()
        except ImportError:  # pragma: no cover
            pass
    line = 0
    while True:
        line += 1
        try:
            text = input("> ") if interactive else _read_stdin_line()
        except (EOFError, KeyboardInterrupt):
            click.echo(err=True)
            break
        except UnicodeDecodeError as e:
            if not interactive:
                raise SpecterError(f"standard input is not UTF-8 text (line {line}, byte {e.start}): pipe UTF-8 "
                                   "text into chat (e.g. through iconv -t UTF-8)") from None
            click.echo("Error: that line is not UTF-8 text; set the terminal to UTF-8 and type it again", err=True)
            continue
        if not interactive and text == "":
            break  # end of input
        text = text.rstrip("\n")
        command = text.strip()
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            session.reset()
            click.echo("(history cleared)", err=True)
            continue
        if not command:
            continue
        if command.startswith("/") and not any(c.isspace() for c in command):  # a mistyped command, not a message
            click.echo(f"{'' if command == '/help' else f'unknown command {command}: '}/reset clears the history, "
                       "/exit or Ctrl-D quits", err=True)
            continue
        try:
            gen = session.send(text)
        except SpecterError as e:  # the session goes on; a conversation past the context can start over
            click.echo(f"Error: {e}{' (/reset starts over)' if isinstance(e, ContextFullError) else ''}", err=True)
            continue
        try:
            for piece in gen:
                click.echo(piece, nl=False)
                sys.stdout.flush()
        except KeyboardInterrupt:
            gen.close()  # its stats: what it generated
            click.echo(" [stopped]", nl=False)
        click.echo()
        logging.getLogger("specter_gguf.chat").info("%s", gen.stats.summary())  # shown with -v


def _read_stdin_line() -> str:
    """One line of piped standard input, read as UTF-8 whatever the locale (as -f/--file reads a prompt)."""
    raw = getattr(sys.stdin, "buffer", None)
    return raw.readline().decode("utf-8") if raw is not None else sys.stdin.readline()


def _quantization_type(ctx: click.Context, param: click.Parameter, value: str) -> str:
    key = value.strip().lower()
    if key in NEEDS_IMATRIX:
        raise click.BadParameter(needs_imatrix_message(key))
    if key not in FTYPES:
        raise click.BadParameter(f"{value!r} is not one of {', '.join(FTYPES)}")
    return key


@cli.command()
@model_argument(required=True)
@click.option("-t", "--type", "qtype", required=True, callback=_quantization_type, metavar="TYPE",
              help=f"Quantization type: {', '.join(FTYPES)} (q4_k_m is a good default, q2_k the smallest).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Output file (default: next to MODEL, named after it and the type, e.g. model-q4_k_m.gguf).")
@click.option("--threads", default=0, help="CPU threads for llama.cpp (0 = all).")
@click.option("--allow-requantize", is_flag=True,
              help="Quantize a MODEL that is quantized already (as llama-quantize's option; an F32/F16/BF16 source "
              "gives better quality).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def quantize(model: Path, qtype: str, output: Path | None, threads: int, allow_requantize: bool, quiet: bool) -> None:
    """Quantize MODEL (an F32/F16/BF16 GGUF) with llama.cpp's own quantizer.

    Routers and 1-D tensors stay F32 and llama.cpp's type mixes apply (Q4_K_M keeps some tensors at Q6_K);
    K-quants and IQ types need input dimensions that are multiples of 256, else llama.cpp picks another type per
    tensor (for IQ types, IQ4_NL). IQ1/IQ2 and IQ3_XXS/IQ3_XS files need an importance matrix: make them with
    llama.cpp's llama-quantize --imatrix (they load here).
    """
    from specter_gguf.gguf_file import GGUFFile
    from specter_gguf.quantize import quantize_with_progress, quantized_path

    if threads < 0:
        raise SpecterError(f"--threads must be 0 (every core) or more, got {threads}")
    GGUFFile(model)  # a missing, truncated or non-GGUF file: our error line naming it and the fix, not llama.cpp's
    out = output if output is not None else quantized_path(model, qtype)
    _check_output_file(out, "-o/--output")  # a missing folder is refused, as every output file's (a typo makes none)
    summary = quantize_with_progress(model, out, qtype, show=not quiet, n_threads=threads,
                                     allow_requantize=allow_requantize)
    sizes = f" ({', '.join(summary)})" if summary else ""
    click.echo(f"wrote {out}: {format_size(out.stat().st_size)}{sizes}", err=True)


def main() -> None:
    cli(prog_name="specter-gguf")


if __name__ == "__main__":
    main()
