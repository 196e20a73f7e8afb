"""The small trained MoE's pipeline (specter_gguf/synthetic/{tiny_moe,corpus,training}.py, scripts/train_tiny_moe.py)
on the CPU: the exported file computes what the PyTorch model computes (against our engine and llama.cpp), training
is deterministic and resumes exactly, the corpus split follows its rule, and the script runs end to end."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specter_gguf.engine import Model
from specter_gguf.errors import SpecterError
from specter_gguf.synthetic.bpe import tiny_tokenizer
from specter_gguf.synthetic.corpus import held_out, stdlib_corpus
from specter_gguf.synthetic.tiny_moe import TINY_MOE, TinyMoE, check_shape
from specter_gguf.synthetic.training import TrainConfig, Trainer
from specter_gguf.synthetic.writer import write_synthetic

REPO = Path(__file__).resolve().parent.parent
SHAPE = dataclasses.replace(TINY_MOE, n_layer=2, n_ctx=128)
# Measured 2026-12-01 on 64 random tokens: 6.3e-7 (ours, fp32 arithmetic on the same F16 values) and 5.3e-4
# (llama.cpp); the bounds leave room for other CPUs.
OURS_BOUND, LLAMA_BOUND = 1e-5, 5e-3


def _perturbed(seed: int = 1) -> TinyMoE:
    """A model whose norms, biases and routers are far from their initial values, as after training."""
    tok = tiny_tokenizer()
    m = TinyMoE(SHAPE, len(tok.tokens), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.params.values():
            p.add_(torch.randn(p.shape, generator=g) * (0.1 if p.ndim == 1 else 0.02))
    return m


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float((np.abs(a - b).max(1) / np.abs(b).max(1)).max())


def test_the_exported_file_computes_the_trained_model(tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    m = _perturbed()
    path = tmp_path / "tm.gguf"
    write_synthetic(path, SHAPE, "f16", tokenizer=tiny_tokenizer(), weights=m.gguf_weights())
    for n_tokens in (40, 128):  # the grouped expert kernel, then (>= 16 tokens per expert) the dense path
        ids = torch.randint(0, m.n_vocab - 3, (n_tokens,), generator=torch.Generator().manual_seed(n_tokens))
        with torch.no_grad():
            ref = m.rounded_to_f16()(ids[None])[0][0].numpy()
        ours = Model.load(path, device="cpu", progress=False).logits(ids.tolist())
        assert _rel(ours, ref) < OURS_BOUND
        llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=256, n_batch=256, verbose=False)
        llm.eval(ids.tolist())
        assert _rel(np.array(llm.scores[:n_tokens], dtype=np.float32), ref) < LLAMA_BOUND
        # and the unrounded model is not the same function: the test sees the F16 rounding
        with torch.no_grad():
            assert _rel(ours, m(ids[None])[0][0].numpy()) > OURS_BOUND / 100


def _trainer(tmp_path: Path, steps: int | None = 6, **kw) -> Trainer:
    g = np.random.default_rng(0)
    tokens = g.integers(0, 900, 20000).astype(np.int32)
    tokens[1::2] = (tokens[::2] * 7 + 3) % 900  # something to learn: every odd token follows from the one before
    options = {"warmup": 2, **{k: kw.pop(k) for k in ("minutes", "epochs", "warmup") if k in kw}}
    cfg = TrainConfig(seed=3, steps=steps, batch=2, seq_len=32, eval_every=3, eval_windows=2, **options)
    model = TinyMoE(dataclasses.replace(SHAPE, n_layer=1, n_ctx=32), 949, seed=3)
    return Trainer(model, cfg, tokens[:18000], tokens[18000:], torch.device("cpu"), tmp_path / "ckpt.pt",
                   progress=False, **kw)


def test_training_is_deterministic_and_resumes_exactly(tmp_path: Path, monkeypatch) -> None:
    a = _trainer(tmp_path / "a")
    (tmp_path / "a").mkdir()
    history = a.run()
    assert history.held_out[-1][1] < history.held_out[0][1], "the loss went down"

    (tmp_path / "b").mkdir()
    b = _trainer(tmp_path / "b", checkpoint_s=0.0)  # a checkpoint after every step
    real_step = b.opt.step
    calls = [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(b.opt, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        b.run()
    resumed = _trainer(tmp_path / "b")
    assert resumed.step == 3
    resumed.run()
    for name, p in a.model.params.items():
        assert torch.equal(p, resumed.model.params[name]), name
    assert resumed.history.train == a.history.train


def test_minutes_fix_the_step_count_within_the_warmup(tmp_path: Path) -> None:
    timed = _trainer(tmp_path / "t", steps=None, minutes=0.05, warmup=30, epochs=1000)
    (tmp_path / "t").mkdir()
    history = timed.run()
    assert history.step_s > 0 and timed.step == timed.total_steps >= 31
    assert history.seconds < 20  # a budget of 3 s (1000 epochs would be 280 000 steps)
    capped = _trainer(tmp_path / "c", steps=None, minutes=10, warmup=30, epochs=0.01)  # 0.01 epochs: 2 steps
    (tmp_path / "c").mkdir()
    capped.run()
    assert capped.total_steps == 31, "at least the warm-up and one step"
    with pytest.raises(SpecterError, match="--warmup above 25"):
        TrainConfig(minutes=1, warmup=10).check()


def test_a_checkpoint_of_another_configuration_is_refused(tmp_path: Path) -> None:
    _trainer(tmp_path, steps=2).run()
    with pytest.raises(SpecterError, match="--steps 2"):
        _trainer(tmp_path, steps=5)


def test_shapes_k_quants_cannot_take_are_refused() -> None:
    check_shape(TINY_MOE)
    with pytest.raises(SpecterError, match="multiples of 256"):
        check_shape(dataclasses.replace(TINY_MOE, n_ff_exp=128))
    with pytest.raises(SpecterError, match="qwen2moe"):
        check_shape(dataclasses.replace(TINY_MOE, arch="qwen3moe"))


def test_the_corpus_split_follows_the_path_rule(tmp_path: Path) -> None:
    for i in range(200):
        (tmp_path / "pkg" / f"m{i}.py").parent.mkdir(exist_ok=True)
        (tmp_path / "pkg" / f"m{i}.py").write_text(f"x = {i}\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "other.py").write_text("y = 1\n")
    (tmp_path / "latin1.py").write_bytes(b"s = '\xe9'\n")
    c = stdlib_corpus(tmp_path)
    names = {r for r, _ in c.train + c.held_out}
    assert len(names) == 200 and "site-packages/other.py" not in names and "latin1.py" not in names
    assert {r for r, _ in c.held_out} == {r for r in names if held_out(r)} and 0 < len(c.held_out) < 20
    assert stdlib_corpus(tmp_path).digest() == c.digest()
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecterError, match="no readable .py files"):
        stdlib_corpus(tmp_path / "empty")
    with pytest.raises(SpecterError, match="does not exist"):
        stdlib_corpus(tmp_path / "missing")


def test_the_script_trains_exports_and_reports(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    out, docs = tmp_path / "run", tmp_path / "docs"
    cmd = [sys.executable, str(REPO / "scripts" / "train_tiny_moe.py"), "--steps", "3", "--batch", "2",
           "--seq-len", "64", "--layers", "1", "--vocab-size", "300", "--max-corpus-mb", "0.3", "--eval-every", "3",
           "--eval-tokens", "256", "--warmup", "2", "--out-dir", str(out), "--docs-dir", str(docs), "-q"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    r = json.loads((out / "results.json").read_text())
    assert r["steps"] == 3 and r["n_vocab"] == 300
    assert abs(r["ppl_ours"] - r["ppl_torch"]) < 1e-3 * r["ppl_torch"]
    assert abs(r["ppl_llama"] - r["ppl_ours"]) < 1e-2 * r["ppl_ours"]
    page = (docs / "TINY_MODEL.md").read_text()
    assert f"{r['ppl_llama']:.3f}" in page and (docs / "img" / "tiny-moe-loss.png").stat().st_size > 1000
    # run again: the checkpoint is complete, so nothing is trained and the same file is written
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "results.json").read_text())["ppl_ours"] == r["ppl_ours"]
    bad = subprocess.run(cmd[:2] + ["--out-dir", str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stderr.startswith("Error: give a budget"), bad.stderr


def test_the_writer_refuses_weights_that_do_not_fit_the_layout(tmp_path: Path) -> None:
    weights = TinyMoE(SHAPE, 949).gguf_weights()
    weights["blk.0.attn_q.weight"] = weights["blk.0.attn_q.weight"][:, :128]
    with pytest.raises(SpecterError, match="blk.0.attn_q.weight has shape"):
        write_synthetic(tmp_path / "x.gguf", SHAPE, "f16", tokenizer=tiny_tokenizer(), weights=weights)
    del weights["output.weight"]
    with pytest.raises(SpecterError, match="missing \\['output.weight'\\]"):
        write_synthetic(tmp_path / "x.gguf", SHAPE, "f16", tokenizer=tiny_tokenizer(), weights=weights)
