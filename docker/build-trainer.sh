#!/bin/sh
# The build stage of docker/Dockerfile: configures and builds the `trainer` binary alone (no tests) in /build
# against the torch that install-torch.sh put in /opt/venv; for CUDA with the pip CUDA compiler at /opt/cuda.
# The binary's RPATH names /opt/trainer/site-packages/torch/lib, where the runtime stage keeps LibTorch,
# /opt/trainer/site-packages/pyarrow (libarrow, libparquet) and, for CUDA, the CUDA runtime's folder there.
#
#   build-trainer.sh cpu|cuda [JOBS]
set -eu
variant=${1:?usage: build-trainer.sh cpu|cuda [JOBS]}
jobs=${2:-$(nproc)}
site=$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rpath="/opt/trainer/site-packages/torch/lib;/opt/trainer/site-packages/pyarrow"
if [ "$variant" = cuda ]; then
  # trainer's own kernels link the CUDA runtime (libcudart.so.13) directly: its folder in the runtime layout too.
  rpath="$rpath;/opt/trainer/site-packages/nvidia/$(basename "$(readlink -f /opt/cuda)")/lib"
fi
set -- -S /src -B /build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTRAINER_BUILD_TESTS=OFF \
  -DCMAKE_PREFIX_PATH="$site/torch/share/cmake" -DTRAINER_ARROW_DIR="$site/pyarrow" -DCMAKE_BUILD_RPATH="$rpath"
if [ "$variant" = cuda ]; then
  # The architectures Caffe2's CMake config would otherwise detect with a test program on the GPU (none here; and
  # Debian's CMake 3.25 cannot compile that program with CUDA 13's nvcc: "CUDA20 ... does not support this").
  # trainer's own kernels take TRAINER_CUDA_ARCHITECTURES (CMakeLists.txt), the same list.
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-7.5;8.0;8.6;8.9;9.0+PTX}"
  set -- "$@" -DCUDA_TOOLKIT_ROOT_DIR=/opt/cuda -DCUDAToolkit_ROOT=/opt/cuda -DCMAKE_CUDA_COMPILER=/opt/cuda/bin/nvcc \
    -DCUDNN_ROOT="$site/nvidia/cudnn" -DCUDNN_INCLUDE_DIR="$site/nvidia/cudnn/include" \
    -DCUDNN_LIBRARY="$site/nvidia/cudnn/lib/libcudnn.so.9"
fi
cmake "$@"
if [ "$variant" = cuda ]; then
  grep -q -- '-DTRAINER_WITH_CUDA=1' /build/compile_commands.json ||
    { echo "error: configured without the CUDA extras (TRAINER_WITH_CUDA=0)" >&2; exit 1; }
fi
ccache --zero-stats > /dev/null 2>&1 || true  # the statistics below are this build's (the cache mount outlives it)
cmake --build /build --target trainer -j"$jobs"
ccache --show-stats 2>/dev/null | grep -iE 'hits|misses' | head -3 || true
/build/trainer --version
