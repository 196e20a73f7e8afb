"""The draft depth of each iteration (`--n-draft auto`): the k that minimizes the expected time per token.

With a per-token acceptance a (drafted tokens kept / drafted tokens tested: those up to and including the first
rejected one), an iteration of depth k commits E(k) = (1 - a^(k+1)) / (1 - a) tokens on average (the accepted drafts
and the target's own) and costs T(k) = k * draft step + verification(k) + other, so the chooser takes the k in 0 ..
`max_depth` with the least T(k) / E(k); k = 0 is a plain step of the target (nothing drafted: the draft does not
pay). Every figure is measured on the iterations so far (the decoder leaves out a generation's first): the draft step
and the time around the steps (`other`: from one read of a verdict to the next, the host's work and the caller's
between tokens, less the steps' device time) as running means, one for drafting iterations and one for plain steps
(whose host work mostly overlaps the step run ahead: in one mean, the plain steps, the more numerous, set a drafting
iteration's price too); the verification per depth (it grows with k: more tokens, more distinct experts, more
misses), whose running mean is the plain average of its first 1 / MEAN measurements; the acceptance as decayed counts
(the text changes). A depth not tried yet is predicted from the nearest tried one, optimistically (the same
verification time for a deeper one, time in proportion to tokens for a shallower one), so each depth that could win
is tried.

What is not chosen is not measured, so both kinds of iteration are probed. After `probe_gap` plain steps in a row one
iteration drafts again at the best k ≥ 1, so the acceptance is measured anew. The gap starts at `PROBE_AFTER`; a
probe followed by a plain step with drafting still priced above `PROBE_MARGIN` times a plain step doubles it, up to
`PROBE_AFTER_MAX`, and any other probe sets it back: with a probe every 16 plain steps, greedy generations of
Qwen3-30B-A3B shapes at 24 GiB (45% accepted, depth 1 costing 9.4 ms a token against plain steps' 6.3) spent 22 of
116 iterations at depth 1 (H100, 2026-12-06 12:10). After `PROBE_AFTER` drafting iterations in a row one plain step
runs where, costing no more than the cheapest verification, it would come within `PROBE_MARGIN` of the best depth:
the expert cache warms as decoding goes on, and plain steps measured at 25 ms among the first iterations had kept
greedy generations of Qwen3-30B-A3B shapes at 24 GiB drafting at depth 1 for 75 iterations (8.7 ms verifications,
1.54 tokens each), where the same run's sampled ones ran plain steps at 5.3 ms (H100, 2026-12-06). A depth that has
not run for `PROBE_AFTER` iterations starts its mean anew. With offloaded experts a generation's first iteration
drafts whatever plain steps cost (`choose(opening=True)`): after a new prompt the expert cache is cold, and plain steps
measured there (81-97 ms against 6-9 later, Qwen3-30B-A3B shapes at 16 GiB, H100, 2026-12-06 13:33) kept the chooser
drafting for `PROBE_AFTER` iterations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specter_gguf.errors import SpecterError

MAX_DEPTH = 8
# the deepest fixed --n-draft: llama.cpp's default --draft-max (a fixed depth captures the graphs of one verification
# depth, where the memory plan reserves for auto's eight; depths above 8 are not yet measured on a GPU)
MAX_FIXED_DEPTH = 16
MEAN = 0.2  # weight of the newest measurement in the running means
DECAY = 0.95  # per iteration, of the acceptance counts
PRIOR = (1.6, 2.0)  # (kept, tested) before any iteration: an acceptance of 0.8 worth two tokens
PROBE_AFTER = 16  # plain steps (depth 0) in a row before one iteration drafts again, and the converse
# the most plain steps in a row before drafting is probed, after probes far from paying: at 128 a text that turned
# predictable waited too long for its probe (simulated, acceptance 0.05 then 0.9: 3% slower than a probe every 16)
PROBE_AFTER_MAX = 32
PROBE_MARGIN = 1.25  # a plain step is probed where, bounded by the cheapest verification, it comes this close


def parse_depth(value: int | str) -> int | Literal["auto"]:
    """A draft depth as `--n-draft` takes it: a whole number from 1 to MAX_FIXED_DEPTH, or "auto"."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        depth = int(value) if not isinstance(value, (bool, float)) else None
    except ValueError:
        depth = None
    if depth is None or not 1 <= depth <= MAX_FIXED_DEPTH:
        raise SpecterError(f"--n-draft must be a whole number from 1 to {MAX_FIXED_DEPTH} or auto, got {value!r}")
    return depth


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens an iteration of depth k commits on average: 1 + a + ... + a^k."""
    return sum(acceptance ** i for i in range(k + 1))


@dataclass
class DepthChooser:
    """Chooses each iteration's depth from what earlier iterations measured (module docstring); `first` until
    one has been measured."""

    first: int
    max_depth: int = MAX_DEPTH
    step_s: float | None = None                  # one draft step
    other_s: float | None = None                 # a drafting iteration's time outside its steps
    plain_other_s: float | None = None           # ... a plain step's (depth 0)
    verify_s: dict[int, float] = field(default_factory=dict)  # depth -> one verification
    kept: float = PRIOR[0]
    tested: float = PRIOR[1]
    plain_run: int = 0                           # depth-0 iterations in a row
    probe_gap: int = PROBE_AFTER                 # ... before an iteration drafts to measure the acceptance anew
    probed: bool = False                         # whether the last iteration was such a probe
    last_run: dict[int, int] = field(default_factory=dict)  # depth -> the iteration it last ran (1 = the first)
    samples: dict[int, int] = field(default_factory=dict)   # depth -> measurements in its mean since it (re)started
    iterations: int = 0                          # recorded so far

    @property
    def draft_run(self) -> int:
        """Drafting iterations in a row: those since the last plain step."""
        return self.iterations - self.last_run.get(0, 0)

    @property
    def acceptance(self) -> float:
        return self.kept / self.tested

    def verification_s(self, k: int) -> float:
        """The verification of depth k: measured, or predicted from the nearest measured depth (optimistically)."""
        if k in self.verify_s:
            return self.verify_s[k]
        near = min(self.verify_s, key=lambda d: (abs(d - k), d))
        return self.verify_s[near] * ((k + 1) / (near + 1) if k < near else 1.0)

    def seconds_per_token(self, k: int) -> float:
        assert self.step_s is not None
        other = (self.other_s if k else self.plain_other_s) or 0.0  # not measured yet: optimistically nothing
        return (k * self.step_s + self.verification_s(k) + other) / expected_tokens(k, self.acceptance)

    def choose(self, opening: bool = False) -> int:
        """The depth of the next iteration; `opening`: a generation's first with offloaded experts, which drafts at
        the best k >= 1 (a plain step after a new prompt meets a cold expert cache and waits for each layer's misses
        in turn, where a drafting iteration's lookahead copies them while the draft runs)."""
        if self.step_s is None or not self.verify_s:
            return min(self.first, self.max_depth)
        lowest = 1 if opening or self.plain_run >= self.probe_gap else 0
        best = min(range(lowest, self.max_depth + 1), key=self.seconds_per_token)
        return 0 if best and not opening and self._plain_worth_probing(best) else best

    def _plain_worth_probing(self, best: int) -> bool:
        """After PROBE_AFTER drafting iterations in a row: whether a plain step could come within PROBE_MARGIN of
        depth `best` if it cost no more than the cheapest verification measured (its own time may be stale)."""
        if self.draft_run < PROBE_AFTER or 0 not in self.verify_s:
            return False
        bound = min(self.verify_s.values()) + (self.plain_other_s or 0.0)
        return bound <= PROBE_MARGIN * self.seconds_per_token(best)

    def _drafting_far_off(self) -> bool:
        """Whether the best drafting depth is priced above PROBE_MARGIN times a plain step."""
        drafting = min(self.seconds_per_token(k) for k in range(1, self.max_depth + 1))
        return drafting > PROBE_MARGIN * self.seconds_per_token(0)

    def record(self, k: int, n_accepted: int, draft_s: float, verify_s: float, other_s: float) -> None:
        """An iteration of depth k kept `n_accepted` drafts; its drafting, verification and other time."""
        if self.probed:  # the iteration after a probe
            self.probe_gap = min(2 * self.probe_gap, PROBE_AFTER_MAX) if k == 0 and self._drafting_far_off() \
                else PROBE_AFTER
        self.probed = k > 0 and self.plain_run >= self.probe_gap
        self.plain_run = self.plain_run + 1 if k == 0 else 0
        stale = self.iterations - self.last_run.get(k, self.iterations) >= PROBE_AFTER
        self.iterations += 1
        self.last_run[k] = self.iterations
        if k:
            self.kept = DECAY * self.kept + n_accepted
            self.tested = DECAY * self.tested + n_accepted + (n_accepted < k)
            self.step_s = _mean(self.step_s, draft_s / k)
            self.other_s = _mean(self.other_s, other_s)
        n = self.samples[k] = 1 if stale else self.samples.get(k, 0) + 1
        if not k:
            self.plain_other_s = _mean(self.plain_other_s, other_s, n)
        self.verify_s[k] = _mean(self.verify_s.get(k), verify_s, n)


def _mean(old: float | None, new: float, n: int = 0) -> float:
    """A running mean, `new` its nth measurement: weighted max(MEAN, 1 / n), so the plain average of the first
    1 / MEAN (at weight MEAN alone the first keeps 41% of the weight after four more); n = 0: weight MEAN."""
    weight = max(MEAN, 1 / n) if n else MEAN
    return new if old is None else (1 - weight) * old + weight * new
