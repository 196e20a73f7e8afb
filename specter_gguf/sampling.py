"""Token sampling with llama.cpp's option semantics.

The chain follows llama.cpp's default sampler order (``common/common.h`` of the llama-cpp-python 0.3.36
sdist: penalties, dry, top_n_sigma, top_k, typical_p, top_p, min_p, xtc, temperature, then ``dist``), with
the stages we do not implement (dry, top-n-sigma, typical-p, xtc) being disabled by default there:

1. **penalties** over the last ``repeat_last_n`` tokens of ``history``: for every token seen there with
   count ``c``, a logit ``<= 0`` is multiplied by ``repeat_penalty`` and a positive one divided by it, then
   ``c * frequency_penalty + presence_penalty`` is subtracted;
2. **top_k**: keep the ``top_k`` largest logits (ties at the boundary: lowest ids first);
3. **top_p**: softmax of the survivors (no temperature yet), keep the smallest prefix, by descending
   probability, whose cumulative probability reaches ``top_p``;
4. **min_p**: keep the survivors whose logit is at least ``max_logit + log(min_p)``, i.e. whose probability
   is at least ``min_p`` times the largest one;
5. **temperature**: divide the survivors' logits by ``temperature``;
6. **distribution**: softmax of the survivors, one draw from the sampler's own seeded generator.

Note that top_p and min_p see the logits *before* temperature, as in llama.cpp. A ``temperature <= 0``
means greedy: the argmax of the penalized logits (ties: lowest id), which is what llama.cpp's chain
yields there too; :meth:`Sampler.probabilities` is then the one-hot vector of that token.

All of the arithmetic runs in float64: with top_k on, penalties and top_k run where the logits are (the GPU in
generation) and only the top_k candidates cross to the host; otherwise everything runs on the CPU.

`chain_probabilities` and `chain_sample` are stages 2-6 without penalties on the logits' device, many rows at once,
over the top_k candidates only, in a form a CUDA graph can hold (speculative sampling on the device): one native call
(`kernels.sample_chain`), which also draws a token per row; `draw_rows` draws from any candidates' probabilities (a
rejected draft's residual). The uniforms come from the sampler's generator (`Sampler.uniforms`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from . import kernels
from .errors import SpecterError

__all__ = ["SamplingParams", "SamplingOptionError", "Sampler", "chain_knobs", "chain_probabilities", "chain_sample",
           "chain_workspace", "draw_rows", "probabilities_at"]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class SamplingOptionError(SpecterError):
    """An invalid `SamplingParams` field: `option` (the field's name), `value`, and `fix` (what to give instead),
    so that a caller can name the option as its user wrote it (the CLI: its flag)."""

    def __init__(self, option: str, value: object, fix: str) -> None:
        super().__init__(f"invalid sampling option {option}={value!r}: {fix}")
        self.option, self.value, self.fix = option, value, fix


@dataclass
class SamplingParams:
    """Sampling options, with the meanings and defaults of llama.cpp's options of the same role.

    - ``temperature``: divides the logits; ``<= 0`` samples greedily (argmax, ties to the lowest id).
    - ``top_k``: keep the k most likely tokens; ``<= 0`` disables it.
    - ``top_p``: nucleus filter; ``1.0`` disables it.
    - ``min_p``: drop tokens below ``min_p`` times the top probability; ``0.0`` disables it.
    - ``repeat_penalty``: divides positive / multiplies negative logits of recent tokens; ``1.0`` = off.
    - ``repeat_last_n``: how many recent tokens the penalties look at; ``0`` disables them, ``-1`` = all.
    - ``presence_penalty``, ``frequency_penalty``: OpenAI-style, subtracted once / per occurrence.
    - ``seed``: fixes the random stream; ``None`` draws a random seed (reported as ``Sampler.seed``).
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, fix: str) -> SamplingOptionError:
            return SamplingOptionError(name, getattr(self, name), fix)

        if not _is_real(self.temperature):
            raise bad("temperature", "use a finite number (<= 0 means greedy, e.g. 0.8)")
        if not _is_int(self.top_k):
            raise bad("top_k", "use an integer (<= 0 disables it, e.g. 40)")
        if not _is_real(self.top_p) or not 0.0 <= self.top_p <= 1.0:
            raise bad("top_p", "use a number between 0 and 1 (1.0 disables it, e.g. 0.95)")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "use a number between 0 and 1 (0.0 disables it, e.g. 0.05)")
        if not _is_real(self.repeat_penalty) or self.repeat_penalty <= 0.0:
            raise bad("repeat_penalty", "use a number > 0 (1.0 disables it, e.g. 1.1)")
        if not _is_int(self.repeat_last_n) or self.repeat_last_n < -1:
            raise bad("repeat_last_n", "use an integer >= -1 (0 disables penalties, -1 = whole context)")
        if not _is_real(self.presence_penalty):
            raise bad("presence_penalty", "use a finite number (0.0 disables it)")
        if not _is_real(self.frequency_penalty):
            raise bad("frequency_penalty", "use a finite number (0.0 disables it)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise bad("seed", "use an integer between 0 and 2**64-1, or leave it unset for a random seed")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @staticmethod
    def check(sampling: object) -> None:
        """Refuse a `sampling` argument that is neither None nor a SamplingParams (a dict, say)."""
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise SpecterError(f"sampling must be a SamplingParams (e.g. SamplingParams(temperature=0)), not "
                               f"{type(sampling).__name__}")

    @property
    def penalties_active(self) -> bool:
        return self.repeat_last_n != 0 and not (
            self.repeat_penalty == 1.0 and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
        )


def _top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` (ids, values) of ``x`` sorted by descending value, ties by ascending id."""
    n = x.numel()
    if k >= n:
        vals, ids = torch.sort(x, descending=True, stable=True)
        return ids, vals
    kth = torch.topk(x, k, sorted=False).values.min()
    above = torch.nonzero(x > kth).reshape(-1)
    at = torch.nonzero(x == kth).reshape(-1)[: k - above.numel()]
    cand = torch.cat([above, at])  # ascending ids within each group, so a stable sort breaks ties by id
    order = torch.sort(x[cand], descending=True, stable=True).indices
    return cand[order], x[cand][order]


def chain_knobs(params: SamplingParams) -> torch.Tensor:
    """The sampled chain's settings as `chain_probabilities` reads them (float64, CPU): temperature, top_p (2
    when off: never reached), log(min_p) (-inf when off)."""
    top_p = params.top_p if params.top_p < 1.0 else 2.0
    log_min_p = math.log(params.min_p) if params.min_p > 0.0 else -math.inf
    return torch.tensor([params.temperature, top_p, log_min_p], dtype=torch.float64)


def chain_candidates(params: SamplingParams, n_vocab: int) -> int:
    """How many candidates `chain_probabilities` ranks: top_k, or the whole vocabulary when it is off."""
    return params.top_k if 0 < params.top_k < n_vocab else n_vocab


def chain_probabilities(logits: torch.Tensor, n_candidates: int,
                        knobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stages 2-6 (no penalties; temperature > 0) for each row of `logits` [R, n_vocab] with the `knobs` of
    `chain_knobs` on the logits' device, over the top `n_candidates` only (every later stage keeps a prefix of
    them): (ids [R, C] ascending, their final probabilities [R, C] float64), C = n_candidates; the other tokens
    have probability 0. The same filters as `Sampler.probabilities`, ties at the top_k boundary and among the
    candidates going to the lower id; past the native chain's limits (top_k off) they follow `torch.topk`'s order."""
    ids, probs, _ = chain_sample(logits, n_candidates, knobs)
    return ids, probs


def chain_workspace(n_rows: int, n_vocab: int, n_candidates: int, device: torch.device) -> torch.Tensor | None:
    """The scratch `chain_sample` of up to `n_rows` rows uses (None: it needs none), preallocated for CUDA graphs."""
    if not kernels.sample_chain_fits(n_vocab, n_candidates, device):
        return None
    return torch.empty(kernels.sample_chain_workspace_size(n_rows, n_vocab, n_candidates), dtype=torch.uint8,
                       device=device)


def chain_sample(logits: torch.Tensor, n_candidates: int, knobs: torch.Tensor, uniforms: torch.Tensor | None = None,
                 out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
                 workspace: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`chain_probabilities` and, with `uniforms` [R] in [0, 1), a token per row drawn as `draw_rows` draws: (ids,
    probs, tokens [R] or None), written into `out` = (ids, probs, tokens) when given, with the `workspace` of
    `chain_workspace` (preallocated: CUDA graphs)."""
    if (kernels.sample_chain_fits(logits.shape[-1], n_candidates, logits.device) and logits.dtype == torch.float32
            and logits.stride(-1) == 1):
        ids, probs, tokens = (None, None, None) if out is None else out
        return kernels.sample_chain(logits, n_candidates, knobs, uniforms, ids=ids, probs=probs, tokens=tokens,
                                    workspace=workspace)
    # top_k off (C = the whole vocabulary) or past the native chain's limits: tensor ops
    vals, ids = torch.topk(logits.float(), n_candidates, dim=-1)  # float32 ranks as float64: widening is exact
    vals = vals.to(torch.float64)
    rank = torch.arange(n_candidates, device=vals.device)
    cum = torch.softmax(vals, -1).cumsum(-1)  # top_p normalizes over the top_k survivors, before temperature
    top_p = (cum < knobs[1]).sum(-1, keepdim=True) + 1  # the prefix whose probability reaches top_p
    min_p = (vals >= vals[:, :1] + knobs[2]).sum(-1, keepdim=True).clamp(min=1)
    kept = torch.where(rank < torch.minimum(top_p, min_p), vals / knobs[0], -math.inf)
    ids, order = torch.sort(ids, -1)
    probs = torch.softmax(kept, -1).gather(-1, order)
    tokens = None if uniforms is None else draw_rows(ids, probs, uniforms)
    if out is None:
        return ids, probs, tokens
    out[0].copy_(ids)
    out[1].copy_(probs)
    if tokens is not None:
        out[2].copy_(tokens)
    return out[0], out[1], None if tokens is None else out[2]


def probabilities_at(ids: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The probabilities of `tokens` [R, M] in each row's candidates (`chain_probabilities`' ids [R, C] ascending
    and probs [R, C]): [R, M], 0 for a token that is not a candidate."""
    at = torch.searchsorted(ids, tokens).clamp(max=ids.shape[-1] - 1)
    return torch.where(ids.gather(-1, at) == tokens, probs.gather(-1, at), 0.0)


def draw_rows(ids: torch.Tensor, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of candidates `ids` [R, C] (ascending) with `probs` [R, C] (non-negative, not
    necessarily normalized, each row with a positive entry) from `uniforms` [R] in [0, 1), as `Sampler.draw`
    draws: the first id whose cumulative probability exceeds u times the total."""
    cdf = probs.cumsum(-1)
    at = torch.searchsorted(cdf, (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1), right=True)
    cols = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, cols, 0).amax(-1, keepdim=True)  # rounding may put u * total past the last step
    return ids.gather(-1, torch.minimum(at, last)).squeeze(-1)


# the one precision choice a user has: --device cpu keeps the KV cache in float32 (float16 on CUDA, layers.py)
NAN_LOGITS = ("the model produced NaN logits: check the model file (`specter-gguf inspect MODEL`; re-download or "
              "re-convert it), or run with --device cpu, whose KV cache is float32 instead of CUDA's float16")
NONFINITE_LOGITS = "the model produced NaN or infinite logits: check the model file"


class Sampler:
    """Draws tokens from logits according to ``SamplingParams``; deterministic for a given seed.

    ``sample(logits, history)`` is a draw from ``probabilities(logits, history)`` (the same generator
    state gives the same token through ``draw(probabilities(...))``), except in greedy mode where it is
    the argmax and consumes no randomness. ``random()`` and ``draw()`` expose the generator for
    speculative rejection sampling.
    """

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.params = params if params is not None else SamplingParams()
        self.seed: int = self.params.seed if self.params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(self.seed)

    # -- the chain -----------------------------------------------------------------------------

    @staticmethod
    def _as_vector(logits: torch.Tensor) -> torch.Tensor:
        if not isinstance(logits, torch.Tensor):
            logits = torch.as_tensor(logits)
        x = logits.detach()
        if x.dim() > 1 and x.numel() == x.shape[-1]:  # e.g. [1, n_vocab]
            x = x.reshape(-1)
        if x.dim() != 1 or x.numel() == 0:
            raise ValueError(f"expected the logits of one position (a non-empty 1-D tensor), got shape {tuple(logits.shape)}")
        x = x.to(device="cpu", dtype=torch.float64, copy=True)
        if torch.isnan(x).any():
            raise SpecterError(NAN_LOGITS)
        return x

    def penalized_logits(self, logits: torch.Tensor, history: Sequence[int] = ()) -> torch.Tensor:
        """Stage 1 only: the logits (float64, CPU) after repeat/presence/frequency penalties."""
        return self._penalize(self._as_vector(logits), history)

    def _penalize(self, x: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """Stage 1 on a float64 vector x (changed in place, on its own device)."""
        p = self.params
        if not p.penalties_active or len(history) == 0:
            return x
        recent = history if p.repeat_last_n < 0 else history[-p.repeat_last_n:]
        ids = torch.as_tensor(list(recent) if not isinstance(recent, torch.Tensor) else recent, dtype=torch.long).reshape(-1).cpu()
        if ids.numel() == 0:
            return x
        if int(ids.min()) < 0 or int(ids.max()) >= x.numel():
            raise ValueError(f"history holds token ids outside the vocabulary of {x.numel()} tokens")
        seen, counts = torch.unique(ids, return_counts=True)
        seen, counts = seen.to(x.device), counts.to(x.device, torch.float64)
        v = x[seen]
        v = torch.where(v <= 0, v * p.repeat_penalty, v / p.repeat_penalty)
        x[seen] = v - counts * p.frequency_penalty - p.presence_penalty
        return x

    def _top_k_where_the_logits_are(self, logits: torch.Tensor,
                                    history: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Stages 1-2 on the logits' device (the GPU in generation): (ids, penalized values) of the top_k
        candidates as `_top` orders them, float64 on the CPU; only 2 * top_k + 2 numbers are read back instead of
        the vocabulary. None when ties at the boundary make the choice of candidates depend on ids (`_top`
        decides those on the host)."""
        k = self.params.top_k
        x = self._penalize(logits.detach().reshape(-1).to(torch.float64, copy=True), history)
        vals, ids = torch.topk(x, k)
        at_or_above = (x >= vals[-1]).sum()
        packed = torch.cat([vals, ids.double(), at_or_above.double()[None], torch.isnan(x).any().double()[None]])
        packed = packed.cpu()
        if packed[-1] != 0:
            raise SpecterError(NAN_LOGITS)
        if int(packed[-2]) != k:
            return None
        vals, ids = packed[:k], packed[k:2 * k].long()
        order = torch.sort(ids).indices  # ties inside the top k: ascending ids, as `_top` orders them
        vals, ids = vals[order], ids[order]
        order = torch.sort(vals, descending=True, stable=True).indices
        return ids[order], vals[order]

    def _candidates(self, logits: torch.Tensor, history: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Surviving token ids (ascending) and their final probabilities (float64, summing to 1)."""
        p = self.params
        n = logits.numel() if isinstance(logits, torch.Tensor) else len(logits)
        top_k_on = 0 < p.top_k < n
        top = None  # (ids, penalized logits) of the top_k candidates, in `_top`'s order
        if top_k_on and not p.greedy and isinstance(logits, torch.Tensor):
            top = self._top_k_where_the_logits_are(logits, history)
        if top is None:
            x = self.penalized_logits(logits, history)
            if top_k_on and not p.greedy:
                top = _top(x, p.top_k)
        if top is not None:  # every later stage sees only the top_k candidates (the max logit is among them)
            x = top[1]
        x_max = float(x.max())
        if not math.isfinite(x_max):
            raise SpecterError("every logit is -inf or +inf after penalties: check the model file and logit biases")
        if p.greedy:
            tok = int(torch.argmax(x))
            return torch.tensor([tok]), torch.ones(1, dtype=torch.float64)

        # Every filter keeps a prefix of the candidates in descending logit order (ties: ascending id), so
        # the survivors are the shortest of the three prefixes; only that much is ever sorted.
        limit = p.top_k if top_k_on else n
        if p.min_p > 0.0:  # min_p's threshold depends on the max logit only, which every filter keeps
            limit = min(limit, max(1, int((x >= x_max + math.log(p.min_p)).sum())))
        if p.top_p < 1.0 and limit > 1:
            if top is not None:  # top_p normalizes over the top_k survivors, which are few: take them all
                ids, vals = top
                log_z, k = torch.logsumexp(vals, 0), limit
            else:  # grow a sorted prefix until its probability reaches top_p
                log_z, k = torch.logsumexp(x, 0), min(limit, 128)
            while True:
                if top is None:
                    ids, vals = _top(x, k)
                cum = torch.cumsum(torch.exp(vals[:k] - log_z), 0)
                reached = torch.nonzero(cum >= p.top_p).reshape(-1)
                if reached.numel() or k == limit:
                    m = int(reached[0]) + 1 if reached.numel() else limit
                    break
                k = min(limit, k * 8)
        else:
            m = limit
            if top is not None:
                ids, vals = top
            elif m == n:  # nothing filtered: no order needed
                ids, vals = torch.arange(n), x
            else:
                ids, vals = _top(x, m)

        ids, vals = ids[:m], vals[:m]
        probs = torch.softmax(vals / p.temperature, dim=0)
        order = torch.argsort(ids)
        return ids[order], probs[order]

    def probabilities(self, logits: torch.Tensor, history: Sequence[int] = ()) -> torch.Tensor:
        """The distribution (float64, CPU, shape [n_vocab]) that ``sample`` draws from, after all filters."""
        n = logits.numel() if isinstance(logits, torch.Tensor) else len(logits)
        ids, probs = self._candidates(logits, history)
        out = torch.zeros(n, dtype=torch.float64)
        out[ids] = probs
        return out

    # -- drawing -------------------------------------------------------------------------------

    def random(self) -> float:
        """One uniform number in [0, 1) from this sampler's generator (for acceptance tests)."""
        return float(torch.rand((), generator=self._gen, dtype=torch.float64))

    def uniforms(self, n: int) -> torch.Tensor:
        """`n` uniform numbers in [0, 1) from this sampler's generator (float64, CPU), as `n` calls of `random`."""
        return torch.rand(n, generator=self._gen, dtype=torch.float64)

    def _draw_support(self, ids: torch.Tensor, probs: torch.Tensor) -> int:
        if ids.numel() == 1:
            self.random()  # one draw per token whatever the support, so streams stay aligned
            return int(ids[0])
        cdf = torch.cumsum(probs, dim=0)
        t = self.random() * float(cdf[-1])
        i = int(torch.searchsorted(cdf, torch.tensor([t], dtype=torch.float64), right=True)[0])
        return int(ids[min(i, ids.numel() - 1)])

    def draw(self, probs: torch.Tensor) -> int:
        """One token drawn from a (not necessarily normalized) non-negative vector of probabilities."""
        probs = probs.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
        ids = torch.nonzero(probs > 0).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("cannot draw from a distribution with no positive probability")
        return self._draw_support(ids, probs[ids])

    @staticmethod
    def _argmax(logits: torch.Tensor) -> int:
        """Greedy decoding where the logits are (the GPU): one reduction and one read-back instead of copying
        the vocabulary to the host. Ties go to the lowest id, as in the full chain."""
        value, index = torch.max(logits.detach().reshape(-1).float(), 0)
        value, index = torch.stack([value.double(), index.double()]).tolist()
        if not math.isfinite(value):
            raise SpecterError(NONFINITE_LOGITS)
        return int(index)

    def sample(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """The next token for these logits of one position, given the tokens so far (for penalties)."""
        if self.params.greedy and not self.params.penalties_active and isinstance(logits, torch.Tensor):
            return self._argmax(logits)
        ids, probs = self._candidates(logits, history)
        if self.params.greedy:
            return int(ids[0])
        return self._draw_support(ids, probs)
