#!/usr/bin/env bash
# Builds the image tool with AddressSanitizer and UndefinedBehaviorSanitizer and runs the image tests against it
# (decoding of damaged, truncated and malicious files, resizing, datasets): any memory error or undefined
# behaviour in our decoding code fails the run.
#   scripts/fuzz_images.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=${TRAINER_FUZZ_DIR:-build/fuzz-images}
mkdir -p "$out"
g++ -std=c++20 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer \
  -Iinclude -Isrc src/data/image.cpp src/data/image_preprocess.cpp src/data/image_dataset.cpp \
  tests/parity/image_tool.cpp $(pkg-config --cflags --libs libjpeg libpng libwebp) -lpthread \
  -o "$out/trainer_image_tool"
# The bomb test runs the tool under a 1 GiB address-space limit, which ASan's shadow memory cannot live in.
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 TRAINER_IMAGE_TOOL="$out/trainer_image_tool" \
  .venv/bin/python -m pytest tests/parity/test_images.py -q -k "not allocates_nothing" "$@"
