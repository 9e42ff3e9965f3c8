#!/usr/bin/env bash
# Installs every Debian 12 package that muond's build, tests and examples need.
# Idempotent: packages already present are not touched; nothing is fetched from outside apt.
set -euo pipefail

# libopenblas0-pthread: LibTorch's fp32 CPU GEMMs go through the system BLAS; the reference BLAS is
# ~40x slower. libblas-dev: cblas.h and the link name of the system BLAS, for Newton-Schulz's
# SYRK/SYMM symmetric products (server/optim/symmetric_products.cc).
# openssl: the TLS tests make a CA and certificates at test time. prometheus: `promtool` and a
# real server for the metrics tests (the package enables a prometheus.service; muond does not
# need it running).
# python3-yaml: the deployment tests parse the Kubernetes and Prometheus YAML. systemd:
# `systemd-analyze verify` on deploy/systemd/muond.service.
# libze-dev: the Level Zero loader (the backend is built against it). clang-14 + llvm-spirv-14:
# the Level Zero kernels are compiled from OpenCL C to SPIR-V at build time. pocl-opencl-icd,
# ocl-icd-opencl-dev, opencl-headers: the tests run the same kernel source on this CPU through
# PoCL. python3-matplotlib: the training example plots its loss curves. libclang-rt-14-dev:
# libFuzzer and clang's sanitizer runtimes for the fuzz targets (tests/fuzz/run.sh; gcc's ASan,
# UBSan and TSan runtimes for tests/sanitize/run.sh come with build-essential). chromium: the
# status page test loads the daemon's page in a headless browser. iproute2: `ip` and `tc` for the
# emulated nodes of `muond-bench multinode` (network namespaces, veth pairs, tbf).
# prometheus-cpp-dev: the daemon's metrics registry, families and text exposition.
PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libtorch-dev libdnnl-dev libopenblas0-pthread libblas-dev nlohmann-json3-dev libssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  prometheus prometheus-cpp-dev openssl
  python3 python3-numpy python3-torch
  python3-yaml systemd
  libze-dev clang-14 llvm-spirv-14 pocl-opencl-icd ocl-icd-opencl-dev opencl-headers
  python3-matplotlib libclang-rt-14-dev chromium iproute2
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing packages (${missing[*]}); run this script as root" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
