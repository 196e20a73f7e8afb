"""Our engine's modes in the matrix: what each is called and how it loads the model for a job (run by `worker`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from specter_gguf.tokenizer import IdsOnlyTokenizer, Tokenizer

# a mode's loader: (the job, the tokenizer to load with or None for the file's own) -> a Model
Loader = Callable[[dict[str, Any], Tokenizer | IdsOnlyTokenizer | None], Any]


@dataclass(frozen=True)
class OursMode:
    """One mode of our engine. `load(job, tokenizer)` returns a Model (``generate(ids, n_predict, sampling,
    ignore_eos=True)`` returns a Generation: ``.wait()``, ``.tokens``, ``.stats``) for the rows of the job
    (``job["rows"]``, each run over the prompts after `prepare(model, job, row)`). `budget_bound` modes run once per
    budget and get ``job["budget_bytes"]``; `synthetic` modes run once per synthetic acceptance length L (a row's
    ``synth_len``); `needs_draft` modes get ``job["draft"]``. Rows of modes with the same loader, budget and draft
    share one load (`runner`): loading the benchmark's 27 GiB target took 33-38 s of a 51-55 s row."""

    name: str
    description: str
    load: Loader
    budget_bound: bool = False
    synthetic: bool = False
    needs_draft: bool = False
    prepare: Callable[[Any, dict[str, Any], dict[str, Any]], None] = lambda model, job, row: None


def _load_plain(job: dict[str, Any], tokenizer: Tokenizer | IdsOnlyTokenizer | None) -> Any:
    from specter_gguf.engine import Model

    return Model.load(job["model"], device=job["device"], ctx_size=job["ctx_size"], progress=False,
                      tokenizer=tokenizer)


def _load_offload(mode: str, hybrid: str = "off", spare_slots: int | None = None) -> Loader:
    """`spare_slots` None: lru's spare slots are the job's (`--spare-slots`), or the engine's default."""
    def load(job: dict[str, Any], tokenizer: Tokenizer | IdsOnlyTokenizer | None) -> Any:
        from specter_gguf.engine import Model

        spares = spare_slots if spare_slots is not None or mode != "lru" else job.get("spare_slots")
        model = Model.load(job["model"], device=job["device"], ctx_size=job["ctx_size"], progress=False,
                           offload=mode, gpu_budget=job["budget_bytes"], tokenizer=tokenizer, hybrid=hybrid,
                           spare_slots=spares)
        return _paced(model, job)
    return load


def _spec_loader(hybrid: str) -> Loader:
    def load(job: dict[str, Any], tokenizer: Tokenizer | IdsOnlyTokenizer | None) -> Any:
        from specter_gguf.engine import Model

        model = Model.load(job["model"], draft=job["draft"], device=job["device"], ctx_size=job["ctx_size"],
                           gpu_budget=job["budget_bytes"], progress=False, tokenizer=tokenizer, n_draft="auto",
                           hybrid=hybrid, spare_slots=job.get("spare_slots"))
        _capture_every_depth(_paced(model, job), job["settings"]["decodings"])
        return model
    return load


def _paced(model: Any, job: dict[str, Any]) -> Any:
    """With --pcie-gbps: the model's expert transfers paced to that rate, before any graph is captured."""
    if job.get("pcie_gbps") and model.offload is not None:
        measured = model.offload.pace_transfers(job["pcie_gbps"])
        print(f"expert transfers paced to {job['pcie_gbps']:g} GB/s (measured here: {measured:.1f} GB/s)", flush=True)
    return model


# one loader each: rows of one loader share a load (`runner._load_group`)
_load_spec, _load_spec_hybrid = _spec_loader("off"), _spec_loader("on")


def _spec_acceptance(model: Any, job: dict[str, Any], row: dict[str, Any]) -> None:
    """Depth auto (our default, at most speculation.MAX_DEPTH), or llama.cpp's fixed --spec-draft-n-max of the
    same matrix for ours-spec-synth-fixed(-hybrid); a synthetic row's acceptance is llama.cpp's for its L at that
    --spec-draft-n-max, whatever depth we draft."""
    from specter_gguf import speculation

    n_max = job.get("draft_n_max") or speculation.DEFAULT_N_DRAFT
    model.decoder.set_depth(n_max if row["mode"].startswith("ours-spec-synth-fixed") else "auto")
    speculation.synthetic_acceptance(model, row.get("synth_len"), n_max)


def _capture_every_depth(model: Any, decodings: list[str]) -> None:
    """One short generation at each fixed depth MAX_DEPTH .. 0 in each decoding, then depth auto again: `--n-draft
    auto` tries every depth that could win, a fixed depth drafts fewer in a generation's last iteration (no token
    past the ones asked for), and the first verification of a depth captures its CUDA graphs once per process (the
    warm-ups of 2026-12-02 05:17 UTC: 32-72 ms a verification, 12-15 later), which would otherwise land in the
    measured prompts. k + 3 tokens at depth k: the first, an iteration of k drafts, and one more that is verified at
    depth 0. Deepest first: the decoder's buffers are sized by the deepest depth so far, and growing them drops the
    graphs captured before."""
    from specter_gguf import speculation
    from specter_gguf.bench.metrics import DECODINGS
    from specter_gguf.sampling import SamplingParams

    for k in range(speculation.MAX_DEPTH, 0, -1):
        model.decoder.set_depth(k)
        for dec in decodings:
            model.generate(list(range(16, 24)), k + 3, SamplingParams(**DECODINGS[dec]), ignore_eos=True).wait()
    model.decoder.set_depth("auto")


# The registry of our modes: adding a mode is one entry.
OURS_MODES: dict[str, OursMode] = {m.name: m for m in [
    OursMode("ours", "whole model on the device", _load_plain),
    OursMode("ours-on-demand", "experts in host memory, copied on demand",
             _load_offload("on-demand"), budget_bound=True),
    OursMode("ours-lru", "experts in host memory, LRU expert cache",
             _load_offload("lru"), budget_bound=True),
    OursMode("ours-gate-prefetch", "LRU expert cache + next-layer gate prefetch",
             _load_offload("gate-prefetch"), budget_bound=True),
    OursMode("ours-spec", "speculative decoding with the draft's experts, depth auto", _load_spec, budget_bound=True,
             needs_draft=True, prepare=_spec_acceptance),
    OursMode("ours-spec-synth", "speculative decoding, synthetic acceptance, depth auto", _load_spec,
             budget_bound=True, synthetic=True, needs_draft=True, prepare=_spec_acceptance),
    OursMode("ours-spec-synth-fixed", "speculative decoding, synthetic acceptance, llama.cpp's depth", _load_spec,
             budget_bound=True, synthetic=True, needs_draft=True, prepare=_spec_acceptance),
    # --hybrid on: the misses of decode steps and verifications computed on the CPU (the rows above: off)
    OursMode("ours-lru-hybrid", "LRU expert cache, missed experts on the CPU (--hybrid on)",
             _load_offload("lru", "on"), budget_bound=True),
    # --spare-slots 0: a miss read in place, then copied in after the forward (the rows above: copied into a spare)
    OursMode("ours-lru-inplace", "LRU expert cache, misses read in place (--spare-slots 0)",
             _load_offload("lru", spare_slots=0), budget_bound=True),
    OursMode("ours-lru-hybrid-inplace", "LRU expert cache, missed experts on the CPU, the rest read in place "
             "(--hybrid on --spare-slots 0)", _load_offload("lru", "on", spare_slots=0), budget_bound=True),
    OursMode("ours-spec-hybrid", "speculative decoding with the draft's experts, depth auto, missed experts on the "
             "CPU (--hybrid on)", _load_spec_hybrid, budget_bound=True, needs_draft=True, prepare=_spec_acceptance),
    OursMode("ours-spec-synth-hybrid", "speculative decoding, synthetic acceptance, depth auto, missed experts on "
             "the CPU (--hybrid on)", _load_spec_hybrid, budget_bound=True, synthetic=True, needs_draft=True,
             prepare=_spec_acceptance),
    OursMode("ours-spec-synth-fixed-hybrid", "speculative decoding, synthetic acceptance, llama.cpp's depth, missed "
             "experts on the CPU (--hybrid on)", _load_spec_hybrid, budget_bound=True, synthetic=True,
             needs_draft=True, prepare=_spec_acceptance),
]}
