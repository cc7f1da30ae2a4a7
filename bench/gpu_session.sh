#!/usr/bin/env bash
# One lease of the workplace's GPU machine, in one call: bench/gpu_check.py (the CUDA decode
# path against the CPU, then its speed on a Llama-3-8B shape), the CPU kernels' build with
# that machine's torch and compiler, then the tests that touch the engine, against real
# `mashbox run` servers on the GPU ("auto" picks CUDA).
#
# That machine's python3 holds CUDA torch but reaches no registry, so the packages mashbox
# and its tests need that it lacks travel as cp312 wheels in .whl (ignored by git). Here,
# once, in the repo root:
#     echo /.whl/ >> .git/info/exclude
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
#         --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         -d .whl -r bench/gpu_wheels.txt
# Then the device tool's run, carry [".whl"], timeout_s 540:  bash bench/gpu_session.sh
# (~5 minutes there before gpu_check timed the indexed attention and a long context, which
# add ~1-2; the kernels' build takes ~2 minutes, beside gpu_check). Everything it
# prints also lands in $OUT (gpu_check.json and .log, kernels.log, pytest.log, junit.xml).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__,
    "cuda", torch.version.cuda, torch.cuda.get_device_name())'
nproc
# The CPU kernels build meanwhile (this machine's torch and g++, not the workstation's).
(g++ --version | head -1; timeout 200 python3 -m mashbox.cli kernels) > "$OUT/kernels.log" 2>&1 &

echo "== 1. bench/gpu_check.py"
# Its float32 CPU reference on torch's ops: no waiting for the build beside it.
MASHBOX_CPU_KERNELS=0 timeout 330 python3 bench/gpu_check.py 2>&1 | tee "$OUT/gpu_check.log"
echo "gpu_check exit ${PIPESTATUS[0]}"
wait
echo "== 2. mashbox kernels"
cat "$OUT/kernels.log"

echo "== 3. the engine's and the server's tests, on CUDA"
# These start servers without --device, which is "auto": CUDA here.
# -v names each test as it ends: a run cut short by the timeout still says what failed.
timeout 150 python3 -m pytest -v -rfE --tb=short --timeout 90 --no-header -p no:benchmark \
    -p mashbox.pytest_plugin -p no:cacheprovider -o filterwarnings=default -n 12 \
    --junitxml="$OUT/junit.xml" tests/test_graph_decode.py tests/test_compiled_glue.py \
    tests/test_indexed_attention.py \
    tests/test_chunk_pool.py tests/test_metrics.py tests/test_disk_cache.py \
    tests/test_server.py tests/test_engine.py tests/test_n_choices.py \
    2>&1 | tee "$OUT/pytest.log" | grep -E "FAILED|ERROR|Error|passed|failed" | tail -40
echo "pytest exit ${PIPESTATUS[0]}"
