#!/usr/bin/env bash
# Fills the git-ignored folder .whl/ with Python 3.12 wheels the GPU machine lacks and cannot build quickly:
# llama-cpp-python (CPU build: the tokenizer, llama.cpp's quantizer and the parity reference) and diskcache.
# Run once on the development machine (the llama-cpp-python build takes ~25 minutes on 2 cores; pip's cache
# makes later runs instant), then carry [".gpu", ".whl"] and start GPU commands with:
#   source .gpu/on-device.sh && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
py312=$(python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null || ls ~/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1)
[ -n "$py312" ] || { echo "gpu_wheels: needs a python3.12 (the GPU machine's version)"; exit 1; }
ls .whl/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1 ||
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" "$py312" -m pip wheel -q --no-deps \
    --no-binary llama-cpp-python -w .whl llama-cpp-python==0.3.36
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 -d .whl diskcache==5.6.3
du -sh .whl
