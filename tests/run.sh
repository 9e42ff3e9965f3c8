#!/usr/bin/env bash
# Runs every test: installs what is missing, builds (with tests and benchmarks), runs ctest
# (unit, integration and Python tests). Run as root on a fresh Debian 12 machine.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

deploy/install-deps.sh
deploy/build.sh -DMUOND_BUILD_TESTS=ON -DMUOND_BUILD_BENCHMARKS=ON -DMUOND_TEST_HOOKS=ON
ctest --test-dir build --output-on-failure --timeout 600 -j "${MUOND_TEST_JOBS:-2}"
