"""The prompts every system is fed, and their token ids: by llama.cpp's tokenizer (llama-cpp-python) where it is
installed, else the ids stored in the prompts file for the model's vocabulary, else llama-server's /tokenize."""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from specter_gguf.bench import REPO_ROOT
from specter_gguf.bench.llamacpp import LlamaServer
from specter_gguf.errors import SpecterError
from specter_gguf.tokenizer import Tokenizer, llama_cpp_available

PROMPTS_FILE = REPO_ROOT / "scripts" / "bench_prompts.json"


@dataclass
class Prompt:
    id: str
    kind: str
    text: str
    ids: list[int] = field(default_factory=list)


def load_prompts(path: str | Path = PROMPTS_FILE, n: int | None = None) -> list[Prompt]:
    """The first `n` prompts, taken round-robin over kinds (code, math, prose, chat, code, ...) so that a
    short run still sees every kind."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    by_kind: dict[str, list[dict]] = {}
    for p in data["prompts"]:
        by_kind.setdefault(p["kind"], []).append(p)
    order: list[dict] = []
    queues = [list(v) for v in by_kind.values()]
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    if n is not None:
        if n < 1:
            raise SpecterError("--prompts must be at least 1")
        order = order[:n]
    return [Prompt(p["id"], p["kind"], p["text"]) for p in order]


def vocab_fingerprint(gguf_path: str | Path) -> str:
    """A short hash of every tokenizer.* key of a GGUF: equal fingerprints tokenize identically."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path), "r")
    h = hashlib.sha256()
    for key in sorted(k for k in reader.fields if k.startswith("tokenizer.")):
        f = reader.fields[key]
        h.update(key.encode())
        for i in f.data:
            h.update(bytes(f.parts[i]))
    return h.hexdigest()[:16]


def stored_token_ids(prompts_path: str | Path, fingerprint: str) -> dict[str, list[int]]:
    data = json.loads(Path(prompts_path).read_text(encoding="utf-8"))
    return {k: list(v) for k, v in data.get("token_ids", {}).get(fingerprint, {}).items()}


def store_token_ids(prompts_path: str | Path, vocab_gguf: str | Path) -> tuple[str, int]:
    """Tokenize every prompt with llama.cpp's tokenizer (llama-cpp-python) of `vocab_gguf` and store the ids
    in the prompts file under the vocab's fingerprint. Returns (fingerprint, prompts stored)."""
    tok = Tokenizer.from_gguf(vocab_gguf)
    path = Path(prompts_path)
    data = json.loads(path.read_text(encoding="utf-8"))
    fp = vocab_fingerprint(vocab_gguf)
    data.setdefault("token_ids", {})[fp] = {p["id"]: tok.encode(p["text"]) for p in data["prompts"]}
    path.write_text(_compact_json(data), encoding="utf-8")  # one prompt per line keeps it readable
    return fp, len(data["prompts"])


def _compact_json(data: dict) -> str:
    lines = ["{"]
    lines.append(f' "description": {json.dumps(data["description"], ensure_ascii=False)},')
    lines.append(' "prompts": [')
    lines.append(",\n".join("  " + json.dumps(p, ensure_ascii=False) for p in data["prompts"]))
    lines.append(" ],")
    lines.append(' "token_ids": {')
    blocks = []
    for fp, ids in data.get("token_ids", {}).items():
        inner = ",\n".join(f"   {json.dumps(k)}: {json.dumps(v)}" for k, v in ids.items())
        blocks.append(f"  {json.dumps(fp)}: {{\n{inner}\n  }}")
    lines.append(",\n".join(blocks))
    lines.append(" }")
    lines.append("}")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def server_tokenizer(llama_bin: Path | None, model: str | Path, log_path: Path) -> Iterator[Callable[[str], list[int]]]:
    """A tokenize function backed by a llama-server on `model` (CPU only, started on first use)."""
    holder: dict[str, LlamaServer] = {}

    def tok(text: str) -> list[int]:
        if llama_bin is None:
            raise SpecterError("no llama-server to tokenize with")
        if "srv" not in holder:
            srv = LlamaServer(llama_bin / "llama-server", ["-m", str(model), "-ngl", "0", "--fit", "off",
                                                           "--no-warmup", "-c", "512", "-np", "1"], log_path)
            holder["srv"] = srv.__enter__()
        return holder["srv"].tokenize(text)

    try:
        yield tok
    finally:
        if "srv" in holder:
            holder["srv"].stop()


def tokenize_prompts(prompts: list[Prompt], model_path: str | Path, prompts_path: str | Path = PROMPTS_FILE,
                     server_tokenize: Callable[[str], list[int]] | None = None) -> str:
    """Fill `Prompt.ids` for `model_path`'s vocabulary: with llama-cpp-python where importable, else from the
    ids stored in the prompts file for this vocabulary, else with `server_tokenize` (llama-server's
    /tokenize). Returns how it was done."""
    if llama_cpp_available():
        tok = Tokenizer.from_gguf(model_path)
        for p in prompts:
            p.ids = tok.encode(p.text)
        return "llama-cpp-python"
    stored = stored_token_ids(prompts_path, vocab_fingerprint(model_path))
    if all(p.id in stored for p in prompts):
        for p in prompts:
            p.ids = stored[p.id]
        return "stored ids"
    if server_tokenize is None:
        raise SpecterError("cannot tokenize the prompts: llama-cpp-python is not installed, the prompts file "
                           "holds no ids for this vocabulary, and no llama-server is available")
    for p in prompts:
        p.ids = server_tokenize(p.text)
    return "llama-server /tokenize"
