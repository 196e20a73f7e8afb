#!/usr/bin/env python3
"""Train the small qwen2moe (8 experts, top-2, 4 layers, hidden 256) on the Python standard library's sources on
this machine, with a BPE tokenizer it trains itself; export it as an F16 GGUF through our writer; measure its
held-out perplexity with PyTorch, with our engine and with llama.cpp on that file; write the recipe and the results
(a Markdown page and the loss curve) into --docs-dir.

Resumable: run the same command again and it continues from OUT_DIR/checkpoint.pt (the tokenizer and the tokens
are cached there too). Deterministic for a seed and a step count on one device (see specter_gguf/synthetic/training.py).

Examples:
  python scripts/train_tiny_moe.py --device cuda --minutes 6 --out-dir /tmp/tiny-moe       # the H200 recipe
  python scripts/train_tiny_moe.py --device cpu --steps 60 --batch 4 --seq-len 128 --max-corpus-mb 3 \\
      --vocab-size 1024 --out-dir /tmp/tiny-moe-cpu --docs-dir /tmp/tiny-moe-cpu/docs                 # a CPU check
"""

from __future__ import annotations

import json
import platform
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import click
import numpy as np

try:
    import specter_gguf  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specter_gguf.errors import SpecterError  # noqa: E402
from specter_gguf.sizes import format_size  # noqa: E402
from specter_gguf.synthetic.bpe import BPETokenizer  # noqa: E402
from specter_gguf.synthetic.corpus import HELD_OUT_BYTE, stdlib_corpus  # noqa: E402
from specter_gguf.synthetic.tiny_moe import TINY_MOE, TinyMoE  # noqa: E402
from specter_gguf.synthetic.training import (TrainConfig, Trainer, llama_nll, logits_agreement,  # noqa: E402
                                             ours_nll, perplexity, plot_losses, tokenize, torch_nll,
                                             train_tokenizer, vocab_file, windows)
from specter_gguf.synthetic.writer import write_synthetic  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SAMPLE_PROMPTS = ("def ", "import os\n", "class Queue:\n    \"\"\"")


def _tokens(corpus, cfg: TrainConfig, out: Path, progress: bool) -> tuple[BPETokenizer, np.ndarray, np.ndarray]:
    """The tokenizer and both token streams, from OUT's cache when it was made from the same corpus and settings."""
    key = {"corpus": corpus.digest(), "vocab_size": cfg.vocab_size, "bpe_sample_bytes": cfg.bpe_sample_bytes}
    meta, tok_path, ids_path = out / "tokens.json", out / "tokenizer.json", out / "tokens.npz"
    if meta.is_file() and json.loads(meta.read_text()) == key and tok_path.is_file() and ids_path.is_file():
        t = json.loads(tok_path.read_text(encoding="utf-8"))
        ids = np.load(ids_path)
        return BPETokenizer(tuple(t["tokens"]), tuple(t["merges"]), tuple(t["specials"])), ids["train"], ids["held"]
    t0 = time.perf_counter()
    click.echo(f"training the tokenizer ({cfg.vocab_size} tokens) on {format_size(cfg.bpe_sample_bytes)} of text",
               err=True)
    tok = train_tokenizer(corpus, cfg)
    click.echo(f"  {time.perf_counter() - t0:.1f} s", err=True)
    vocab = vocab_file(tok, TINY_MOE, out / "vocab.gguf")
    train, held = tokenize(corpus, vocab, progress)
    vocab.unlink()
    tok_path.write_text(tok.to_json(), encoding="utf-8")
    np.savez(ids_path, train=train, held=held)
    meta.write_text(json.dumps(key))
    return tok, train, held


@click.command(help=__doc__, context_settings={"max_content_width": 110})
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--steps", type=int, default=None, help="Training steps (fixes the run; default: from --minutes).")
@click.option("--minutes", type=float, default=None, help="Training time budget; the step count it gives is "
              "recorded (tokenizer, export and evaluation come on top).")
@click.option("--epochs", type=float, default=TrainConfig.epochs, show_default=True,
              help="With --minutes: at most this many passes over the training tokens.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--batch", type=int, default=TrainConfig.batch, show_default=True)
@click.option("--seq-len", type=int, default=TrainConfig.seq_len, show_default=True,
              help="Training window, also the file's context length.")
@click.option("--lr", type=float, default=TrainConfig.lr, show_default=True)
@click.option("--warmup", type=int, default=TrainConfig.warmup, show_default=True)
@click.option("--vocab-size", type=int, default=TrainConfig.vocab_size, show_default=True)
@click.option("--layers", type=int, default=TINY_MOE.n_layer, show_default=True)
@click.option("--eval-every", type=int, default=TrainConfig.eval_every, show_default=True)
@click.option("--eval-tokens", type=int, default=32768, show_default=True,
              help="Held-out tokens the final perplexities are measured on.")
@click.option("--eval-device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where our engine computes its perplexity (cuda needs the CUDA build of the native library).")
@click.option("--corpus", "corpus_root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder of Python sources (default: this Python's standard library).")
@click.option("--max-corpus-mb", type=float, default=None, help="Use about this much of the corpus (short runs).")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=REPO / "build" / "tiny-moe",
              show_default=True, help="Checkpoint, token cache, the GGUF and results.json.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The F16 GGUF (default OUT_DIR/tiny-qwen2moe-stdlib-f16.gguf).")
@click.option("--docs-dir", type=click.Path(file_okay=False, path_type=Path), default=REPO / "docs",
              show_default=True, help="Where TINY_MODEL.md and img/tiny-moe-loss.png are written.")
@click.option("--fresh", is_flag=True, help="Ignore OUT_DIR's checkpoint and token cache.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
def main(device: str, steps: int | None, minutes: float | None, epochs: float, seed: int, batch: int, seq_len: int,
         lr: float, warmup: int, vocab_size: int, layers: int, eval_every: int, eval_tokens: int, eval_device: str,
         corpus_root: Path | None, max_corpus_mb: float | None, out_dir: Path, output: Path | None, docs_dir: Path,
         fresh: bool, quiet: bool) -> None:
    import torch

    from specter_gguf.engine import Model, resolve_device

    started = time.perf_counter()
    cfg = TrainConfig(seed=seed, steps=steps, minutes=minutes, epochs=epochs, batch=batch, seq_len=seq_len, lr=lr,
                      min_lr=lr / 10, warmup=warmup, vocab_size=vocab_size, eval_every=eval_every)
    cfg.check()
    dev = resolve_device(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    if fresh:
        for name in ("checkpoint.pt", "tokens.json"):
            (out_dir / name).unlink(missing_ok=True)
    corpus = stdlib_corpus(corpus_root, int(max_corpus_mb * 1e6) if max_corpus_mb else None)
    tok, train_ids, held_ids = _tokens(corpus, cfg, out_dir, not quiet)
    shape = replace(TINY_MOE, n_layer=layers, n_ctx=seq_len)
    model = TinyMoE(shape, len(tok.tokens), seed=seed)
    n_params = sum(p.numel() for p in model.parameters())
    click.echo(f"{shape.name}: {n_params / 1e6:.2f} M parameters; {len(train_ids)} training and {len(held_ids)} "
               f"held-out tokens", err=True)
    trainer = Trainer(model, cfg, train_ids, held_ids, dev, out_dir / "checkpoint.pt", progress=not quiet)
    resumed_at = trainer.step
    history = trainer.run()

    gguf = output or out_dir / "tiny-qwen2moe-stdlib-f16.gguf"
    write_synthetic(gguf, shape, "f16", tokenizer=tok, weights=model.gguf_weights(),
                    description=f"specter-gguf: a small qwen2moe trained on the Python {platform.python_version()} "
                                f"standard library ({trainer.total_steps} steps, seed {seed})")
    model.eval()
    wins = windows(held_ids, seq_len, max(1, eval_tokens // seq_len))
    with torch.no_grad():
        ppl_torch = perplexity(torch_nll(model), wins, "perplexity (PyTorch)", not quiet)
    ppl_ours = perplexity(ours_nll(gguf, eval_device), wins, "perplexity (ours)", not quiet)
    ppl_llama = perplexity(llama_nll(gguf, seq_len), wins, "perplexity (llama.cpp)", not quiet)
    import llama_cpp

    f16 = model.rounded_to_f16()
    with torch.no_grad():
        ref = f16(torch.as_tensor(wins[0].astype(np.int64))[None])[0][0].numpy()
    ours_model = Model.load(gguf, device="cpu", progress=False)
    ours = ours_model.logits(wins[0].tolist())
    llm = llama_cpp.Llama(str(gguf), logits_all=True, n_ctx=seq_len, n_batch=seq_len, verbose=False)
    llm.eval(wins[0].tolist())
    lc = np.array(llm.scores[:len(wins[0])], dtype=np.float32)
    from specter_gguf.sampling import SamplingParams

    samples = [(p, ours_model.generate(p, 48, SamplingParams(temperature=0)).wait().text) for p in SAMPLE_PROMPTS]
    results = {
        "command": "python scripts/train_tiny_moe.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else
                              f" ({platform.processor() or platform.machine()})"),
        "python": platform.python_version(), "torch": torch.__version__, "llama_cpp": llama_cpp.__version__,
        "corpus": corpus.describe(), "config": asdict(cfg), "shape": asdict(shape), "n_vocab": len(tok.tokens),
        "n_params": n_params, "file": str(gguf), "file_bytes": gguf.stat().st_size,
        "steps": trainer.total_steps, "resumed_at": resumed_at, "train_seconds": history.seconds,
        "step_s": history.step_s, "tokens_seen": trainer.total_steps * cfg.batch * cfg.seq_len,
        "train_tokens": int(len(train_ids)), "held_out_tokens": int(len(held_ids)),
        "final_train_loss": history.train[-1][1], "final_held_out_loss": history.held_out[-1][1],
        "eval_tokens": sum(len(w) - 1 for w in wins), "ppl_torch": ppl_torch, "ppl_ours": ppl_ours,
        "ppl_llama": ppl_llama, "eval_device": eval_device, "logits_torch_vs_ours": logits_agreement(ours, ref),
        "logits_ours_vs_llama": logits_agreement(ours, lc), "samples": samples,
        "total_seconds": time.perf_counter() - started,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    docs_dir.mkdir(parents=True, exist_ok=True)
    (docs_dir / "TINY_MODEL.md").write_text(_markdown(results), encoding="utf-8")
    plot_losses(history, docs_dir / "img" / "tiny-moe-loss.png",
                f"{shape.name}: {n_params / 1e6:.1f} M params, {trainer.total_steps} steps on {results['device']}")
    click.echo(f"{gguf} ({format_size(gguf.stat().st_size)}); held-out perplexity PyTorch {ppl_torch:.3f}, ours "
               f"{ppl_ours:.3f}, llama.cpp {ppl_llama:.3f}; {results['total_seconds']:.0f} s in all; "
               f"{docs_dir / 'TINY_MODEL.md'} written", err=True)


def _markdown(r: dict) -> str:
    c, s, k = r["config"], r["shape"], r["corpus"]
    resumed = f" (resumed at step {r['resumed_at']})" if r["resumed_at"] else ""
    fixed = (f"; {1000 * r['step_s']:.1f} ms per step, measured to fix the step count (`--steps {r['steps']}` "
             f"repeats the run)" if r["step_s"] else "")
    samples = "\n\n".join(f"```\n{p}{t}\n```" for p, t in r["samples"])
    return f"""# The small trained MoE

Written by `scripts/train_tiny_moe.py` at the end of a run (run it again rather than editing this page).

## This run

```
{r['command']}
```

On {r['device']}, Python {r['python']}, PyTorch {r['torch']}, llama-cpp-python {r['llama_cpp']}: {r['steps']} steps
of batch {c['batch']} × {c['seq_len']} tokens{resumed} in {r['train_seconds']:.0f} s of training{fixed};
{r['total_seconds']:.0f} s in all (tokenizer, tokenization, training, export, evaluation).
{r['tokens_seen'] / 1e6:.2f} M tokens seen: {r['tokens_seen'] / r['train_tokens']:.2f} epochs of the
{r['train_tokens'] / 1e6:.2f} M training tokens.

| held-out perplexity ({r['eval_tokens']} tokens, windows of {c['seq_len']}) | |
|---|---|
| PyTorch (the trained float32 weights) | {r['ppl_torch']:.3f} |
| ours (`specter_gguf.engine.Model` on the F16 file, {r['eval_device']}) | {r['ppl_ours']:.3f} |
| llama.cpp (llama-cpp-python on the F16 file) | {r['ppl_llama']:.3f} |

Final losses: training {r['final_train_loss']:.3f}, held-out {r['final_held_out_loss']:.3f} nats per token.
Logits on the first held-out window, per position max|a − b| / max|b|, the largest: the F16-rounded PyTorch model
against ours {r['logits_torch_vs_ours']:.2e}, ours against llama.cpp {r['logits_ours_vs_llama']:.2e}.

![loss curve](img/tiny-moe-loss.png)

Greedy continuations by our engine (48 tokens after each prompt):

{samples}

## Recipe

- Model: `{s['arch']}`, {s['n_layer']} layers, hidden {s['n_embd']}, {s['n_head']} query heads and
  {s['n_head_kv']} key/value heads of {s['head_dim']}, {s['n_expert']} routed experts of width {s['n_ff_exp']} with
  top-{s['n_expert_used']} softmax routing (not renormalized), one shared expert of width {s['n_ff_shexp']} behind a
  sigmoid gate, NeoX RoPE (base {s['rope_theta']:g}), context {s['n_ctx']}, untied LM head; {r['n_vocab']}-token
  byte-level BPE (`synthetic/bpe.py`, trained on {c['bpe_sample_bytes'] / 1e6:.1f} MB of the training files).
  {r['n_params'] / 1e6:.2f} M parameters; the F16 file is {r['file_bytes'] / 1e6:.1f} MB. Every weight's input
  dimension is a multiple of 256, so llama.cpp's K-quants apply to every matrix. The PyTorch model (`synthetic/tiny_moe.py`) holds the GGUF tensors
  as its parameters and computes what `models/qwen2moe.py` computes; `tests/test_tiny_moe.py` checks its logits
  against our engine and llama.cpp on the exported file.
- Corpus (`synthetic/corpus.py`): every `.py` file under `{k['root']}` except `site-packages/`, read as UTF-8
  (the reference's text is in `pydoc_data/topics.py`); a file is held out when the first byte of the SHA-256 of
  its relative path is below {HELD_OUT_BYTE}: {k['train_files']} training files ({k['train_bytes'] / 1e6:.1f} MB),
  {k['held_out_files']} held out ({k['held_out_bytes'] / 1e6:.2f} MB); corpus SHA-256 `{k['sha256'][:16]}…`. Each
  file is followed by `<|endoftext|>`; the tokens are llama.cpp's tokenizer on the file's vocabulary.
- Training (`synthetic/training.py`): AdamW (β 0.9, 0.95; weight decay {c['weight_decay']} on matrices), learning
  rate {c['lr']:g} after {c['warmup']} warm-up steps, cosine to {c['min_lr']:g} (with `--minutes`: at most
  {c['epochs']:g} epochs); batch {c['batch']} windows of
  {c['seq_len']} tokens at seeded random offsets; gradient clipping 1.0; load-balancing loss ×{c['balance']};
  bf16 autocast on CUDA, float32 on the CPU; seed {c['seed']}; checkpoint every minute (resumable).
- Perplexity: exp of the mean negative log-likelihood of tokens 2..{c['seq_len']} of each non-overlapping held-out
  window given the ones before it, the same windows for the three.
"""


if __name__ == "__main__":
    try:
        main(standalone_mode=False)
    except SpecterError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
