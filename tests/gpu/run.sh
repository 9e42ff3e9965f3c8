#!/usr/bin/env bash
# Builds muond with the CUDA backend (in build-gpu) and, on a machine with an NVIDIA GPU, runs the
# CUDA tests (C++ and Python) and the GPU benchmarks; made to finish within 8 minutes on a 16-core
# machine (the build is most of it). Exits non-zero when a step fails, or when a GPU is visible to
# nvidia-smi but a GPU test skipped (the backend could not open it, or the Python interpreter's
# torch sees no GPU): on such a machine a skip is a failure, except the skips that say a device is
# present or that name a backend it does not have (Level Zero).
#
#   tests/gpu/run.sh              # build, tests, benchmarks
#   MUOND_GPU_BUILD_DIR=/x JOBS=8 PYTHON=/venv/bin/python tests/gpu/run.sh
# PYTHON: the interpreter of the Python tests (default /usr/bin/python3); it needs a CUDA build of
# torch, which Debian's python3-torch is not.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="${MUOND_GPU_BUILD_DIR:-$root/build-gpu}"
jobs="${JOBS:-$(nproc)}"
python="${PYTHON:-/usr/bin/python3}"
failed=()
step() { echo; echo "=== $* ($(date +%T))"; }

# gtest_skips LOG ALLOWED: "Suite.Test: reason" for every test of the gtest output LOG that
# skipped for a reason not matching the extended regular expression ALLOWED ("" allows none).
gtest_skips() {
  awk -v allowed="$2" '
    /^\[ RUN      \] / { reason = ""; next }
    /^\[  SKIPPED \] .* \([0-9]+ ms\)$/ {
      if (allowed == "" || reason !~ allowed) print $4 ":" substr(reason, 1, 300)
      next
    }
    { reason = reason " " $0 }' "$1"
}

# gtest_step NAME ALLOWED TIMEOUT BINARY [ARGS...]: runs a gtest binary of the build; fails the run
# when it fails, or when a GPU is present and a test skipped for a reason not matching ALLOWED.
gtest_step() {
  local name="$1" allowed="$2" limit="$3" bin="$4" log="$build/$1.log"
  shift 4
  timeout "$limit" "$build/bin/$bin" "$@" 2>&1 | tee "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("$name")
  if [ "$have_gpu" = 1 ]; then
    local skipped
    skipped="$(gtest_skips "$log" "$allowed")"
    if [ -n "$skipped" ]; then
      echo "a GPU is present but these tests skipped:"
      echo "$skipped"
      failed+=("$name-skipped")
    fi
  fi
}

# python_step NAME TIMEOUT SCRIPT [ARGS...]: runs a Python test of tests/python (each test class
# starts its own muond) with the build's muond and client library; fails the run when it fails,
# or when a GPU is present and a test skipped (unittest -v: "... skipped '<reason>'").
python_step() {
  local name="$1" limit="$2" script="$3" log="$build/$1.log"
  shift 3
  timeout "$limit" "$python" "$root/tests/python/$script" "$build/bin/muond" "$client_lib" "$@" \
    2>&1 | tee "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("$name")
  if [ "$have_gpu" = 1 ] && grep -qE "\.\.\. skipped|\(skipped=[0-9]+\)" "$log"; then
    echo "a GPU is present but $name skipped; $python has torch" \
      "$("$python" -c 'import torch; print(torch.__version__, "built for CUDA",
        torch.version.cuda, "sees GPUs:", torch.cuda.device_count())' 2>&1)"
    failed+=("$name-skipped")
  fi
}

step "GPU"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L; then
  have_gpu=1
else
  have_gpu=0
  echo "no NVIDIA GPU visible (nvidia-smi); the CUDA tests will skip and the benchmarks will not run"
fi

step "configure and build (${build}, ${jobs} jobs)"
start=$SECONDS
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMUOND_WITH_CUDA=ON \
  -DMUOND_BUILD_TESTS=ON -DMUOND_BUILD_BENCHMARKS=ON >"$build.configure.log" 2>&1 ||
  { tail -30 "$build.configure.log"; exit 1; }
grep -q "CUDA toolkit ON" "$build.configure.log" || { echo "CUDA toolkit not found"; exit 1; }
ninja -C "$build" -j "$jobs" muond muond-bench cuda_device_tests device_direct_copy_tests \
  muond_client_shared || exit 1
echo "built in $((SECONDS - start)) s"
client_lib="$(find "$build" -name 'libmuond_client.so' -print -quit)"

step "cuda_device_tests"
# CudaNoDeviceTest.MuondBackendCudaExitsNonZeroWithOneLine skips because a device is present.
gtest_step cuda_device_tests "a CUDA device is present" 240 cuda_device_tests

step "direct copies: registered shared-memory regions <-> device (device_direct_copy_tests)"
# The simulated direct path, then the CUDA suite: in-place copies of a registered memfd region,
# the widen/narrow kernels against the host, steps direct vs staged bit for bit, and the
# measurement: pinned copy GB/s (region -> device, device -> region) and a step's time against
# the PCIe floor (bytes moved / measured pinned GB/s).
# The Level Zero suite skips on an NVIDIA machine.
gtest_step device_direct_copy_tests "Level Zero backend unavailable" 240 device_direct_copy_tests
echo "--- measured:"
grep -E "^(pinned copy|step \()" "$build/device_direct_copy_tests.log" ||
  echo "(no measurement: no CUDA device)"

step "apply mode with parameters on a CUDA device (python, needs a CUDA build of torch)"
# Each skips (and says so) where torch sees no GPU; Debian's python3-torch is CPU-only. One rank:
# bf16 parameters with given gradients over both transports (CudaParamsTest); a model trained on
# cuda:0 against the same run on the CPU at world 1 and world 2 (two gloo ranks on the one GPU),
# the shared-memory buffers registered with CUDA, and the CUDA runtime's registration behaving
# as the registration's unit test assumes (cuda_apply_test.py).
python_step python-apply-cuda 180 apply_optimizer_test.py CudaParamsTest
python_step python-apply-cuda-model 300 cuda_apply_test.py

if [ "$have_gpu" = 1 ]; then
  step "muond-bench gpu"
  timeout 150 "$build/bin/muond-bench" gpu --seconds 40 || failed+=(bench-gpu)
  step "muond-bench step --backend cuda"
  timeout 90 "$build/bin/muond-bench" step --backend cuda --ranks 1,2 --layers 2 --steps 2 ||
    failed+=(bench-step-cuda)
  step "critical_path_bench: the optimizer's exposed time with the daemon computing on the GPU"
  # The emulated trainer of tests/bench/critical_path_bench.py against a CUDA daemon: the
  # in-process baseline stays the CPU optimizer; streaming and delayed steps run Newton-Schulz
  # on the GPU while the trainer's backward sleeps, so the exposed time is the tail of the last
  # bucket and the copies, not the CPU's compute.
  timeout 300 /usr/bin/python3 "$root/tests/bench/critical_path_bench.py" \
    --muond "$build/bin/muond" --lib "$(find "$build" -name 'libmuond_client.so' -print -quit)" \
    --steps 2 --layers 6 || failed+=(bench-critical-path)
  step "muond-bench ns (the CPU Newton-Schulz, for comparison)"
  timeout 40 "$build/bin/muond-bench" ns --sizes 1024 --dtypes float32,bfloat16 ||
    failed+=(bench-ns)
fi

step "summary ($((SECONDS)) s)"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all passed"
