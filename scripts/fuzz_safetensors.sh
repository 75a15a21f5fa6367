#!/usr/bin/env bash
# Fuzzes the safetensors reader under AddressSanitizer and UndefinedBehaviorSanitizer: configures a separate
# build (build-asan, no precompiled header), then runs the seeded SafetensorsFuzz test with a few thousand mutated
# files (bit flips, truncation, header length changes, JSON bytes in the header), plus the hand-written hostile
# files and round trips. Every case must load or throw DataError; a crash or a sanitizer report fails the run.
# Not part of CI (the first build takes several minutes). Environment: TRAINER_FUZZ_CASES (default 5000),
# TRAINER_FUZZ_SEED, TRAINER_JOBS (default 2), TRAINER_ASAN_BUILD_DIR (default build-asan).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${TRAINER_ASAN_BUILD_DIR:-build-asan}
JOBS=${TRAINER_JOBS:-2}
export TRAINER_FUZZ_CASES=${TRAINER_FUZZ_CASES:-5000}
export TRAINER_FUZZ_SEED=${TRAINER_FUZZ_SEED:-20240611}

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTRAINER_ENABLE_PCH=OFF \
  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake --build "$BUILD_DIR" -j"$JOBS" --target trainer_tests

# LibTorch itself is not instrumented: leak checking would report its intentional start-up allocations.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
start=$(date +%s)
"$BUILD_DIR/trainer_tests" --gtest_filter='SafetensorsFuzz.*:SafetensorsHostile.*:Safetensors.*:ModelDir*'
echo "fuzz_safetensors: $TRAINER_FUZZ_CASES cases (seed $TRAINER_FUZZ_SEED) clean under ASan+UBSan in $(( $(date +%s) - start ))s"
