"""The `specter-gguf` command line. Option names follow llama.cpp's where one exists."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import click
import numpy as np

from specter_gguf.errors import SpecterError


class Cli(click.Group):
    """Reports a `SpecterError` as one line (`Error: ...`, exit 1) instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SpecterError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            ctx.exit(130)


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="specter-gguf")
def cli() -> None:
    """Run Mixture-of-Experts GGUF models fast on one GPU."""


def model_argument(required: bool) -> Any:
    return click.argument("model", required=required, type=click.Path(path_type=Path, dir_okay=False))


device_option = click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
                             help="Where to run (default: cuda when a GPU is present, else cpu).")


@cli.command()
@model_argument(required=False)
@click.option("-p", "--prompt", help="Prompt text.")
@click.option("-f", "--file", "prompt_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Read the prompt from a file.")
@click.option("-n", "--n-predict", default=128, help="Tokens to generate (-1: until end of text or full context).")
@click.option("-c", "--ctx-size", type=int, default=None, help="Context size in tokens (default: the model's).")
@click.option("--temp", default=0.8, help="Temperature; 0 = greedy.")
@click.option("--top-k", default=40, help="Keep the k most likely tokens (0 = off).")
@click.option("--top-p", default=0.95, help="Nucleus sampling threshold (1.0 = off).")
@click.option("--min-p", default=0.05, help="Drop tokens below min-p times the top probability (0 = off).")
@click.option("--repeat-penalty", default=1.0, help="Penalty for repeated tokens (1.0 = off).")
@click.option("--repeat-last-n", default=64, help="Tokens the repeat penalty looks back over (-1 = context).")
@click.option("--seed", type=int, default=None, help="Random seed (default: random).")
@click.option("--stop", multiple=True, help="Stop when this text is generated (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@device_option
def run(model: Path | None, prompt: str | None, prompt_file: Path | None, n_predict: int, ctx_size: int | None,
        temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float, repeat_last_n: int,
        seed: int | None, stop: tuple[str, ...], as_json: bool, device: str | None) -> None:
    """Generate text from MODEL (default: the small model shipped in models/)."""
    from specter_gguf.engine import Model
    from specter_gguf.sampling import SamplingParams

    if prompt_file is not None:
        prompt = prompt_file.read_text(encoding="utf-8")
    if prompt is None:
        raise SpecterError("no prompt: give one with -p/--prompt TEXT or -f/--file PATH")
    sampling = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed)
    m = Model.load(model, device=device, ctx_size=ctx_size, progress=not as_json)
    gen = m.generate(prompt, n_predict=n_predict, sampling=sampling, stop=stop)
    if as_json:
        gen.wait()
        click.echo(json.dumps({"text": gen.text, "tokens": gen.tokens, "prompt_tokens": gen.prompt_tokens,
                               "finish_reason": gen.finish_reason, "stats": gen.stats.to_dict()}))
        return
    for piece in gen:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo()
    click.echo(gen.stats.summary(), err=True)


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
        ids = [int(t) for t in tokens.replace(" ", "").split(",") if t]
    except ValueError:
        raise SpecterError(f"--tokens must be comma-separated integers, got '{tokens}'") from None
    m = Model.load(model, device=device, ctx_size=max(len(ids), 1), progress=False)
    result = m.logits(ids)
    np.save(out, result.astype(np.float32))
    click.echo(f"wrote logits {list(result.shape)} to {out}", err=True)


@cli.command()
@model_argument(required=True)
def inspect(model: Path) -> None:
    """Describe MODEL: architecture, shapes, experts, bytes per tensor type."""
    from specter_gguf.config import ModelConfig
    from specter_gguf.gguf_file import GGUFFile
    from specter_gguf.models import check_architecture

    f = GGUFFile(model)
    by_type: Counter[str] = Counter()
    experts = other = 0
    for t in f.tensors.values():
        by_type[t.type.name] += t.n_bytes
        if "_exps." in t.name:
            experts += t.n_bytes
        else:
            other += t.n_bytes
    click.echo(f"file          {f.path} ({_size(f.path.stat().st_size)})")
    click.echo(f"name          {f.get('general.name', '-')}")
    click.echo(f"architecture  {f.architecture}")
    check_architecture(f)
    c = ModelConfig.from_gguf(f)
    click.echo(f"layers        {c.n_layer} (hidden {c.n_embd}, vocabulary {c.n_vocab}, context {c.n_ctx_train})")
    click.echo(f"attention     {c.n_head} heads, {c.n_head_kv} KV heads, head dim {c.head_dim}")
    click.echo(f"experts       {c.n_expert} routed, {c.n_expert_used} used per token, {c.n_expert_shared} shared; "
               f"expert width {c.n_ff_exp}")
    click.echo(f"tensors       {len(f.tensors)}: " + ", ".join(f"{k} {_size(v)}" for k, v in by_type.most_common()))
    click.echo(f"routed experts {_size(experts)}; everything else {_size(other)}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def main() -> None:
    cli(prog_name="specter-gguf")


if __name__ == "__main__":
    main()
