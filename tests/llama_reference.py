"""llama.cpp as the reference for our engine: the machinery the parity tests share.

Used by tests/test_parity.py, tests/test_deepseek2_phimoe.py and tests/test_fallback_types.py (import it
after `pytest.importorskip("llama_cpp")`):

- the bounds (per position, max|ours - ref| / max|ref|) and `position_errors`, `describe`;
- `LlamaRefs`: one `llama_cpp.Llama` per (file, context size), its logits and greedy continuation;
- `llama_routing`: llama.cpp's own expert choices, read from its graph (`ffn_moe_topk-<layer>`) through the
  scheduler's eval callback (`GGMLTensor` is the part of `struct ggml_tensor` that needs);
- `run_routed`: our routers observed (choices and top-k margins) or overridden with given choices;
- `routing_differences` and `assert_flips_are_near_ties`: where the two routings differ, and why;
- `dequantized_copy`: an F32 copy of a quantized GGUF (llama.cpp on it runs the file's exact weights);
- `parity_tokens`, `our_model`, `print_parity_table` and `closing` (the body of a `refs` fixture).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import llama_cpp
import numpy as np
import torch

from specter_gguf import layers
from specter_gguf.engine import Model

# The bar (DESIGN.md): per position, max|ours - ref| / max|ref|.
FLOAT_MEDIAN, FLOAT_MAX = 2e-3, 5e-3  # F32/F16 files
QUANT_MEDIAN, QUANT_MAX = 2.5e-2, 1.5e-1  # quantized files (llama.cpp quantizes activations to 8 bits)
# Where llama.cpp routes a token differently, our top-k margin must be below this: a near-tie, where a
# rounding-level perturbation flips a choice.
NEAR_TIE = 0.02

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


# --------------------------------------------------------------------------------------------------
# llama.cpp: logits, greedy tokens, expert choices
# --------------------------------------------------------------------------------------------------


class LlamaRefs:
    """One `llama_cpp.Llama` per (file, context size), built on first use; `close()` frees them all.
    `n_ctx` (also the batch size) is the default context size, `n_threads` the threads of both phases."""

    def __init__(self, n_ctx: int, n_threads: int) -> None:
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self._llamas: dict[tuple[Path, int], llama_cpp.Llama] = {}

    def get(self, path: Path, n_ctx: int | None = None) -> llama_cpp.Llama:
        n_ctx = self.n_ctx if n_ctx is None else n_ctx
        key = (Path(path), n_ctx)
        if key not in self._llamas:
            self._llamas[key] = llama_cpp.Llama(str(path), logits_all=True, n_ctx=n_ctx, n_batch=n_ctx,
                                                n_threads=self.n_threads, n_threads_batch=self.n_threads,
                                                seed=0, verbose=False)
        return self._llamas[key]

    def __getitem__(self, path: Path) -> llama_cpp.Llama:
        return self.get(path)

    def logits(self, path: Path, tokens: list[int], n_ctx: int | None = None) -> np.ndarray:
        """llama.cpp's logits [T, n_vocab] for one pass over `tokens` from an empty context."""
        llm = self.get(path, n_ctx)
        llm.reset()
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)

    def greedy(self, path: Path, prompt: list[int], n: int) -> list[int]:
        """llama.cpp's greedy continuation: eval, take the argmax of its own logits (lowest id on ties, as
        ours), feed it back; stop before an end-of-generation token, as our engine does."""
        llm = self.get(path)
        vocab = llm._model.vocab
        llm.reset()
        llm.eval(prompt)
        out: list[int] = []
        while len(out) < n:
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            if llama_cpp.llama_vocab_is_eog(vocab, tok):
                break
            out.append(tok)
            if len(out) < n:
                llm.eval([tok])
        return out

    def close(self) -> None:
        for llm in self._llamas.values():
            llm.close()
        self._llamas.clear()


class GGMLTensor(ctypes.Structure):
    """`struct ggml_tensor` of ggml.h (llama-cpp-python 0.3.36), as far as the eval callback needs it."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


def context_params(n_ctx: int, n_threads: int) -> llama_cpp.llama_context_params:
    """llama.cpp's default context parameters with context, batch and micro-batch `n_ctx`."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
    params.n_threads = params.n_threads_batch = n_threads
    return params


def llama_routing(llm: llama_cpp.Llama, tokens: list[int],
                  params: llama_cpp.llama_context_params | None = None) -> tuple[dict[int, np.ndarray], np.ndarray]:
    """llama.cpp's expert choices {layer: [T, k]} for one pass over `tokens`, read from its graph (tensors
    `ffn_moe_topk-<layer>`) through the scheduler's eval callback, and the logits [T, n_vocab] of that pass.

    It runs on a second context of the same loaded model, made with `params` (a copy; by default the
    `Llama`'s own context parameters, so the same computation as its logits); every position gets logits,
    so the last layer runs all of them."""
    got: dict[int, list[list[int]]] = {}

    def on_tensor(t: int, ask: bool, _user: int) -> bool:
        tensor = ctypes.cast(t, ctypes.POINTER(GGMLTensor)).contents
        name = tensor.name.decode()
        if ask:
            return name.startswith("ffn_moe_topk-")
        k, n = tensor.ne[0], tensor.ne[1]
        got[int(name.rsplit("-", 1)[1])] = [
            list((ctypes.c_int32 * k).from_address(tensor.data + j * tensor.nb[1])) for j in range(n)]
        return True

    callback = llama_cpp.ggml_backend_sched_eval_callback(on_tensor)
    params = llm.context_params if params is None else params
    params = type(params).from_buffer_copy(params)
    params.cb_eval = callback
    ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
    assert ctx, "llama.cpp could not make a context"
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, tok in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, 1
            batch.seq_id[i][0] = 0
        assert llama_cpp.llama_decode(ctx, batch) == 0
        n_vocab = llm.n_vocab()
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(len(tokens), n_vocab)).copy()
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    return {layer: np.array(ids, dtype=np.int64) for layer, ids in got.items()}, logits


# --------------------------------------------------------------------------------------------------
# our engine: models, tokens, routers observed or forced
# --------------------------------------------------------------------------------------------------


def our_model(models: dict, path: Path, ctx_size: int | None = None) -> Model:
    """Our engine on the CPU, one Model per (file, context size) cached in `models`; `ctx_size` None loads
    with the engine's default context size."""
    key = (Path(path), ctx_size)
    if key not in models:
        kwargs = {} if ctx_size is None else {"ctx_size": ctx_size}
        models[key] = Model.load(path, device="cpu", progress=False, **kwargs)
    return models[key]


def prompt_tokens(m: Model, llm: llama_cpp.Llama | None = None) -> list[int]:
    """PROMPT as token ids: llama.cpp's tokenization checked against ours (with `llm`), else ours."""
    if llm is None:
        return m.tokenize(PROMPT, add_bos=False)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=False, special=False)
    assert m.tokenize(PROMPT, add_bos=False) == prompt, "our tokenizer disagrees with llama.cpp's on the prompt"
    return prompt


def parity_tokens(m: Model, n: int, llm: llama_cpp.Llama | None = None, fixed: list[int] | tuple[int, ...] = (),
                  seed: int = 1234) -> list[int]:
    """`n` varied token ids: the first 12 of the tokenized PROMPT (see `prompt_tokens`), then the `fixed`
    ids, then random ids over the vocabulary (`seed`)."""
    prompt = prompt_tokens(m, llm)[:12]
    rng = np.random.default_rng(seed)
    extra = list(fixed)
    return prompt + extra + [int(t) for t in rng.integers(0, m.config.n_vocab, n - len(prompt) - len(extra))]


def _router_probs(r: layers.Router, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight probabilities, selection scores) as the router computes them from its logits."""
    sig = isinstance(r, layers.SelectingRouter) and r.gating == "sigmoid"
    probs = torch.sigmoid(logits) if sig else torch.softmax(logits, dim=-1)
    bias = getattr(r, "selection_bias", None)
    return probs, probs if bias is None else probs + bias.float()


def _router_margins(r: layers.Router, sel: torch.Tensor) -> torch.Tensor:
    """Per token, the smallest gap that decides the choice: k-th vs (k+1)-th score among the allowed experts,
    and (group-limited routing) the last chosen group's score vs the next group's."""
    groups = getattr(r, "n_groups", 0)
    margin = torch.full((sel.shape[0],), float("inf"))
    if groups > 1:
        g = sel.view(sel.shape[0], groups, -1).topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values
        margin = g[:, r.n_group_used - 1] - g[:, r.n_group_used]
    top = sel.sort(dim=-1, descending=True).values
    return torch.minimum(margin, top[:, r.n_used - 1] - top[:, r.n_used])


def run_routed(m: Model, tokens: list[int], force: Mapping[int, np.ndarray] | None = None
               ) -> tuple[np.ndarray, dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Our logits, expert choices {layer: [T, k]} and top-k margins {layer: [T]} (a small margin is where a
    perturbation flips a choice); with `force`, every MoE layer uses those experts instead, weighted by our
    own probabilities of them (renormalized and scaled as its router does)."""
    seen: dict[int, np.ndarray] = {}
    margins: dict[int, np.ndarray] = {}
    moes = [b.ffn for b in m.transformer.blocks if isinstance(b.ffn, layers.MoE)]
    originals = [moe.router for moe in moes]

    class Recording:
        """The layer's router, recording its choices and margins (or forcing `force`'s experts)."""

        def __init__(self, r: layers.Router, layer: int) -> None:
            self.r, self.layer, self.weight = r, layer, r.weight

        def choose(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
            logits = layers.matmul(x, self.weight if weight is None else weight)
            return (logits, *self.route(logits[:, :self.weight.shape[0]]))

        def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            r, layer = self.r, self.layer
            probs, sel = _router_probs(r, logits)
            margins[layer] = _router_margins(r, sel.cpu()).numpy()
            if force is None:
                ids, w = r.route(logits)
            else:
                ids = torch.as_tensor(force[layer], device=logits.device)
                w = probs.gather(1, ids)
                if r.normalize:
                    w = w / w.sum(-1, keepdim=True)
                if r.scale not in (0.0, 1.0):
                    w = w * r.scale
            seen[layer] = ids.cpu().numpy().copy()
            return ids, w

    for moe in moes:
        moe.router = Recording(moe.router, moe.layer)
    try:
        logits = m.logits(tokens)
    finally:
        for moe, r in zip(moes, originals):
            moe.router = r
    return logits, seen, margins


def stacked(per_layer: Mapping[int, np.ndarray]) -> np.ndarray:
    """{layer: array} as one array [n_layer, ...], layers in ascending order."""
    return np.stack([per_layer[layer] for layer in sorted(per_layer)])


# --------------------------------------------------------------------------------------------------
# comparisons
# --------------------------------------------------------------------------------------------------


def position_errors(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per position, max|ours - ref| / max|ref|."""
    assert ours.shape == ref.shape, f"logits shape {ours.shape} != the reference's {ref.shape}"
    assert np.isfinite(ours).all(), "non-finite logits"
    return np.abs(ours - ref).max(axis=1) / np.abs(ref).max(axis=1)


def describe(err: np.ndarray, top: int = 3) -> str:
    """Median, max and the `top` worst positions of per-position errors."""
    worst = np.argsort(err)[::-1][:top]
    return (f"median {np.median(err):.2e}, max {err.max():.2e}; worst "
            + ", ".join(f"pos {i}: {err[i]:.2e}" for i in worst))


def routing_differences(ours: Mapping[int, np.ndarray], ref: Mapping[int, np.ndarray]) -> list[tuple[int, int]]:
    """(layer, position) where the sets of chosen experts differ; layers are ours, each [T, k]."""
    return [(lay, pos) for lay in sorted(ours) for pos in range(len(ours[lay]))
            if set(ours[lay][pos].tolist()) != set(ref[lay][pos].tolist())]


def assert_flips_are_near_ties(diffs: list[tuple[int, int]], margins: Mapping[int, np.ndarray], near_tie: float,
                               label: str, earlier_positions: bool) -> None:
    """Each routing difference is where our router nearly tied (margin < `near_tie`), or follows an earlier
    flip: one in a lower layer at the same position, or (`earlier_positions`: attention carries flips
    forward) at the same or an earlier position."""
    for lay, pos in diffs:
        first = min(l2 for l2, p2 in diffs if (p2 <= pos if earlier_positions else p2 == pos))
        assert lay > first or margins[lay][pos] < near_tie, (
            f"{label}; the reference routes layer {lay} pos {pos} differently where the top-k margin is "
            f"{margins[lay][pos]:.4f} (>= {near_tie}) and no earlier flip explains it")


def logits_with_reference_routing(m: Model, tokens: list[int], diffs: list[tuple[int, int]],
                                  margins: Mapping[int, np.ndarray], ref_routing: Mapping[int, np.ndarray],
                                  near_tie: float, label: str) -> np.ndarray:
    """Where m's routing differs from a reference's, or should explain logits past a bound: asserts that `diffs`
    (routing_differences from `ref_routing`) has some and that each is a near tie or follows one
    (assert_flips_are_near_ties, attention carrying flips to later positions), and returns m's logits with
    `ref_routing` forced, for the caller to hold to the bound of its arithmetic alone."""
    assert diffs, f"{label}: not explained by routing (every expert choice is the reference's)"
    assert_flips_are_near_ties(diffs, margins, near_tie, label, earlier_positions=True)
    forced, _, _ = run_routed(m, tokens, force=ref_routing)
    return forced


def dequantized_copy(src: Path, dst: Path) -> Path:
    """`src` with every tensor dequantized to F32 (gguf.quants, bit-exact with ggml) and the same metadata."""
    from gguf import GGMLQuantizationType as GT
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(src)
    writer = GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[-1]) if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)
    writer.add_file_type(0)
    for t in reader.tensors:
        data = (np.asarray(t.data, dtype=np.float32) if t.tensor_type == GT.F32
                else dequantize(t.data, t.tensor_type).astype(np.float32))
        writer.add_tensor(t.name, data.reshape(tuple(int(d) for d in reversed(t.shape))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def print_parity_table(results: Mapping[tuple[str, ...], tuple[float, float]],
                       row: Callable[[tuple[str, ...]], str]) -> None:
    """The measured (median, max) errors, one line per key, sorted; `row` names a key."""
    if results:
        print("\nparity with llama.cpp, per-position max|ours-ref|/max|ref| (median / max):")
        for key, (med, mx) in sorted(results.items()):
            print(f"  {row(key)} median {med:.2e}  max {mx:.2e}")


def closing(refs: LlamaRefs, results: Mapping[tuple[str, ...], tuple[float, float]],
            row: Callable[[tuple[str, ...]], str]) -> Iterator[LlamaRefs]:
    """Body of a module-scoped `refs` fixture: yields `refs`, then closes it and prints the table."""
    yield refs
    refs.close()
    print_parity_table(results, row)
