#!/usr/bin/env bash
# Creates .venv and installs specter-gguf into it (editable, with test tools). Safe to run again.
# llama-cpp-python is built from source once (about 8 minutes on 2 cores); pip caches the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q -U pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on machines that have a local
# CPU build of this version (see docs); pyproject.toml itself only asks for torch>=2.4.
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}" python -m pip install -q llama-cpp-python==0.3.36
python -m pip install -q -e ".[test]"
# llama.cpp's HF-to-GGUF converter (tests/test_converted.py), from the sdist of the installed llama-cpp-python
# (pip's cache has it after a source build): convert_hf_to_gguf.py and its conversion/ and gguf-py/ siblings.
LLAMA_CPP_VERSION=$(python -c "from importlib.metadata import version; print(version('llama-cpp-python'))")
CONVERTER=tests/.cache/llama.cpp-$LLAMA_CPP_VERSION
if [ ! -f "$CONVERTER/convert_hf_to_gguf.py" ]; then
  sdist=$(mktemp -d)
  python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_VERSION" -d "$sdist"
  tar -xzf "$sdist"/llama_cpp_python-*.tar.gz -C "$sdist" --wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' \
    '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*' '*/vendor/llama.cpp/LICENSE'
  rm -rf "$CONVERTER" && mkdir -p tests/.cache && mv "$sdist"/llama_cpp_python-*/vendor/llama.cpp "$CONVERTER"
  rm -rf "$sdist"
fi
echo "installed: $(.venv/bin/specter-gguf --version)"
