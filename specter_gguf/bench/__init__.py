"""The benchmark harness: llama.cpp and our engine's modes on the same model file, prompts, generated-token count and
GPU budget. `scripts/bench.py` is the driver; everything it does lives here so that it can be tested on the CPU.

- `matrix`: GPU budgets, the systems (families and their settings) and the matrix of them that a run measures;
- `llamacpp`: llama.cpp, the system we compare with: where a GGUF's bytes go under ``-ncmoe``, llama-server
  processes, its build on the GPU machine;
- `ours`: our engine's modes (how each loads the model); `worker`: the subprocess that runs one of them;
- `runner`: running the systems one after another, each measured over the same prompts;
- `metrics`: the decodings and what is measured, summarized per system; `gpu`: the GPU and its memory in use;
- `prompts`: the prompts and their token ids; `model_files`: the random-weight target and its drafts;
- `report`: results documents and the Markdown report; `plots`: its figures; `process`: subprocess helpers.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout: scripts/, and .gpu/ on the GPU machine
