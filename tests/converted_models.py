"""Tiny random Hugging Face models of every supported architecture, converted by llama.cpp's own converter.

The synthetic writer (`specter_gguf.synthetic`) is our own reading of each architecture's GGUF layout; these
files are llama.cpp's: a `transformers` config, random weights (seeded), a tokenizer trained offline on
models/tokenizer-corpus.txt, then llama.cpp's `convert_hf_to_gguf.py` (`--outtype f16` / `bf16`), and
llama.cpp's quantizer (`specter_gguf.quantize.quantize_gguf`) for Q8_0 / Q4_K_M / Q2_K from the F16 output.

``ConvertedModels[(arch, kind)]`` is the path of a GGUF, built on first use into a session cache directory and
reused afterwards (the HF model directory of an architecture is built once, for all its kinds):

- ``arch``: a GGUF ``general.architecture`` of :data:`ARCHS` (``llama`` = Mixtral);
- ``kind``: ``f16`` / ``bf16`` (the converter's outputs) or ``q8_0`` / ``q4_k_m`` / ``q2_k`` (quantized F16).

Shapes: 2 layers, hidden 256, 8 experts of width 256, top-2, a vocabulary of 512 entries (a trained
tokenizer of 500 tokens, the rest the converter's padding). Every weight's input dimension is a multiple of
256, so the K-quant mixes really are K-quants. Mixtral and Phi-3.5-MoE get a SentencePiece tokenizer
(``tokenizer.model``, as the real models), the others a byte-level BPE (``tokenizer.json``), which the
converter cannot recognize by its hash: :data:`_CONVERT` runs the converter with its pre-tokenizer detection
answering ``gpt-2`` (the regex the trained tokenizer splits with).

What is needed: `transformers` (with `tokenizers`), `sentencepiece`, and llama.cpp's converter
(``convert_hf_to_gguf.py`` with its ``conversion/`` and ``gguf-py/`` siblings). ``scripts/setup.sh`` installs
the packages (pyproject's ``test`` extra) and extracts the converter of the installed llama-cpp-python's
sdist into ``tests/.cache/llama.cpp-<version>``; ``SPECTER_LLAMA_CPP_DIR`` may name another llama.cpp tree.
:func:`missing` says what is absent; :func:`skip_unless_present` skips a test on it (or fails it, under
CI).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from built_files import BuiltFiles

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "models" / "tokenizer-corpus.txt"
CACHE = REPO / "tests" / ".cache"
CONVERTER_ENV = "SPECTER_LLAMA_CPP_DIR"

ARCHS = ("qwen2moe", "qwen3moe", "llama", "olmoe", "deepseek2", "phimoe")
FLOAT_KINDS = ("f16", "bf16")
QUANT_KINDS = ("q8_0", "q4_k_m", "q2_k")
KINDS = FLOAT_KINDS + QUANT_KINDS
SEED = 0

N_EMBD = 256
N_VOCAB = 512  # the config's vocab_size; the trained tokenizers have TOKENIZER_SIZE tokens, the rest is padding
TOKENIZER_SIZE = 500
SPM_ARCHS = ("llama", "phimoe")  # SentencePiece tokenizers (Mixtral, Phi-3.5-MoE); the others BPE

# Initialization (as the synthetic writer's, see specter_gguf/synthetic/writer.py): matrices normal std 0.02, norms
# 1 + 0.1 * normal, biases normal std 0.02, routers so that their logits have std ~1.5, the LM head so that
# logits have std ~2 (a peaked next-token distribution, less fragile greedy decoding).
INIT_STD, NORM_NOISE, ROUTER_LOGIT_STD, LOGIT_STD = 0.02, 0.1, 1.5, 2.0

_COMMON = dict(vocab_size=N_VOCAB, hidden_size=N_EMBD, num_hidden_layers=2, num_attention_heads=4,
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

# HF class name (as config.json's `architectures` must say for the converter) and config per architecture.
HF_MODELS: dict[str, tuple[str, str, dict]] = {
    # Qwen1.5-MoE layout: q/k/v biases, shared expert with a sigmoid gate, no renormalization
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", dict(
        _COMMON, num_key_value_heads=2, intermediate_size=512, moe_intermediate_size=256,
        shared_expert_intermediate_size=512, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=2048, rope_theta=1e6,
        rms_norm_eps=1e-6, use_sliding_window=False)),
    # Qwen3-30B-A3B layout: q/k norms, renormalized top-k
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", dict(
        _COMMON, num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=256,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=2048, rope_theta=1e6, rms_norm_eps=1e-6, use_sliding_window=False)),
    "llama": ("MixtralForCausalLM", "mixtral", dict(
        _COMMON, num_key_value_heads=2, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=2048, rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None)),
    # llama.cpp's olmoe k-norm has n_embd weights: n_head_kv == n_head, as OLMoE has
    "olmoe": ("OlmoeForCausalLM", "olmoe", dict(
        _COMMON, num_key_value_heads=4, intermediate_size=256, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5)),
    # DeepSeek-V2 style: MLA with q_lora_rank (the converter needs it, or 26-27 layers), equal q/kv heads, a
    # dense first layer, one shared expert, group-limited routing, scaled weights, YaRN as V2.
    # qk_nope_head_dim 256 so that attn_k_b's input is K-quant friendly too.
    "deepseek2": ("DeepseekV2ForCausalLM", "deepseek_v2", dict(
        _COMMON, num_key_value_heads=4, intermediate_size=512, moe_intermediate_size=256, q_lora_rank=256,
        kv_lora_rank=256, qk_nope_head_dim=256, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=False,
        max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6,
        rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                          beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707))),
    # Phi-3.5-MoE layout: biases, LayerNorm, longrope (short factors while the context is <= 256)
    "phimoe": ("PhiMoEForCausalLM", "phimoe", dict(
        _COMMON, num_key_value_heads=2, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, attention_bias=True,
        lm_head_bias=True, router_jitter_noise=0.0, input_jitter_noise=0.0, sliding_window=None,
        rope_scaling=dict(type="longrope", original_max_position_embeddings=256,
                          short_factor=[1.0 + 0.02 * i for i in range(32)],
                          long_factor=[1.0 + 0.25 * i for i in range(32)],
                          short_mscale=1.243, long_mscale=1.243))),
}

# The converter with its BPE pre-tokenizer detection answering "gpt-2" (it only knows the hashes of published
# tokenizers); argv: the converter's directory, then the converter's own arguments.
_CONVERT = """
import sys
root = sys.argv[1]
sys.argv = [root + "/convert_hf_to_gguf.py"] + sys.argv[2:]
sys.path.insert(0, root)
import convert_hf_to_gguf  # puts its own gguf-py first on sys.path
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
convert_hf_to_gguf.main()
"""


def converter_dir() -> Path | None:
    """llama.cpp's tree holding convert_hf_to_gguf.py: $SPECTER_LLAMA_CPP_DIR, else the one setup.sh extracted
    for the installed llama-cpp-python (tests/.cache/llama.cpp-<version>)."""
    env = os.environ.get(CONVERTER_ENV)
    if env:
        return Path(env) if (Path(env) / "convert_hf_to_gguf.py").is_file() else None
    try:
        from importlib.metadata import version

        ver = version("llama-cpp-python")
    except Exception:
        return None
    path = CACHE / f"llama.cpp-{ver}"
    return path if (path / "convert_hf_to_gguf.py").is_file() else None


def missing() -> list[str]:
    """What building the converted models needs and this environment lacks (empty: all there)."""
    out = [f"the Python package {m!r}" for m in ("transformers", "tokenizers", "sentencepiece", "safetensors",
                                                 "llama_cpp") if importlib.util.find_spec(m) is None]
    if converter_dir() is None:
        out.append(f"llama.cpp's convert_hf_to_gguf.py (scripts/setup.sh extracts it into {CACHE}/llama.cpp-"
                   f"<llama-cpp-python version>; or set {CONVERTER_ENV})")
    return out


def skip_unless_present(module_level: bool = False) -> None:
    """Skip the calling test (its whole module with `module_level`) where `missing` names something absent; under
    CI (`$CI` set) fail instead: there these tests must run."""
    absent = missing()
    if not absent:
        return
    why = "the converted-model tests need " + "; ".join(absent) + " (run scripts/setup.sh)"
    if os.environ.get("CI"):
        pytest.fail(why + " — under CI they must run", pytrace=False)
    pytest.skip(why, allow_module_level=module_level)


# --------------------------------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------------------------------


def _corpus_lines() -> list[str]:
    return [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_bpe_tokenizer(out: Path) -> None:
    """A byte-level BPE (GPT-2 pre-tokenizer regex) of TOKENIZER_SIZE tokens trained on the corpus, saved as
    a `transformers` fast tokenizer; <|endoftext|> is bos = eos, <|im_start|> / <|im_end|> are specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_SIZE, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus_lines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[0],
                                   unk_token=None, additional_special_tokens=specials[1:])
    fast.save_pretrained(out)


def write_spm_tokenizer(out: Path) -> None:
    """A SentencePiece BPE of TOKENIZER_SIZE pieces with byte fallback (as Llama/Mixtral/Phi-3 have) trained
    on the corpus: tokenizer.model (<unk>=0, <s>=1, </s>=2) and a LlamaTokenizer's tokenizer_config.json."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus_lines()), model_writer=model, model_type="bpe",
        vocab_size=TOKENIZER_SIZE, byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, num_threads=1, shuffle_input_sentence=False, split_digits=True, add_dummy_prefix=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(model.getvalue())
    specials = {i: t for i, t in enumerate(("<unk>", "<s>", "</s>"))}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False,
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "normalized": False, "lstrip": False,
                                          "rstrip": False, "single_word": False} for i, t in specials.items()},
    }, indent=2))


# --------------------------------------------------------------------------------------------------
# HF models
# --------------------------------------------------------------------------------------------------


def _init_(name: str, p, seed: int) -> None:
    """Re-initialize one parameter in place, from a generator seeded by (seed, name): the weights do not depend
    on transformers' own initialization or on parameter order."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
    if name.endswith(".bias"):
        value = INIT_STD * noise
    elif p.ndim == 1:  # norms
        value = 1.0 + NORM_NOISE * noise
    elif name.endswith(".gate.weight") or name.endswith("shared_expert_gate.weight"):  # routers, sigmoid gate
        value = ROUTER_LOGIT_STD / N_EMBD ** 0.5 * noise
    elif name == "lm_head.weight":
        value = LOGIT_STD / N_EMBD ** 0.5 * noise
    else:
        value = INIT_STD * noise
    p.copy_(value)


def write_hf_model(arch: str, out: Path, seed: int = SEED) -> Path:
    """The tiny HF model of `arch` (config.json, model.safetensors, tokenizer files) in directory `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_arch, model_type, kwargs = HF_MODELS[arch]
    (write_spm_tokenizer if arch in SPM_ARCHS else write_bpe_tokenizer)(out)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # Phi-3.5-MoE's own config keys draw rope-validation warnings
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            _init_(name, p, seed)
    model.save_pretrained(out, safe_serialization=True)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = [hf_arch]  # phimoe: transformers' class is PhimoeForCausalLM, the converter's name not
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out


def convert(hf_dir: Path, out: Path, outtype: str, *extra: str) -> Path:
    """llama.cpp's converter on `hf_dir` -> `out` (`outtype` f16 / bf16 / f32 / q8_0; `extra`: more of its
    arguments), in a subprocess. With `--split-max-tensors N` it writes `<out stem>-00001-of-0000K.gguf`, ...:
    returns the first."""
    root = converter_dir()
    if root is None:
        raise FileNotFoundError("llama.cpp's convert_hf_to_gguf.py: " + "; ".join(missing()))
    cmd = [sys.executable, "-c", _CONVERT, str(root), str(hf_dir), "--outtype", outtype, "--outfile", str(out),
           *extra]
    # offline (no hub), and the converter's own gguf-py rather than the installed gguf
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    first = out if out.is_file() else next(iter(sorted(out.parent.glob(f"{out.stem}-00001-of-*.gguf"))), out)
    if res.returncode != 0 or not first.is_file():
        raise RuntimeError(f"llama.cpp's converter failed on {hf_dir} ({outtype}), exit {res.returncode}:\n"
                           + res.stdout[-3000:] + res.stderr[-6000:])
    return first


# --------------------------------------------------------------------------------------------------
# the cache
# --------------------------------------------------------------------------------------------------


class ConvertedModels(BuiltFiles):
    """Lazily built, cached converted models: ``[(arch, kind)] -> Path`` (files under `root`)."""

    archs = ARCHS
    kinds = KINDS

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self._hf: dict[str, Path] = {}

    def hf_dir(self, arch: str) -> Path:
        """The HF model directory of `arch` (built on first use)."""
        with self._lock:
            if arch not in self._hf:
                self._hf[arch] = write_hf_model(arch, self.root / f"hf-{arch}")
            return self._hf[arch]

    def build(self, arch: str, kind: str) -> Path:
        path = self.root / f"converted-{arch}-{kind}.gguf"
        if kind in FLOAT_KINDS:
            return convert(self.hf_dir(arch), path, kind)
        from specter_gguf.quantize import quantize_gguf

        quantize_gguf(self[(arch, "f16")], path, kind, n_threads=2)
        return path
