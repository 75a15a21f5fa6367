#!/bin/sh
# The build stage of docker/Dockerfile: installs the torch wheel pinned in requirements.txt into /opt/venv
# (LibTorch comes from it, as on a workstation) and lays out, under /opt/trainer/site-packages, the shared
# libraries the runtime stage keeps: torch/lib, pyarrow's libarrow and libparquet and, for CUDA, the nvidia-* wheels'
# libraries, in the wheels' own
# layout so that their relative RPATHs ($ORIGIN/../../nvidia/...) still resolve.
#
#   install-torch.sh cpu|cuda
#
# Where the wheel comes from:
#   cpu:  docker/wheels/ (bind-mounted at /wheels) when it holds a wheel of the pinned version, installed without any
#         index (scripts/docker-check puts there the wheel this machine's pip uses); else TORCH_INDEX, default
#         https://download.pytorch.org/whl/cpu;
#   cuda: TORCH_INDEX, default https://pypi.org/simple (PyPI's Linux torch is the CUDA build), with its nvidia-*
#         dependencies; docker/wheels is not used (`torch==X` would match a CPU wheel X+cpu there).
# pip settings come from build secrets, never from a layer: `pip.conf` (PIP_CONFIG_FILE) and `ca-bundle`
# (PIP_CERT, for a network whose TLS is re-signed by a proxy).
# For cuda it also installs the CUDA compiler at the version the wheel was built with (cuda-toolkit[nvcc,cudart,
# cccl]==X, the wheel's own requirement) and gives it the layout CMake's CUDA search expects (lib64/, unversioned
# library names), as scripts/check-cuda-build does; the toolkit stays in the build stage.
set -eu
variant=${1:?usage: install-torch.sh cpu|cuda}
pin=$(grep '^torch==' /src/requirements.txt || true)
[ -n "$pin" ] || { echo "error: requirements.txt has no torch== line" >&2; exit 1; }
version=${pin#torch==}

[ -f /run/secrets/pip.conf ] && export PIP_CONFIG_FILE=/run/secrets/pip.conf
[ -f /run/secrets/ca-bundle ] && export PIP_CERT=/run/secrets/ca-bundle
python3 -m venv /opt/venv
pip_install() { /opt/venv/bin/python -m pip install --no-cache-dir --progress-bar off --disable-pip-version-check "$@"; }

local_wheel=$(ls /wheels/torch-"$version"-*.whl /wheels/torch-"$version"+*.whl 2>/dev/null | head -1 || true)
case "$variant" in
  cpu)
    # trainer needs LibTorch's files, not torch's Python dependencies: --no-deps.
    if [ -n "$local_wheel" ]; then
      echo "torch: $local_wheel (docker/wheels)"
      pip_install --no-deps --no-index --find-links /wheels "$pin"
    else
      index=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
      echo "torch: $pin from $index"
      pip_install --no-deps --index-url "$index" "$pin"
    fi ;;
  cuda)
    # From the index only: `torch==X` also matches a CPU wheel X+cpu in docker/wheels, which pip would prefer.
    index=${TORCH_INDEX:-https://pypi.org/simple}
    echo "torch: $pin with its NVIDIA libraries from $index"
    pip_install --index-url "$index" "$pin" ;;
  *) echo "error: TORCH_VARIANT=$variant: use cpu or cuda" >&2; exit 1 ;;
esac

site=$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
lib="$site/torch/lib"
if [ "$variant" = cuda ]; then
  [ -f "$lib/libtorch_cuda.so" ] || { echo "error: TORCH_VARIANT=cuda but the installed torch has no libtorch_cuda.so (a CPU wheel?)" >&2; exit 1; }
else
  [ ! -f "$lib/libtorch_cuda.so" ] || { echo "error: TORCH_VARIANT=cpu but the installed torch is a CUDA build: put the CPU wheel in docker/wheels or set TORCH_INDEX" >&2; exit 1; }
fi

# What the runtime stage keeps: torch's shared libraries but the Python binding and the test libraries.
mkdir -p /opt/trainer/site-packages/torch/lib
for so in "$lib"/*.so*; do
  case $(basename "$so") in
    libtorch_python.so|libjitbackend_test.so|libtorchbind_test.so|libbackend_with_compiler.so|libaoti_custom_ops.so) ;;
    *) cp -a "$so" /opt/trainer/site-packages/torch/lib/ ;;
  esac
done
if [ "$variant" = cuda ]; then
  # The NVIDIA wheels' shared libraries (cuBLAS, cuDNN, NCCL, ...), before the compiler is added below.
  (cd "$site" && find nvidia cusparselt -name '*.so*' \( -type f -o -type l \) 2>/dev/null | while read -r so; do
     mkdir -p "/opt/trainer/site-packages/$(dirname "$so")" && cp -a "$so" "/opt/trainer/site-packages/$so"; done)

  toolkit=$(/opt/venv/bin/python - <<'PY'
import importlib.metadata as m, re
for requirement in m.requires("torch") or []:
    found = re.match(r"cuda-toolkit\[[^\]]*\]==([0-9.]+)", requirement)
    if found:
        print(found.group(1))
PY
)
  [ -n "$toolkit" ] || { echo "error: cannot tell which CUDA toolkit torch $version depends on (no cuda-toolkit requirement)" >&2; exit 1; }
  echo "CUDA compiler: cuda-toolkit[nvcc,cudart,cccl]==$toolkit"
  pip_install --index-url "$index" "cuda-toolkit[nvcc,cudart,cccl]==$toolkit"
  cuda_root=$(ls -d "$site"/nvidia/cu[0-9]* | head -1)
  [ -x "$cuda_root/bin/nvcc" ] || { echo "error: no nvcc under $site/nvidia after installing cuda-toolkit" >&2; exit 1; }
  [ -e "$cuda_root/lib64" ] || ln -s lib "$cuda_root/lib64"
  for library in "$site"/nvidia/*/lib/lib*.so.*; do
    name=$(basename "$library")
    link="$cuda_root/lib/${name%%.so.*}.so"
    [ -e "$link" ] || ln -s "$(realpath --relative-to="$cuda_root/lib" "$library")" "$link"
  done
  ln -sfn "$cuda_root" /opt/cuda
  "$cuda_root/bin/nvcc" --version | tail -1
fi
# Apache Arrow's C++ libraries (Parquet and Arrow data files) from the pyarrow wheel pinned in requirements.txt, as on
# a workstation: headers for the build (in /opt/venv), libarrow and libparquet for the runtime stage.
arrow_pin=$(grep '^pyarrow==' /src/requirements.txt || true)
[ -n "$arrow_pin" ] || { echo "error: requirements.txt has no pyarrow== line" >&2; exit 1; }
arrow_version=${arrow_pin#pyarrow==}
arrow_wheel=$(ls /wheels/pyarrow-"$arrow_version"-*.whl 2>/dev/null | head -1 || true)
if [ -n "$arrow_wheel" ]; then
  echo "pyarrow: $arrow_wheel (docker/wheels)"
  pip_install --no-deps --no-index --find-links /wheels "$arrow_pin"
else
  echo "pyarrow: $arrow_pin from the default index"
  pip_install --no-deps "$arrow_pin"
fi
mkdir -p /opt/trainer/site-packages/pyarrow
cp -a "$site"/pyarrow/libarrow.so.* "$site"/pyarrow/libparquet.so.* /opt/trainer/site-packages/pyarrow/
echo "runtime libraries: $(du -sh /opt/trainer/site-packages | cut -f1)"
