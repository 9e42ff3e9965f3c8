#!/usr/bin/env bash
# Builds muond with the CUDA backend (in build-gpu) and, on a machine with an NVIDIA GPU, runs the
# CUDA tests and the GPU benchmarks; made to finish within 8 minutes on a 16-core machine (the
# build is most of it). Exits non-zero when a step fails, or when a GPU is visible to nvidia-smi
# but the CUDA tests skipped (the backend could not open it).
#
#   tests/gpu/run.sh              # build, tests, benchmarks
#   MUOND_GPU_BUILD_DIR=/x JOBS=8 tests/gpu/run.sh
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="${MUOND_GPU_BUILD_DIR:-$root/build-gpu}"
jobs="${JOBS:-$(nproc)}"
failed=()
step() { echo; echo "=== $* ($(date +%T))"; }

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

step "cuda_device_tests"
timeout 240 "$build/bin/cuda_device_tests" 2>&1 | tee "$build/cuda_device_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed+=(cuda_device_tests)
if [ "$have_gpu" = 1 ] && grep -q "^\[  SKIPPED \] Cuda" "$build/cuda_device_tests.log"; then
  echo "a GPU is present but CUDA tests skipped"
  failed+=(cuda_device_tests-skipped)
fi

step "direct copies: registered shared-memory regions <-> device (device_direct_copy_tests)"
# The simulated direct path, then the CUDA suite: in-place copies of a registered memfd region,
# the widen/narrow kernels against the host, steps direct vs staged bit for bit, and the
# measurement: pinned copy GB/s (region -> device, device -> region) and a step's time against
# the PCIe floor (bytes moved / measured pinned GB/s).
timeout 240 "$build/bin/device_direct_copy_tests" 2>&1 | tee "$build/device_direct_copy_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed+=(device_direct_copy_tests)
if [ "$have_gpu" = 1 ] && grep -q "^\[  SKIPPED \] CudaDirectCopyTest" \
  "$build/device_direct_copy_tests.log"; then
  echo "a GPU is present but the direct-copy CUDA tests skipped"
  failed+=(device_direct_copy_tests-skipped)
fi
echo "--- measured:"
grep -E "^(pinned copy|step \()" "$build/device_direct_copy_tests.log" ||
  echo "(no measurement: no CUDA device)"

step "apply mode with parameters on a CUDA device (python, needs a CUDA build of torch)"
# Skips (and says so) where torch sees no GPU; Debian's python3-torch is CPU-only.
timeout 180 /usr/bin/python3 "$root/tests/python/apply_optimizer_test.py" "$build/bin/muond" \
  "$(find "$build" -name 'libmuond_client.so' -print -quit)" CudaParamsTest ||
  failed+=(python-apply-cuda)

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
