"""Synthetic models: llama.cpp's exact layout and metadata, deterministic weights, loadable by llama.cpp,
and quantized copies that really use the requested (K-)quant types."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from specter_gguf.errors import SpecterError  # noqa: E402
from specter_gguf.quantize import FTYPES, ftype_for, quantize_gguf, quantized_path  # noqa: E402
from specter_gguf.synthetic import writer  # noqa: E402
from specter_gguf.synthetic.architectures import tensor_specs  # noqa: E402
from specter_gguf.synthetic.bpe import SPECIAL_TOKENS, bytes_to_unicode, tiny_tokenizer, train_bpe  # noqa: E402
from specter_gguf.synthetic.shapes import PRESETS, TINY_ARCH_PRESETS, TINY_PRESETS, get_preset  # noqa: E402
from specter_gguf.synthetic.writer import write_synthetic  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ARCHS = list(TINY_ARCH_PRESETS)
GT = gguf.GGMLQuantizationType
TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # square\n\n\tindent",
    "café naïve 日本語 😀👍🏽 Ελλάδα",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|><|endoftext|>",
    "   leading and trailing   ",
]


def _fields(r) -> dict:
    return {k: f.contents() for k, f in r.fields.items()}


def _tensors(r) -> dict:
    return {t.name: t for t in r.tensors}


def _llama_cpp():
    return pytest.importorskip("llama_cpp")


# ---------------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("preset", [*TINY_PRESETS, "tiny-qwen3moe-hd128"])
def test_tiny_presets_are_k_quant_friendly(preset):
    shape = PRESETS[preset]
    for spec in tensor_specs(shape, n_vocab=1000):
        if len(spec.ne) >= 2:
            assert spec.ne[0] % 256 == 0, spec


def test_real_presets_match_published_sizes():
    # parameter counts with the models' own vocab sizes (HF model cards / DESIGN.md)
    expect = {"qwen1.5-moe-a2.7b": 14.3e9, "qwen3-30b-a3b": 30.5e9, "mixtral-8x7b": 46.7e9,
              "olmoe-1b-7b": 6.9e9}
    for name, n in expect.items():
        shape = PRESETS[name]
        total = sum(s.n_elements for s in tensor_specs(shape, shape.n_vocab_hint))
        assert abs(total - n) / n < 0.02, (name, total)
    assert PRESETS["qwen3-30b-a3b"].n_layer == 48
    assert PRESETS["mixtral-8x7b"].n_layer == 32


@pytest.mark.parametrize("preset", [p for p in PRESETS if p.startswith("tiny-")])
def test_model_config_reads_back_the_shape(tmp_path, preset):
    """A `ModelShape` is what the writer writes and a `ModelConfig` what the engine reads: the fields both describe
    agree (MLA files keep one latent KV head of width kv_lora_rank + qk_rope_dim, as llama.cpp reads them)."""
    from specter_gguf.config import ModelConfig
    from specter_gguf.gguf_file import GGUFFile

    s = PRESETS[preset].with_layers(2)
    c = ModelConfig.from_gguf(GGUFFile(write_synthetic(tmp_path / "m.gguf", s, "f16").path))
    assert (c.arch, c.n_layer, c.n_embd, c.n_head, c.n_ctx_train) == (s.arch, s.n_layer, s.n_embd, s.n_head, s.n_ctx)
    assert (c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_leading_dense) == (
        s.n_expert, s.n_expert_used, s.n_ff_exp, s.n_leading_dense)
    assert c.rms_eps == pytest.approx(s.rms_eps) and c.rope_base == pytest.approx(s.rope_theta)
    assert c.n_expert_shared == (s.n_expert_shared or int(s.n_ff_shexp > 0))
    if s.arch == "deepseek2" and not s.mla_legacy:
        assert (c.n_head_kv, c.head_dim, c.n_lora_kv) == (1, s.kv_lora_rank + s.qk_rope_dim, s.kv_lora_rank)
    else:
        assert (c.n_head_kv, c.head_dim) == (s.n_head_kv if s.arch != "deepseek2" else s.n_head, s.head_dim)


def test_unknown_preset_and_dtype(tmp_path):
    with pytest.raises(SpecterError, match="tiny-qwen2moe"):
        get_preset("nope")
    with pytest.raises(SpecterError, match="bf16"):
        write_synthetic(tmp_path / "x.gguf", "tiny-mixtral", "q4_0")


# ------------------------------------------------------------------------------------ file contents

# Shapes in ggml order, written out by hand from llama.cpp's src/models/<arch>.cpp for the tiny presets
# (n_embd 256, head_dim 64, 4 heads, n_ff_exp 256, 8 experts) — independent of tensor_specs().
EXPECTED_BLK0 = {
    "qwen2moe": {
        "attn_q.weight": (256, 256), "attn_k.weight": (256, 128), "attn_v.weight": (256, 128),
        "attn_q.bias": (256,), "attn_k.bias": (128,), "attn_v.bias": (128,),
        "attn_output.weight": (256, 256), "attn_norm.weight": (256,), "ffn_norm.weight": (256,),
        "ffn_gate_inp.weight": (256, 8), "ffn_gate_exps.weight": (256, 256, 8),
        "ffn_up_exps.weight": (256, 256, 8), "ffn_down_exps.weight": (256, 256, 8),
        "ffn_gate_inp_shexp.weight": (256,), "ffn_gate_shexp.weight": (256, 512),
        "ffn_up_shexp.weight": (256, 512), "ffn_down_shexp.weight": (512, 256),
    },
    "qwen3moe": {
        "attn_q.weight": (256, 256), "attn_k.weight": (256, 128), "attn_v.weight": (256, 128),
        "attn_output.weight": (256, 256), "attn_q_norm.weight": (64,), "attn_k_norm.weight": (64,),
        "attn_norm.weight": (256,), "ffn_norm.weight": (256,), "ffn_gate_inp.weight": (256, 8),
        "ffn_gate_exps.weight": (256, 256, 8), "ffn_up_exps.weight": (256, 256, 8),
        "ffn_down_exps.weight": (256, 256, 8),
    },
    "llama": {
        "attn_q.weight": (256, 256), "attn_k.weight": (256, 128), "attn_v.weight": (256, 128),
        "attn_output.weight": (256, 256), "attn_norm.weight": (256,), "ffn_norm.weight": (256,),
        "ffn_gate_inp.weight": (256, 8), "ffn_gate_exps.weight": (256, 256, 8),
        "ffn_up_exps.weight": (256, 256, 8), "ffn_down_exps.weight": (256, 256, 8),
    },
    "olmoe": {
        "attn_q.weight": (256, 256), "attn_k.weight": (256, 256), "attn_v.weight": (256, 256),
        "attn_output.weight": (256, 256), "attn_q_norm.weight": (256,), "attn_k_norm.weight": (256,),
        "attn_norm.weight": (256,), "ffn_norm.weight": (256,), "ffn_gate_inp.weight": (256, 8),
        "ffn_gate_exps.weight": (256, 256, 8), "ffn_up_exps.weight": (256, 256, 8),
        "ffn_down_exps.weight": (256, 256, 8),
    },
}

EXPECTED_KV = {
    "qwen2moe": {"expert_count": 8, "expert_used_count": 4, "expert_feed_forward_length": 256,
                 "expert_shared_feed_forward_length": 512, "block_count": 2},
    "qwen3moe": {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 256,
                 "attention.key_length": 64, "attention.value_length": 64, "block_count": 3},
    "llama": {"expert_count": 8, "expert_used_count": 2, "feed_forward_length": 256,
              "rope.dimension_count": 64, "block_count": 2},
    "olmoe": {"expert_count": 8, "expert_used_count": 2, "feed_forward_length": 256,
              "attention.head_count_kv": 4, "block_count": 2},
}


@pytest.mark.parametrize("kind", ["f32", "f16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_written_layout_types_and_metadata(tiny_models, arch, kind):
    r = gguf.GGUFReader(tiny_models[(arch, kind)])
    f = _fields(r)
    t = _tensors(r)
    shape = PRESETS[TINY_ARCH_PRESETS[arch]]
    n_vocab = len(f["tokenizer.ggml.tokens"])

    assert f["general.architecture"] == arch
    assert f["general.file_type"] == (0 if kind == "f32" else 1)
    for k, v in EXPECTED_KV[arch].items():
        assert f[f"{arch}.{k}"] == v, k
    assert f[f"{arch}.embedding_length"] == 256
    assert f[f"{arch}.attention.head_count"] == 4
    assert f[f"{arch}.vocab_size"] == n_vocab
    assert math.isclose(f[f"{arch}.rope.freq_base"], shape.rope_theta, rel_tol=1e-6)
    assert math.isclose(f[f"{arch}.attention.layer_norm_rms_epsilon"], shape.rms_eps, rel_tol=1e-5)

    # exactly the expected tensors: globals + per-block set
    expected = {"token_embd.weight": (256, n_vocab), "output.weight": (256, n_vocab),
                "output_norm.weight": (256,)}
    for i in range(shape.n_layer):
        expected.update({f"blk.{i}.{k}": v for k, v in EXPECTED_BLK0[arch].items()})
    assert {n: tuple(int(x) for x in ti.shape) for n, ti in t.items()} == expected

    mat = GT.F32 if kind == "f32" else GT.F16
    for name, ti in t.items():
        is_f32 = len(ti.shape) == 1 or "ffn_gate_inp." in name
        assert ti.tensor_type == (GT.F32 if is_f32 else mat), name
        assert np.isfinite(np.asarray(ti.data, dtype=np.float32)).all(), name


def test_bf16_file_is_rounded_f32(tmp_path, tiny_models):
    p = write_synthetic(tmp_path / "m-bf16.gguf", "tiny-mixtral", "bf16", seed=0).path
    t16 = _tensors(gguf.GGUFReader(p))
    t32 = _tensors(gguf.GGUFReader(tiny_models[("llama", "f32")]))
    assert gguf.GGUFReader(p).fields["general.file_type"].contents() == 32
    ti = t16["blk.1.ffn_up_exps.weight"]
    assert ti.tensor_type == GT.BF16
    got = gguf.quants.dequantize(ti.data, GT.BF16).reshape(-1)
    ref = np.asarray(t32["blk.1.ffn_up_exps.weight"].data).reshape(-1)
    assert np.allclose(got, ref, rtol=2 ** -8, atol=0)
    assert t16["blk.1.ffn_gate_inp.weight"].tensor_type == GT.F32


def test_f16_file_is_rounded_f32(tiny_models):
    t16 = _tensors(gguf.GGUFReader(tiny_models[("qwen2moe", "f16")]))
    t32 = _tensors(gguf.GGUFReader(tiny_models[("qwen2moe", "f32")]))
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down_exps.weight"):
        a = np.asarray(t16[name].data)
        assert a.dtype == np.float16
        np.testing.assert_array_equal(a, np.asarray(t32[name].data).astype(np.float16))
    for name in ("blk.0.attn_q.bias", "blk.0.ffn_gate_inp.weight", "blk.0.ffn_norm.weight"):
        np.testing.assert_array_equal(np.asarray(t16[name].data), np.asarray(t32[name].data))


def test_init_statistics(tiny_models):
    t = _tensors(gguf.GGUFReader(tiny_models[("qwen3moe", "f32")]))
    shape = PRESETS["tiny-qwen3moe"]
    exps = np.asarray(t["blk.0.ffn_gate_exps.weight"].data)
    assert abs(exps.std() - shape.init_std) < 0.001 and abs(exps.mean()) < 0.001
    norm = np.asarray(t["blk.2.ffn_norm.weight"].data)
    assert abs(norm.mean() - 1) < 0.03 and abs(norm.std() - shape.norm_noise) < 0.02
    router = np.asarray(t["blk.0.ffn_gate_inp.weight"].data)
    assert abs(router.std() * math.sqrt(256) - shape.router_logit_std) < 0.1
    out = np.asarray(t["output.weight"].data)
    assert abs(out.std() * math.sqrt(256) - shape.logit_std) < 0.1
    # every expert differs from the others
    e = exps.reshape(8, -1)
    assert len({hashlib.sha1(x.tobytes()).hexdigest() for x in e}) == 8


def test_deterministic_and_layer_override(tmp_path):
    a = write_synthetic(tmp_path / "a.gguf", "tiny-olmoe", "f16", seed=3).path
    b = write_synthetic(tmp_path / "b.gguf", "tiny-olmoe", "f16", seed=3).path
    c = write_synthetic(tmp_path / "c.gguf", "tiny-olmoe", "f16", seed=4).path
    d = write_synthetic(tmp_path / "d.gguf", PRESETS["tiny-olmoe"].with_layers(1), "f16", seed=3).path
    assert a.read_bytes() == b.read_bytes()
    ta, tc, td = (_tensors(gguf.GGUFReader(p)) for p in (a, c, d))
    name = "blk.0.ffn_down_exps.weight"
    assert not np.array_equal(ta[name].data, tc[name].data)
    np.testing.assert_array_equal(ta[name].data, td[name].data)  # shared layers do not move
    assert "blk.1.attn_q.weight" not in td
    assert gguf.GGUFReader(d).fields["olmoe.block_count"].contents() == 1


def test_attn_output_scale_spreads_the_routing(tmp_path):
    """--attn-output-scale scales attention's output weights and nothing else, and at 0.1 consecutive tokens share
    about as many experts as chance gives (top-2 of 8: 0.5 a layer), where at 1 they share far more: the router's
    input then follows the token rather than attention's average over the context."""
    from specter_gguf.bench.cache_replay import RoutingRecorder
    from specter_gguf.engine import Model
    from specter_gguf.sampling import SamplingParams
    from specter_gguf.tokenizer import IdsOnlyTokenizer

    shape = PRESETS["tiny-qwen3moe"]
    chance = shape.n_expert_used ** 2 / shape.n_expert
    files = {scale: write_synthetic(tmp_path / f"s{scale}.gguf", dataclasses.replace(shape, attn_output_scale=scale),
                                    "f32").path for scale in (1.0, 0.1)}
    plain, scaled = (_tensors(gguf.GGUFReader(files[s])) for s in (1.0, 0.1))
    for name, t in plain.items():
        if name.endswith(".attn_output.weight"):
            np.testing.assert_allclose(np.asarray(scaled[name].data), 0.1 * np.asarray(t.data), rtol=1e-5)
        else:
            np.testing.assert_array_equal(np.asarray(scaled[name].data), np.asarray(t.data), err_msg=name)
    shared = {}
    for scale, path in files.items():
        model = Model.load(path, device="cpu", progress=False, tokenizer=IdsOnlyTokenizer())
        model.routing_observer = recorder = RoutingRecorder()
        for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)):
            model.generate(list(range(40, 64)), 48, sampling, ignore_eos=True).wait()
            steps = recorder.take()[1:]  # the decode steps (the prompt's forward left out)
            pairs = [len(a[layer] & b[layer]) for a, b in zip(steps, steps[1:]) for layer in a]
            shared[scale, sampling.temperature] = sum(pairs) / len(pairs)
    for temperature in (0.0, 1.0):
        assert shared[0.1, temperature] < 0.7 * shared[1.0, temperature], shared
        assert shared[0.1, temperature] < 1.5 * chance, shared


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    """A write that fails part way (here the disk filling up) is one error naming the file and the cause, and leaves
    neither the model nor its temporary file behind; a bad device or vocab file is refused before writing."""
    slabs = writer._slabs

    def full_disk(*args, **kwargs):
        yield from itertools.islice(slabs(*args, **kwargs), 1)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "_slabs", full_disk)
    with pytest.raises(SpecterError, match="writing .*m.gguf: No space left on device"):
        write_synthetic(tmp_path / "m.gguf", "tiny-qwen3moe", "f16")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept.gguf").write_bytes(b"an earlier model")  # a failed rewrite leaves it as it was
    with pytest.raises(SpecterError, match="No space left on device"):
        write_synthetic(tmp_path / "kept.gguf", "tiny-qwen3moe", "f16")
    assert (tmp_path / "kept.gguf").read_bytes() == b"an earlier model" and len(list(tmp_path.iterdir())) == 1
    monkeypatch.setattr(writer, "_slabs", slabs)
    with pytest.raises(SpecterError, match="is a folder"):
        write_synthetic(tmp_path, "tiny-qwen3moe", "f16")
    with pytest.raises(SpecterError, match="vocab GGUF .* is a folder"):
        write_synthetic(tmp_path / "m.gguf", "tiny-qwen3moe", "f16", vocab_from=tmp_path)
    (tmp_path / "kept.gguf").unlink()
    with pytest.raises(SpecterError, match="unknown device 'cpux'"):
        write_synthetic(tmp_path / "m.gguf", "tiny-qwen3moe", "f16", device="cpux")
    (tmp_path / "v.gguf").write_text("not a gguf")
    with pytest.raises(SpecterError, match="is not a readable GGUF file"):
        write_synthetic(tmp_path / "m.gguf", "tiny-qwen3moe", "f16", vocab_from=tmp_path / "v.gguf")
    with pytest.raises(SpecterError, match="must be from 0.01 to 10"):
        write_synthetic(tmp_path / "m.gguf", dataclasses.replace(PRESETS["tiny-qwen3moe"], attn_output_scale=1e6))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.gguf"]


def test_bounded_streaming_of_large_tensors(tmp_path, monkeypatch):
    # force many slabs per tensor; the file must still be a valid, complete GGUF with the same shapes
    monkeypatch.setattr(writer, "_SLAB_ELEMS", 1000)
    p = write_synthetic(tmp_path / "s.gguf", "tiny-mixtral", "f16", progress=True).path
    t = _tensors(gguf.GGUFReader(p))
    assert tuple(t["blk.0.ffn_up_exps.weight"].shape) == (256, 256, 8)
    assert np.isfinite(np.asarray(t["output.weight"].data, np.float32)).all()


# ------------------------------------------------------------------------------------------ tokenizer


def test_bpe_trainer_properties():
    tok = tiny_tokenizer()
    assert 900 <= len(tok.tokens) <= 1024
    assert len(set(tok.tokens)) == len(tok.tokens)
    assert set(bytes_to_unicode().values()) <= set(tok.tokens[:256])
    vocab = set(tok.tokens)
    for m in tok.merges:
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab
    assert tok.tokens[-3:] == SPECIAL_TOKENS
    assert train_bpe("ab ab ab", vocab_size=300) == train_bpe("ab ab ab", vocab_size=300)


def test_vocab_only_roundtrip(tiny_models):
    llama_cpp = _llama_cpp()
    for arch in ARCHS:
        m = llama_cpp.Llama(str(tiny_models[(arch, "f16")]), vocab_only=True, verbose=False)
        eos = m.token_eos()
        assert m.detokenize([eos], special=True) == b"<|endoftext|>"
        assert m.token_bos() == eos
        for text in TEXTS:
            ids = m.tokenize(text.encode(), add_bos=True, special=True)  # add_bos_token is false
            assert ids and ids[0] != eos or text.startswith("<|endoftext|>")
            assert m.detokenize(ids, special=True).decode() == text
        ids = m.tokenize(b"<|im_start|>user", add_bos=False, special=True)
        assert m.detokenize(ids[:1], special=True) == b"<|im_start|>"
        # the BPE merges are used: common words are few tokens
        assert len(m.tokenize(b" the and to", add_bos=False)) == 3
        assert "<|im_start|>" in m.metadata["tokenizer.chat_template"]
        del m


def test_vocab_from_copies_all_tokenizer_keys(tmp_path, tiny_models):
    src = tiny_models[("qwen2moe", "f16")]
    p = write_synthetic(tmp_path / "v.gguf", PRESETS["tiny-mixtral"].with_layers(1), "f16",
                            vocab_from=src).path
    fa, fb = _fields(gguf.GGUFReader(src)), _fields(gguf.GGUFReader(p))
    keys = [k for k in fa if k.startswith("tokenizer.")]
    assert keys and all(fa[k] == fb[k] for k in keys)
    with pytest.raises(SpecterError, match="not found"):
        write_synthetic(tmp_path / "w.gguf", "tiny-mixtral", vocab_from=tmp_path / "missing.gguf")


def test_vocab_from_llama_cpp_vocab(tmp_path):
    vocab_dir = os.environ.get("LLAMA_CPP_VOCAB_DIR")
    if not vocab_dir or not (Path(vocab_dir) / "ggml-vocab-gpt-2.gguf").is_file():
        pytest.skip("set LLAMA_CPP_VOCAB_DIR to llama.cpp's models/ folder")
    llama_cpp = _llama_cpp()
    shape = PRESETS["tiny-qwen3moe"].with_layers(1)
    r = write_synthetic(tmp_path / "g.gguf", shape, "f16", vocab_from=Path(vocab_dir) / "ggml-vocab-gpt-2.gguf")
    assert r.n_vocab == 50257
    m = llama_cpp.Llama(str(r.path), n_ctx=32, verbose=False)
    toks = m.tokenize(b"Hello world", add_bos=False)
    m.eval(toks)
    assert m.n_vocab() == 50257 and np.isfinite(np.asarray(m.scores[: len(toks)])).all()


# ---------------------------------------------------------------------------------- llama.cpp loads


@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0", "q4_k_m", "q2_k"])
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_evaluates(tiny_models, arch, kind):
    llama_cpp = _llama_cpp()
    m = llama_cpp.Llama(str(tiny_models[(arch, kind)]), logits_all=True, n_ctx=64, n_threads=2, verbose=False)
    toks = m.tokenize(TEXTS[0].encode(), add_bos=False)
    m.eval(toks)
    logits = np.asarray(m.scores[: len(toks)])
    assert logits.shape == (len(toks), m.n_vocab())
    assert np.isfinite(logits).all()
    assert 0.5 < logits.std(axis=1).min() and logits.std(axis=1).max() < 5  # logit_std ~2
    assert len(set(logits.argmax(axis=1).tolist())) > 1  # not a constant prediction
    del m


def test_llama_cpp_evaluates_key_length_preset(tmp_path):
    llama_cpp = _llama_cpp()
    p = write_synthetic(tmp_path / "hd.gguf", "tiny-qwen3moe-hd128", "f16").path
    f = _fields(gguf.GGUFReader(p))
    assert f["qwen3moe.attention.key_length"] == 128
    m = llama_cpp.Llama(str(p), n_ctx=32, verbose=False)
    m.eval(m.tokenize(b"Hello world", add_bos=False))
    del m


def test_quantized_copies_use_the_requested_types(tiny_models):
    _llama_cpp()
    fallback = {GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1}
    for arch in ARCHS:
        for kind, main in (("q8_0", GT.Q8_0), ("q4_k_m", GT.Q4_K), ("q2_k", GT.Q2_K)):
            r = gguf.GGUFReader(tiny_models[(arch, kind)])
            t = _tensors(r)
            assert r.fields["general.file_type"].contents() == FTYPES[kind]
            for i in range(PRESETS[TINY_ARCH_PRESETS[arch]].n_layer):
                for w in ("ffn_gate_exps", "ffn_up_exps"):
                    assert t[f"blk.{i}.{w}.weight"].tensor_type == main, (arch, kind, i, w)
                assert t[f"blk.{i}.ffn_gate_inp.weight"].tensor_type == GT.F32
                assert t[f"blk.{i}.ffn_norm.weight"].tensor_type == GT.F32
            types = Counter(ti.tensor_type for ti in t.values())
            assert not (set(types) & fallback), (arch, kind, types)
            assert types[main] >= 2 * 2
            if kind == "q8_0":
                assert set(types) == {GT.Q8_0, GT.F32}


def test_quantize_errors(tmp_path, tiny_models):
    with pytest.raises(SpecterError, match="valid types: .*q4_k_m"):
        quantize_gguf(tiny_models[("llama", "f16")], tmp_path / "x.gguf", "q9_z")
    with pytest.raises(SpecterError, match="not found"):
        quantize_gguf(tmp_path / "missing.gguf", tmp_path / "x.gguf", "q8_0")
    _llama_cpp()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(SpecterError, match="bad.gguf: GGUF version 0 is not supported"):  # our reader, first
        quantize_gguf(bad, tmp_path / "y.gguf", "q8_0")
    foreign = tmp_path / "foreign.gguf"  # a file we read that llama.cpp refuses: its failure, and no output left
    w = gguf.GGUFWriter(foreign, "no-such-arch")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((256, 256), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SpecterError, match="llama.cpp failed to quantize .*foreign.gguf to q8_0"):
        quantize_gguf(foreign, tmp_path / "y.gguf", "q8_0")
    assert not (tmp_path / "y.gguf").exists()


def test_ftype_names_and_paths():
    assert ftype_for("Q4_K_M") == 15 and ftype_for("q2_k") == 10 and ftype_for("q8_0") == 7
    assert ftype_for("bf16") == 32 and ftype_for("q6_k") == 18 and ftype_for("q3_k_m") == 12
    assert quantized_path("/a/tiny-f16.gguf", "Q4_K_M") == Path("/a/tiny-q4_k_m.gguf")
    assert quantized_path("/a/model.gguf", "q2_k") == Path("/a/model-q2_k.gguf")


# ------------------------------------------------------------------------------ script, shipped model


def test_make_synthetic_script(tmp_path):
    _llama_cpp()
    out = tmp_path / "m-f16.gguf"
    cmd = [sys.executable, str(REPO / "scripts/make_synthetic.py"), "--preset", "tiny-qwen3moe", "--layers", "1",
           "--dtype", "f16", "--seed", "1", "--quantize", "q8_0", "--no-progress", "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "wrote" in res.stdout and (tmp_path / "m-q8_0.gguf").is_file()
    assert gguf.GGUFReader(out).fields["qwen3moe.block_count"].contents() == 1
    bad = subprocess.run([*cmd[:-1], str(tmp_path / "z.gguf"), "--quantize", "q9"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown --quantize" in bad.stderr


PRESET_SHA256 = "9616ff8141f317299d7af4b321456d01c51fd927fd77e02465def358fa9e75cf"
"""models/README.md's recipe (the tiny-qwen2moe preset, F16, seed 0), recorded 2026-12-01: the bytes of the
random-weight model that shipped until the trained one replaced it."""
SHIPPED_SHA256 = "06169b605b2afa8f5e28549d02650b6feb8452fb7221e8f4ab321384c569c71c"
"""models/tiny-qwen2moe.gguf: the trained model (docs/TINY_MODEL.md), also recorded in models/README.md."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_tiny_qwen2moe_preset_writes_the_recorded_bytes(tmp_path):
    assert "scripts/make_synthetic.py --preset tiny-qwen2moe --dtype f16 --seed 0" in (
        REPO / "models/README.md").read_text()
    r = write_synthetic(tmp_path / "again.gguf", "tiny-qwen2moe", "f16", seed=0)
    assert _sha256(r.path) == PRESET_SHA256, (
        "the synthetic writer no longer writes the recorded bytes: if that is meant, record the new sha256 here")


def test_the_shipped_model_is_the_trained_one(shipped_model):
    assert shipped_model.stat().st_size <= 20 * 10**6
    assert _sha256(shipped_model) == SHIPPED_SHA256, (
        "models/tiny-qwen2moe.gguf is not the trained model: if it was replaced on purpose, record its sha256 here "
        "and in models/README.md")
    assert SHIPPED_SHA256 in (REPO / "models/README.md").read_text()
    f = _fields(gguf.GGUFReader(shipped_model))
    assert f["general.architecture"] == "qwen2moe" and f["qwen2moe.block_count"] == 4
    assert f["qwen2moe.context_length"] == 512 and len(f["tokenizer.ggml.tokens"]) == 3072
    assert (f["qwen2moe.expert_count"], f["qwen2moe.expert_used_count"]) == (8, 2)
    assert "<|im_start|>" in f["tokenizer.chat_template"]
