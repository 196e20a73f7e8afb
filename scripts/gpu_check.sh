#!/usr/bin/env bash
# One device run for the GPU code (on the GPU machine, repo root, after `source .gpu/on-device.sh`; carry .whl
# from scripts/gpu_wheels.sh too): build libspecter with CUDA (sm_90) into build/, run the GPU tests (kernels,
# CUDA engine vs CPU engine, CUDA graphs, offloading, the memory plan, hybrid CPU experts, fallback types), run the
# kernel benchmark.
# With --decode also the whole-model decode comparison: scripts/bench.py --prepare-only makes the harness's
# Qwen1.5-MoE-shaped F16 target and its Q4_K_M copy (building llama.cpp's tools meanwhile, in the background),
# then scripts/bench_kernels.py --only decode runs our engine and llama-bench on the Q4_K_M file.
# Logs and bench_kernels.json go under $OUT; a short summary and the benchmark tables are printed last.
#   bash scripts/gpu_check.sh [--decode] [--no-kernel-bench]
set -uo pipefail
cd "$(dirname "$0")/.."
decode=0 kernel_bench=1
for a in "$@"; do
  case $a in
    --decode) decode=1 ;;
    --no-kernel-bench) kernel_bench=0 ;;
    *) echo "gpu_check: unknown option $a"; exit 2 ;;
  esac
done
OUT=${OUT:-/tmp/specter-gpu-check}
mkdir -p "$OUT"
if [ -f .gpu/on-device.sh ] && ! python3 -c "import gguf, cffi" 2>/dev/null; then
  source .gpu/on-device.sh || { echo "gpu_check: sourcing .gpu/on-device.sh failed"; exit 1; }
fi
# llama-cpp-python (tokenizer, quantizer) from scripts/gpu_wheels.sh, when carried: the tests that make
# quantized files need it
if [ -d .whl ] && ! python3 -c "import llama_cpp" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
work=/tmp/specter-bench
if [ $decode -eq 1 ]; then
  python3 scripts/bench.py --model-preset qwen1.5-moe-a2.7b --prepare-only --work-dir $work --out "$OUT/prepare" \
    > "$OUT/prepare.log" 2>&1 &
  prepare=$!
fi

t0=$(date +%s)
# a plain CMake build into build/ (where specter_gguf/native.py looks after the package folder): the device image of
# 2026-12-02 had no scikit-build-core for pip's editable install
if ! { cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DSPECTER_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 &&
       cmake --build build; } > "$OUT/build.log" 2>&1; then
  echo "gpu_check: build failed (log: $OUT/build.log)"; tail -60 "$OUT/build.log"; exit 1
fi
t1=$(date +%s)
python3 -c "from specter_gguf import native; print('libspecter', native.version(), 'has_cuda', native.has_cuda(), 'devices', native.cuda_device_count())" \
  > "$OUT/native.txt" 2>&1

python3 -m pytest -q -rs tests/test_kernels.py tests/test_layer_ops.py tests/test_engine_gpu.py tests/test_cuda_graphs.py \
  tests/test_offload_gpu.py tests/test_memory_gpu.py tests/test_hybrid.py tests/test_fallback_types.py \
  > "$OUT/test_kernels.log" 2>&1
test_rc=$?
t2=$(date +%s)
bench_rc=0
: > "$OUT/bench.log"
if [ $kernel_bench -eq 1 ]; then
  timeout 400 python3 scripts/bench_kernels.py --only kernels --out "$OUT" > "$OUT/bench.log" 2>&1 || bench_rc=$?
fi
if [ $decode -eq 1 ]; then
  wait $prepare || { bench_rc=1; echo "gpu_check: preparing the decode model failed" >> "$OUT/bench.log"; tail -20 "$OUT/prepare.log" >> "$OUT/bench.log"; }
  [ $bench_rc -eq 0 ] && { timeout 300 python3 scripts/bench_kernels.py --only decode --out "$OUT/decode" \
    --decode-model $work/qwen1.5-moe-a2.7b-q4_k_m.gguf --llama-bin /tmp/llama/build/bin >> "$OUT/bench.log" 2>&1 || bench_rc=$?; }
fi
t3=$(date +%s)

echo "== gpu: $(cat "$OUT/gpu.txt")"
echo "== native: $(cat "$OUT/native.txt")"
echo "== build $((t1 - t0)) s, tests $((t2 - t1)) s (rc $test_rc), bench $((t3 - t2)) s (rc $bench_rc)"
echo "== GPU tests:"
grep -E "^(FAILED|ERROR)|passed|failed|skipped|error" "$OUT/test_kernels.log" | tail -25
if [ $test_rc -ne 0 ]; then
  grep -E "^E  |assert|Error" "$OUT/test_kernels.log" | head -40
fi
echo "== bench_kernels.py:"
tail -45 "$OUT/bench.log"
exit $(( test_rc != 0 || bench_rc != 0 ))
