# ccache when present. With precompiled headers it needs this sloppiness to get cache hits.
if(TRAINER_ENABLE_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  find_program(TRAINER_CCACHE ccache)
  if(TRAINER_CCACHE)
    set(CMAKE_CXX_COMPILER_LAUNCHER
        ${CMAKE_COMMAND} -E env CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
        ${TRAINER_CCACHE})
    message(STATUS "trainer: using ccache (${TRAINER_CCACHE})")
  endif()
endif()
