# Finds Apache Arrow's C++ libraries (libarrow, libparquet) and wraps them in one INTERFACE target, trainer::arrow,
# with SYSTEM includes. They come, as LibTorch does, from a wheel in the project's .venv: the pyarrow wheel pinned in
# requirements.txt carries the shared libraries and their headers (pyarrow.get_include(), pyarrow.get_library_dirs()).
# TRAINER_ARROW_DIR (a folder with include/ and the libraries, e.g. an unpacked pyarrow) overrides the search.
# Only src/data/table_file.cpp includes Arrow's headers: the rest of trainer sees our own narrow interface.
file(STRINGS ${CMAKE_CURRENT_SOURCE_DIR}/requirements.txt _trainer_arrow_pin REGEX "^pyarrow==")
string(REPLACE "pyarrow==" "" TRAINER_PINNED_ARROW "${_trainer_arrow_pin}")

set(TRAINER_ARROW_DIR "" CACHE PATH "Folder with Arrow's include/ and libarrow/libparquet (default: .venv's pyarrow)")
set(_arrow_dir "${TRAINER_ARROW_DIR}")
if(NOT _arrow_dir)
  set(_venv_python ${CMAKE_CURRENT_SOURCE_DIR}/.venv/bin/python)
  if(EXISTS ${_venv_python})
    execute_process(COMMAND ${_venv_python} -c "import os, pyarrow; print(os.path.dirname(pyarrow.__file__))"
      OUTPUT_VARIABLE _arrow_dir OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _arrow_rc ERROR_QUIET)
    if(NOT _arrow_rc EQUAL 0)
      set(_arrow_dir "")
    endif()
  endif()
endif()
# The wheel names its libraries by soname only (libarrow.so.2600): no unversioned link name.
file(GLOB _arrow_lib LIST_DIRECTORIES false "${_arrow_dir}/libarrow.so.[0-9]*")
file(GLOB _parquet_lib LIST_DIRECTORIES false "${_arrow_dir}/libparquet.so.[0-9]*")
if(NOT _arrow_dir OR NOT EXISTS "${_arrow_dir}/include/arrow/api.h" OR NOT _arrow_lib OR NOT _parquet_lib)
  message(FATAL_ERROR
    "Apache Arrow (libarrow, libparquet and headers) not found${_arrow_dir}.\n"
    "hint: run scripts/setup (installs pyarrow==${TRAINER_PINNED_ARROW} into .venv), or pass "
    "-DTRAINER_ARROW_DIR=/path/to/site-packages/pyarrow")
endif()
list(GET _arrow_lib 0 _arrow_lib)
list(GET _parquet_lib 0 _parquet_lib)
file(STRINGS "${_arrow_dir}/include/arrow/util/config.h" _arrow_version_line REGEX "define ARROW_VERSION_STRING")
string(REGEX REPLACE ".*\"(.*)\".*" "\\1" TRAINER_ARROW_VERSION "${_arrow_version_line}")
if(TRAINER_PINNED_ARROW AND NOT TRAINER_ARROW_VERSION VERSION_EQUAL TRAINER_PINNED_ARROW)
  message(WARNING "trainer: building against Arrow ${TRAINER_ARROW_VERSION}; requirements.txt pins "
                  "pyarrow==${TRAINER_PINNED_ARROW}, which is what CI tests.")
endif()

add_library(trainer_arrow INTERFACE)
add_library(trainer::arrow ALIAS trainer_arrow)
target_include_directories(trainer_arrow SYSTEM INTERFACE "${_arrow_dir}/include")
# Linked by full path: the linker records the sonames, and CMake's build RPATH names the wheel's folder, so
# build/trainer runs without LD_LIBRARY_PATH (docker/build-trainer.sh gives the runtime image's folder instead).
target_link_libraries(trainer_arrow INTERFACE "${_parquet_lib}" "${_arrow_lib}")
set(TRAINER_ARROW_LIBRARY_DIR "${_arrow_dir}")
message(STATUS "trainer: Arrow ${TRAINER_ARROW_VERSION} at ${_arrow_dir}")
