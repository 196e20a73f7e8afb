"""A model split into several GGUF files runs from its first file, as llama.cpp runs it, and exactly as the whole file.

Large MoE models are published split (Hugging Face keeps files under 50 GB): `<name>-00001-of-00003.gguf`, ...,
written by llama.cpp's `llama-gguf-split` or by its converter's `--split-max-tensors` / `--split-max-size`. Here the
tiny qwen2moe model is split by gguf's writer (the one the converter uses), and a tiny Hugging Face model is converted
by llama.cpp's converter with `--split-max-tensors`. Split files given out of order, missing, renamed or mixed are
refused in test_loader_errors.py.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader
from gguf_edit import rewrite

from specter_gguf.cli import cli
from specter_gguf.engine import Model
from specter_gguf.gguf_file import GGUFFile, is_routed_expert
from specter_gguf.runtime.budget import plan_memory
from specter_gguf.sampling import SamplingParams
from specter_gguf.speculation.draft_files import draft_path, resolve_draft

SPLIT_TENSORS = 10  # tensors per file: the tiny qwen2moe model's 37 in four files, layer 1's experts in two
GREEDY = SamplingParams(temperature=0)
PROMPTS = [[1, 17, 99, 4], [200, 3, 3, 3, 51, 8, 77], [5]]


@pytest.fixture(scope="module", params=[False, True], ids=["tensors-first", "metadata-first"])
def split(request, tiny_models, tmp_path_factory) -> tuple[Path, Path]:
    """(the whole tiny qwen2moe F16 file, the first of its split files); metadata-first: the first file holds the
    metadata alone (the converter's --no-tensor-first-split), the tensors are in the files after it."""
    whole = tiny_models[("qwen2moe", "f16")]
    return whole, rewrite(whole, tmp_path_factory.mktemp("split") / "tiny.gguf", split_max_tensors=SPLIT_TENSORS,
                          metadata_first=request.param)


def test_the_split_files_hold_the_whole_files_tensors(split) -> None:
    whole, first = split
    a, b = GGUFFile(whole), GGUFFile(first)
    n_files = -(-len(a.tensors) // SPLIT_TENSORS) + (not GGUFReader(first).tensors)
    assert first.name == f"tiny-00001-of-{n_files:05d}.gguf" and n_files >= 3
    assert b.paths == [first.with_name(f"tiny-{i:05d}-of-{n_files:05d}.gguf") for i in range(1, n_files + 1)]
    assert list(b.tensors) == list(a.tensors)
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert (u.type, u.shape) == (t.type, t.shape) and np.array_equal(u.data, t.data), name
    assert b.file_bytes == sum(p.stat().st_size for p in b.paths) > whole.stat().st_size
    # the metadata are the first file's; a layer's experts lie in two files, whose mappings the loader reads alike
    assert b.architecture == "qwen2moe" and b.get("split.count") == n_files
    files_of_layer: dict[str, set[int]] = {}
    for i, p in enumerate(b.paths):
        for t in GGUFReader(p).tensors:
            if is_routed_expert(t.name):
                files_of_layer.setdefault(t.name.split(".")[1], set()).add(i)
    assert any(len(files) > 1 for files in files_of_layer.values()), files_of_layer


def test_a_split_model_decodes_as_the_whole_file(split) -> None:
    whole, first = split
    models = [Model.load(p, device="cpu", progress=False) for p in (whole, first)]
    assert np.array_equal(models[0].logits(PROMPTS[1]), models[1].logits(PROMPTS[1]))
    for prompt in PROMPTS:
        want, got = (m.generate(prompt, 24, GREEDY).wait().tokens for m in models)
        assert got == want, prompt


def test_offloaded_and_speculative_from_a_split_model(split) -> None:
    """Under a budget the expert store serves each layer's experts from whichever file holds them, and a draft made
    from the split model by llama.cpp's quantizer (`draft="q4_k_m"`, which reads every file) is named after the
    model and drafts losslessly."""
    pytest.importorskip("llama_cpp")
    whole, first = split
    made = resolve_draft(first, "q4_k_m", progress=False)
    assert made == draft_path(first, "q4_k_m") and made.name == "tiny-q4_k_m.gguf"
    assert GGUFFile(made).get("split.count") is None  # one file
    # the minimum and one slot a layer more: top-k + 1 of the 8 experts a layer, so the cache evicts and misses
    plan = plan_memory(GGUFFile(first), 1 << 40, 256, "cpu", draft=GGUFFile(made))
    budget = plan.minimum + plan.n_moe_layers * plan.slot_bytes
    assert plan_memory(GGUFFile(first), budget, 256, "cpu", draft=GGUFFile(made)).n_slots < plan.n_experts_total
    plain = Model.load(whole, device="cpu", progress=False, ctx_size=256)
    spec = Model.load(first, device="cpu", progress=False, ctx_size=256, offload="lru", draft="q4_k_m", n_draft=4,
                      gpu_budget=budget)
    assert spec.draft.startswith(made.name)
    for prompt in PROMPTS:
        assert spec.generate(prompt, 32, GREEDY).wait().tokens == plain.generate(prompt, 32, GREEDY).wait().tokens


def test_a_draft_is_made_again_when_a_later_file_changes(split, tmp_path: Path) -> None:
    """The record beside a draft of a split model covers every file of it: a later file replaced (here touched)
    makes the draft again, as a changed whole file does."""
    pytest.importorskip("llama_cpp")
    _, first = split
    files = [tmp_path / p.name for p in GGUFFile(first).paths]
    for src, dst in zip(GGUFFile(first).paths, files):
        shutil.copyfile(src, dst)
    made = resolve_draft(files[0], "q8_0", progress=False)
    t = made.stat().st_mtime_ns
    assert resolve_draft(files[0], "q8_0", progress=False) == made and made.stat().st_mtime_ns == t  # kept
    later = files[-1].stat()
    os.utime(files[-1], ns=(later.st_atime_ns, later.st_mtime_ns + 10**9))
    resolve_draft(files[0], "q8_0", progress=False)
    assert made.stat().st_mtime_ns != t


def test_inspect_names_the_split(split) -> None:
    _, first = split
    result = CliRunner().invoke(cli, ["inspect", str(first)])
    assert result.exit_code == 0, result.output
    n_files = len(GGUFFile(first).paths)
    assert re.search(rf"^file +{re.escape(str(first))} \(.* in {n_files} files: a split model\)$", result.output,
                     re.M), result.output
    assert "architecture  qwen2moe" in result.output


def test_llama_cpps_converter_split_runs_as_llama_cpp_runs_it(tmp_path_factory) -> None:
    """A tiny Qwen3-MoE converted by llama.cpp's converter with `--split-max-tensors`: our greedy tokens on the split
    files equal llama.cpp's on the same files and ours on the unsplit conversion."""
    import converted_models as cm

    cm.skip_unless_present()
    from llama_reference import LlamaRefs

    converted = cm.ConvertedModels(tmp_path_factory.mktemp("converted-split"))
    hf = converted.hf_dir("qwen3moe")
    whole = cm.convert(hf, converted.root / "qwen3moe.gguf", "f16")
    first = cm.convert(hf, converted.root / "qwen3moe-split.gguf", "f16", "--split-max-tensors", "9")
    assert re.fullmatch(r"qwen3moe-split-00001-of-0000[3-9]\.gguf", first.name), first  # 27 tensors, 9 a file
    refs = LlamaRefs(128, n_threads=2)
    try:
        llm = refs[first]
        prompt = llm.tokenize(b"def main():\n    return", add_bos=False, special=False)
        expected = refs.greedy(first, prompt, 24)
    finally:
        refs.close()
    for path in (first, whole):
        m = Model.load(path, device="cpu", progress=False, ctx_size=128)
        assert m.tokenizer.encode("def main():\n    return", add_bos=False, special=False) == prompt
        assert m.generate(prompt, 24, GREEDY).wait().tokens == expected, path


def test_the_benchmark_sizes_a_split_model_by_all_its_files(split) -> None:
    """Budgets given as shares of the target (`--budgets 50%`) and llama.cpp's -ncmoe estimate count every file."""
    from specter_gguf.bench.llamacpp import ModelSizes

    whole, first = split
    sizes = ModelSizes.from_gguf(first)
    assert sizes.file_bytes == GGUFFile(first).file_bytes > whole.stat().st_size
    assert sizes.expert_bytes == ModelSizes.from_gguf(whole).expert_bytes
