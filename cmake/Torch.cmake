# Finds LibTorch and wraps it in one INTERFACE target, trainer::torch, with SYSTEM includes so that our strict
# warnings stay on our code. LibTorch comes from, in order:
#   1. a CMAKE_PREFIX_PATH (or Torch_DIR) the user gives: an official libtorch zip, a CUDA wheel, ...
#   2. the torch wheel in the project's .venv (torch.utils.cmake_prefix_path), which scripts/setup installs.
# The pinned version lives in requirements.txt only; a different LibTorch is allowed but reported.
file(STRINGS ${CMAKE_CURRENT_SOURCE_DIR}/requirements.txt _trainer_torch_pin REGEX "^torch==")
string(REPLACE "torch==" "" TRAINER_PINNED_TORCH "${_trainer_torch_pin}")

find_package(Torch QUIET)
if(NOT Torch_FOUND)
  set(_venv_python ${CMAKE_CURRENT_SOURCE_DIR}/.venv/bin/python)
  if(EXISTS ${_venv_python})
    execute_process(COMMAND ${_venv_python} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE _torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _torch_rc ERROR_QUIET)
    if(_torch_rc EQUAL 0)
      list(APPEND CMAKE_PREFIX_PATH ${_torch_prefix})
    endif()
  endif()
  find_package(Torch QUIET)
endif()
if(NOT Torch_FOUND)
  message(FATAL_ERROR
    "LibTorch not found.\n"
    "hint: run scripts/setup (installs torch==${TRAINER_PINNED_TORCH} into .venv), or pass "
    "-DCMAKE_PREFIX_PATH=/path/to/libtorch (official zip) or "
    "-DCMAKE_PREFIX_PATH=$(python -c 'import torch; print(torch.utils.cmake_prefix_path)').")
endif()
if(NOT Torch_VERSION VERSION_EQUAL TRAINER_PINNED_TORCH)
  message(WARNING "trainer: building against LibTorch ${Torch_VERSION}; requirements.txt pins "
                  "${TRAINER_PINNED_TORCH}, which is what CI tests.")
endif()

add_library(trainer_torch INTERFACE)
add_library(trainer::torch ALIAS trainer_torch)
# The pip wheels' libtorch_cpu.so / libtorch.so export copies of libstdc++'s std::filesystem that were linked
# into them. torch 2.11.0+cu130's libtorch.so copy of std::filesystem::remove_all jumps to address 0 (found by
# scripts/gpu-check on an H100 machine whose compiler links libstdc++ statically). Our objects must take these
# symbols from our own libstdc++: it comes right after our static libraries, before LibTorch's, so a shared
# libstdc++ is searched first at run time and a static one is linked into the executable before LibTorch's
# exports can satisfy the references.
target_link_libraries(trainer_torch INTERFACE "-Wl,--push-state,--no-as-needed" stdc++ "-Wl,--pop-state"
                      ${TORCH_LIBRARIES})
# TORCH_CXX_FLAGS carries the ABI define; keep it as a list of options.
separate_arguments(_torch_flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
target_compile_options(trainer_torch INTERFACE ${_torch_flags})
if(TARGET torch_cuda OR TORCH_CUDA_LIBRARIES)
  set(TRAINER_TORCH_HAS_CUDA ON)
  # What `trainer --version` says the build is: "CUDA 13.0" (the toolkit Caffe2's CMake config found), or "CPU".
  set(TRAINER_TORCH_BUILD "CUDA ${CUDA_VERSION}")
else()
  set(TRAINER_TORCH_HAS_CUDA OFF)
  set(TRAINER_TORCH_BUILD "CPU")
endif()
# The one compile-time switch for CUDA-only extras (allocator snapshot on OOM, memory fraction).
target_compile_definitions(trainer_torch INTERFACE TRAINER_WITH_CUDA=$<BOOL:${TRAINER_TORCH_HAS_CUDA}>)
message(STATUS "trainer: LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX} (CUDA extras: ${TRAINER_TORCH_HAS_CUDA})")

# LibTorch's include directory carries its own copy of fmt (v12). spdlog from Debian is built against Debian's fmt
# (v9) and does not compile against v12, and -isystem order would pick LibTorch's copy. A one-entry include
# directory that maps <fmt/...> to the fmt spdlog was built with, placed before LibTorch's, resolves this. The two
# fmt versions use different inline namespaces (fmt::v9, fmt::v12), so nothing collides at link time.
find_package(fmt REQUIRED)
get_target_property(_fmt_include fmt::fmt INTERFACE_INCLUDE_DIRECTORIES)
list(GET _fmt_include 0 _fmt_include)
set(_fmt_shim ${CMAKE_BINARY_DIR}/include-shims/fmt-for-spdlog)
file(MAKE_DIRECTORY ${_fmt_shim})
file(CREATE_LINK ${_fmt_include}/fmt ${_fmt_shim}/fmt SYMBOLIC)
target_include_directories(trainer_torch SYSTEM INTERFACE ${_fmt_shim} ${TORCH_INCLUDE_DIRS})
