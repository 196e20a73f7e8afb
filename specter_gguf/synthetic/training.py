"""Training the small MoE (`tiny_moe.TinyMoE`) on the standard library (`corpus`): its tokenizer, the training loop
with checkpoints, the held-out perplexity with PyTorch, with our engine and with llama.cpp on the exported file.
`scripts/train_tiny_moe.py` is the command; the recipe and results it writes are in docs/TINY_MODEL.md.

Determinism: the weights' initialisation and every batch come from the seed (batch s from a generator seeded with
(seed, s)), so a run depends on the seed, the step count, the corpus and the device only (on CUDA, up to the
operations PyTorch has no deterministic version of: it warns about each); a resumed run continues exactly where the
checkpoint left it. The learning-rate schedule (linear warm-up over `warmup` steps, cosine decay to `min_lr` at the
last step) depends on the step count, which `--minutes` fixes during the warm-up from the measured step time, at
most `epochs` passes over the training tokens (the count is recorded: `--steps N` repeats the run).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from specter_gguf.errors import SpecterError
from specter_gguf.synthetic.bpe import BPETokenizer, train_bpe
from specter_gguf.synthetic.corpus import Corpus
from specter_gguf.synthetic.shapes import ModelShape
from specter_gguf.synthetic.tiny_moe import TinyMoE
from specter_gguf.synthetic.writer import write_synthetic

CALIBRATION_STEPS = (5, 25)  # --minutes times the steps between these to fix the step count (inside the warm-up)


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int | None = None      # None: as many as `minutes` allows (fixed after the calibration steps)
    minutes: float | None = None  # training time budget (tokenizer, export and evaluation not included)
    epochs: float = 10.0          # with `minutes`: at most this many passes over the training tokens
    batch: int = 32
    seq_len: int = 512            # also the exported file's context length
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 100
    weight_decay: float = 0.1
    balance: float = 0.01         # load-balancing loss coefficient
    vocab_size: int = 3072
    bpe_sample_bytes: int = 1_000_000
    eval_every: int = 100
    eval_windows: int = 16        # held-out windows of seq_len in the loss curve's held-out points

    def check(self) -> None:
        if self.steps is None and self.minutes is None:
            raise SpecterError("give a budget: --steps N or --minutes M")
        if self.steps is not None and self.steps < 1 or self.minutes is not None and self.minutes <= 0:
            raise SpecterError("--steps must be at least 1 and --minutes above 0")
        if self.steps is None and self.warmup <= CALIBRATION_STEPS[1]:
            raise SpecterError(f"--minutes measures steps {CALIBRATION_STEPS[0]}-{CALIBRATION_STEPS[1]} inside the "
                               f"warm-up: raise --warmup above {CALIBRATION_STEPS[1]} or give --steps")


def _set_deterministic(device: torch.device) -> None:
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


# ---- tokenizer and tokens ---------------------------------------------------------------------------------


def bpe_sample(corpus: Corpus, n_bytes: int) -> str:
    """About `n_bytes` of training text for the tokenizer: every k-th training file, in order."""
    total = sum(len(t.encode()) for _, t in corpus.train)
    stride = max(1, total // max(1, n_bytes))
    return "\n".join(t for _, t in corpus.train[::stride])


def vocab_file(tok: BPETokenizer, shape: ModelShape, path: Path) -> Path:
    """A one-layer GGUF carrying `tok` (random weights): what llama.cpp's tokenizer reads (`vocab_only`)."""
    from dataclasses import replace

    write_synthetic(path, replace(shape, n_layer=1), "f16", tokenizer=tok,
                    description="specter-gguf: the tiny model's tokenizer (random weights)")
    return path


def tokenize(corpus: Corpus, vocab_gguf: Path, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Both splits as token streams (llama.cpp's tokenizer on `vocab_gguf`), each file followed by the end-of-text
    token."""
    from specter_gguf.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(vocab_gguf)
    eot = tok.eos_id
    out = []
    for name, split in (("train", corpus.train), ("held-out", corpus.held_out)):
        ids: list[int] = []
        for _, text in tqdm(split, desc=f"tokenizing {name}", unit="file", disable=not progress, leave=False):
            ids.extend(tok.encode(text, add_bos=False, special=False))
            ids.append(eot)
        out.append(np.asarray(ids, dtype=np.int32))
    return out[0], out[1]


# ---- training -----------------------------------------------------------------------------------------------


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, t)))


def batch_at(data: torch.Tensor, cfg: TrainConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch `step`: `cfg.batch` windows at offsets drawn from a generator seeded with (seed, step)."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - cfg.seq_len - 1, (cfg.batch,), generator=g).to(data.device)
    idx = starts[:, None] + torch.arange(cfg.seq_len + 1, device=data.device)[None]
    w = data[idx]
    return w[:, :-1], w[:, 1:]


def windows(tokens: np.ndarray, length: int, n: int | None = None) -> list[np.ndarray]:
    """Consecutive non-overlapping windows of `length` tokens (at most `n`)."""
    count = len(tokens) // length if n is None else min(n, len(tokens) // length)
    return [tokens[i * length:(i + 1) * length] for i in range(count)]


def nll_of_logits(logits: torch.Tensor | np.ndarray, window: np.ndarray) -> tuple[float, int]:
    """Summed negative log-likelihood of window[1:] under logits[:-1], and the count."""
    lg = logits.float().cpu() if torch.is_tensor(logits) else torch.from_numpy(np.asarray(logits, dtype=np.float32))
    target = torch.as_tensor(window[1:].astype(np.int64))
    return float(F.cross_entropy(lg[:-1], target, reduction="sum")), len(window) - 1


@dataclass
class History:
    train: list[tuple[int, float]] = field(default_factory=list)     # (step, mean loss of the last steps)
    held_out: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss)
    seconds: float = 0.0
    step_s: float | None = None  # the calibration's seconds per step


@dataclass
class Trainer:
    """`run` trains `model` on `train_tokens`, saving a checkpoint to `checkpoint` every `checkpoint_s` seconds and
    at the end; an existing checkpoint of the same configuration is resumed."""

    model: TinyMoE
    cfg: TrainConfig
    train_tokens: np.ndarray
    held_tokens: np.ndarray
    device: torch.device
    checkpoint: Path
    checkpoint_s: float = 60.0
    progress: bool = True
    total_steps: int | None = None
    step: int = 0
    history: History = field(default_factory=History)
    window: list[torch.Tensor] = field(default_factory=list)  # losses of the steps since the last logged mean

    def __post_init__(self) -> None:
        _set_deterministic(self.device)
        self.model.to(self.device)
        decay = [p for n, p in self.model.params.items() if not self.model.no_decay(n)]
        other = [p for n, p in self.model.params.items() if self.model.no_decay(n)]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.cfg.weight_decay},
                                      {"params": other, "weight_decay": 0.0}], lr=self.cfg.lr, betas=(0.9, 0.95))
        self.data = torch.as_tensor(self.train_tokens.astype(np.int64), device=self.device)
        held = windows(self.held_tokens, self.cfg.seq_len + 1, self.cfg.eval_windows)
        self.held = torch.as_tensor(np.stack(held).astype(np.int64), device=self.device)
        self.total_steps = self.cfg.steps
        if self.checkpoint.is_file():
            self._resume()

    # -- checkpoints
    def _fingerprint(self) -> dict[str, Any]:
        c = asdict(self.cfg)
        c.pop("minutes")
        c.pop("steps")
        return {"config": c, "shape": asdict(self.model.shape), "n_vocab": self.model.n_vocab,
                "train_tokens": int(len(self.train_tokens))}

    def save(self) -> None:
        state = {"fingerprint": self._fingerprint(), "step": self.step, "total_steps": self.total_steps,
                 "model": self.model.state_dict(), "opt": self.opt.state_dict(), "history": asdict(self.history),
                 "window": [float(x) for x in self.window]}
        tmp = self.checkpoint.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.checkpoint)

    def _resume(self) -> None:
        state = torch.load(self.checkpoint, map_location=self.device, weights_only=False)
        if state["fingerprint"] != self._fingerprint():
            raise SpecterError(f"{self.checkpoint} is a checkpoint of another configuration; use another --out-dir "
                               f"or start afresh with --fresh")
        if self.cfg.steps is not None and state["total_steps"] not in (None, self.cfg.steps):
            raise SpecterError(f"{self.checkpoint} trains for {state['total_steps']} steps, not --steps "
                               f"{self.cfg.steps}; give --steps {state['total_steps']} or start afresh with --fresh")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.total_steps = state["step"], state["total_steps"]
        self.window = [torch.tensor(x, device=self.device) for x in state["window"]]
        h = state["history"]
        self.history = History([tuple(x) for x in h["train"]], [tuple(x) for x in h["held_out"]], h["seconds"],
                               h["step_s"])

    # -- the loop
    def _autocast(self) -> Any:
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    @torch.no_grad()
    def held_out_loss(self) -> float:
        self.model.eval()
        losses = []
        for w in self.held.split(self.cfg.batch):
            with self._autocast():
                logits, _ = self.model(w[:, :-1])
            losses.append(F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
        self.model.train()
        return float(torch.stack(losses).sum()) / self.held[:, 1:].numel()

    def _calibrate(self, timed_from: float, elapsed: float) -> None:
        """Fix the step count from the steps timed since `timed_from` and the `elapsed` training seconds
        (`--minutes`)."""
        lo, hi = CALIBRATION_STEPS
        step_s = (time.perf_counter() - timed_from) / (hi - lo)
        self.history.step_s = step_s
        left = self.cfg.minutes * 60 - elapsed
        cap = int(self.cfg.epochs * len(self.train_tokens) / (self.cfg.batch * self.cfg.seq_len))
        self.total_steps = max(self.cfg.warmup + 1, min(cap, self.step + int(left / step_s)))

    def run(self) -> History:
        cfg, model = self.cfg, self.model
        model.train()
        t_start = time.perf_counter()
        seconds0 = self.history.seconds
        last_save, calib_t = t_start, 0.0
        bar = tqdm(total=self.total_steps, initial=self.step, desc="training", unit="step", disable=not self.progress)
        while self.total_steps is None or self.step < self.total_steps:
            if self.total_steps is None and self.step == CALIBRATION_STEPS[0]:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                calib_t = time.perf_counter()
            for group in self.opt.param_groups:
                group["lr"] = lr_at(cfg, self.step, self.total_steps or cfg.warmup + 1)
            x, y = batch_at(self.data, cfg, self.step)
            with self._autocast():
                logits, balance = model(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                total = loss + cfg.balance * balance
            self.opt.zero_grad(set_to_none=True)
            total.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            self.opt.step()
            self.step += 1
            self.window.append(loss.detach())
            bar.update(1)
            if self.total_steps is None and self.step == CALIBRATION_STEPS[1]:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                self._calibrate(calib_t, seconds0 + time.perf_counter() - t_start)
                bar.total = self.total_steps
            done = self.total_steps is not None and self.step >= self.total_steps
            if self.step % 10 == 0 or done:
                mean = float(torch.stack(self.window).mean())
                self.history.train.append((self.step, mean))
                bar.set_postfix(loss=f"{mean:.3f}")
                self.window = []
            if self.step % cfg.eval_every == 0 or done:
                self.history.held_out.append((self.step, self.held_out_loss()))
            now = time.perf_counter()
            self.history.seconds = seconds0 + now - t_start
            if self.total_steps is not None and (now - last_save > self.checkpoint_s or done):
                self.save()
                last_save = now
        bar.close()
        return self.history


# ---- evaluation ------------------------------------------------------------------------------------------


def perplexity(nll_of: Callable[[np.ndarray], tuple[float, int]], wins: list[np.ndarray], desc: str,
               progress: bool = True) -> float:
    total = count = 0.0
    for w in tqdm(wins, desc=desc, unit="window", disable=not progress, leave=False):
        s, n = nll_of(w)
        total, count = total + s, count + n
    return math.exp(total / count)


def torch_nll(model: TinyMoE) -> Callable[[np.ndarray], tuple[float, int]]:
    """The PyTorch model's NLL of a window, on the model's device, in float32 (no autocast)."""
    device = next(model.parameters()).device

    def nll(w: np.ndarray) -> tuple[float, int]:
        with torch.no_grad():
            logits, _ = model(torch.as_tensor(w.astype(np.int64), device=device)[None])
        return nll_of_logits(logits[0], w)
    return nll


def ours_nll(gguf: Path, device: str) -> Callable[[np.ndarray], tuple[float, int]]:
    from specter_gguf.engine import Model

    m = Model.load(gguf, device=device, progress=False)
    return lambda w: nll_of_logits(m.logits(w.tolist()), w)


def llama_nll(gguf: Path, n_ctx: int) -> Callable[[np.ndarray], tuple[float, int]]:
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, n_threads=os.cpu_count() or 1,
                          verbose=False)

    def nll(w: np.ndarray) -> tuple[float, int]:
        llm.reset()
        llm.eval(w.tolist())
        return nll_of_logits(np.array(llm.scores[:len(w)], dtype=np.float32), w)
    return nll


def logits_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Per position max|a - b| / max|b|, the largest over positions (the parity tests' measure)."""
    return float((np.abs(a - b).max(1) / np.abs(b).max(1)).max())


def plot_losses(history: History, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if history.train:
        s, v = zip(*history.train)
        ax.plot(s, v, label="training loss (mean of 10 steps)", lw=1)
    if history.held_out:
        s, v = zip(*history.held_out)
        ax.plot(s, v, "o-", label="held-out loss", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def train_tokenizer(corpus: Corpus, cfg: TrainConfig) -> BPETokenizer:
    return train_bpe(bpe_sample(corpus, cfg.bpe_sample_bytes), vocab_size=cfg.vocab_size)
