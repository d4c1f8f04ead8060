# qcoll_add_header_tests()
#
# For every public header include/qcoll/**/*.hpp and **/*.cuh, generates a translation unit that
# includes only that header, twice (the second inclusion checks the include guard), and compiles
# it with qcoll's warning flags. The TUs go into object libraries that are part of `all`, so a
# header that is not self-contained, or warns, fails `cmake --build`.
#
#   .hpp  compiled by the host C++ compiler with qcoll's include directory and nothing else;
#   .cuh  compiled by nvcc (only when QCOLL_ENABLE_CUDA).
# A header whose path, or one of whose #include lines, names `mpi` or `nccl` as a word (e.g.
# qcoll/transport/mpi.hpp, <nccl.h>) also gets MPI or NCCL (+ CUDA runtime) include directories,
# and is skipped when that dependency is disabled.
#
# One object library per (language, dependencies) group: qcoll_header_tests_cxx,
# qcoll_header_tests_cxx_mpi, qcoll_header_tests_cuda, qcoll_header_tests_cuda_nccl, ...

include_guard(GLOBAL)

function(qcoll_add_header_tests)
  set(include_dir "${PROJECT_SOURCE_DIR}/include")
  set(gen_dir "${CMAKE_CURRENT_BINARY_DIR}/header_tests")
  file(GLOB_RECURSE headers CONFIGURE_DEPENDS RELATIVE "${include_dir}"
       "${include_dir}/qcoll/*.hpp" "${include_dir}/qcoll/*.cuh")
  list(SORT headers)

  set(groups "")
  set(skipped "")
  set(word_before "(^|[/_.-])")
  set(word_after "([/_.-]|$)")
  foreach(header IN LISTS headers)
    if(header MATCHES "\\.cuh$")
      set(lang cuda)
      set(ext ".cu")
    else()
      set(lang cxx)
      set(ext ".cpp")
    endif()

    # Names that decide the dependencies: the header's own path and everything it #includes.
    set(names "${header}")
    file(STRINGS "${include_dir}/${header}" include_lines REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]")
    foreach(line IN LISTS include_lines)
      if(line MATCHES "include[ \t]*[<\"]([^>\"]+)[>\"]")
        list(APPEND names "${CMAKE_MATCH_1}")
      endif()
    endforeach()
    set(needs "")
    foreach(name IN LISTS names)
      if(name MATCHES "${word_before}mpi${word_after}")
        list(APPEND needs MPI)
      endif()
      if(name MATCHES "${word_before}nccl${word_after}")
        list(APPEND needs NCCL)
      endif()
    endforeach()
    list(REMOVE_DUPLICATES needs)
    list(SORT needs)

    set(missing "")
    if(lang STREQUAL "cuda" AND NOT QCOLL_ENABLE_CUDA)
      list(APPEND missing CUDA)
    endif()
    foreach(dep IN LISTS needs)
      if(NOT QCOLL_ENABLE_${dep})
        list(APPEND missing ${dep})
      endif()
    endforeach()
    if(missing)
      list(JOIN missing "," missing_csv)
      list(APPEND skipped "${header} (${missing_csv} disabled)")
      continue()
    endif()

    set(group "${lang}")
    foreach(dep IN LISTS needs)
      string(TOLOWER "${dep}" dep_lower)
      string(APPEND group "_${dep_lower}")
    endforeach()
    if(NOT group IN_LIST groups)
      list(APPEND groups "${group}")
      set(group_${group}_deps ${needs})
      if(lang STREQUAL "cuda")
        list(APPEND group_${group}_deps CUDA)
      endif()
      set(group_${group}_sources "")
    endif()

    set(source "${gen_dir}/${header}${ext}")
    file(CONFIGURE OUTPUT "${source}" CONTENT
"// Generated from include/${header}: the header must compile on its own and tolerate being
// included twice.
#include <${header}>
#include <${header}>
")
    list(APPEND group_${group}_sources "${source}")
  endforeach()

  set(count 0)
  foreach(group IN LISTS groups)
    set(target qcoll_header_tests_${group})
    add_library(${target} OBJECT ${group_${group}_sources})
    qcoll_configure_target(${target} DEPS ${group_${group}_deps})
    list(LENGTH group_${group}_sources n)
    math(EXPR count "${count} + ${n}")
  endforeach()
  message(STATUS "qcoll: ${count} header self-containment tests")
  foreach(entry IN LISTS skipped)
    message(STATUS "qcoll: header test skipped: ${entry}")
  endforeach()
endfunction()
