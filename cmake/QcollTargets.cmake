# Helpers for qcoll's own targets (tests, benchmarks, examples). Users of the library never
# include this file; they link qcoll::qcoll and nothing else.
#
#   qcoll_configure_target(<target> [DEPS CUDA MPI NCCL ...])
#       Links qcoll::qcoll, turns warnings into errors, links each listed dependency that is
#       enabled and defines QCOLL_HAVE_CUDA / QCOLL_HAVE_MPI / QCOLL_HAVE_NCCL as 1 or 0:
#         QCOLL_HAVE_CUDA  CUDA runtime API and toolkit headers usable (CUDA::cudart linked)
#         QCOLL_HAVE_MPI   MPI usable (MPI::MPI_CXX linked)
#         QCOLL_HAVE_NCCL  NCCL usable (NCCL::nccl linked)
#
#   qcoll_add_program(<target> <source> [OUTPUT_DIRECTORY <dir>] [OUTPUT_NAME <name>])
#       One executable from one .cpp or .cu file. .cpp programs get CUDA (runtime/headers) and MPI
#       when enabled; .cu programs additionally get NCCL. A .cu source while CUDA is disabled
#       creates nothing (check with `if(TARGET <target>)`).
#
#   qcoll_add_program_subdirectories(<dir>)
#       add_subdirectory() for every direct subdirectory of <dir> that has a CMakeLists.txt, so a
#       multi-file program can bring its own build description.

include_guard(GLOBAL)

option(QCOLL_WERROR "Treat warnings as errors in qcoll's own tests, benchmarks and examples" ON)
set(QCOLL_TEST_TIMEOUT 300 CACHE STRING "Seconds before CTest kills one of qcoll's tests")

function(qcoll_configure_target target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "" "DEPS")
  target_link_libraries(${target} PRIVATE qcoll::qcoll)

  set(host_warnings -Wall -Wextra)
  set(cuda_options "")
  if(QCOLL_WERROR)
    list(APPEND host_warnings -Werror)
    # nvcc front end (device and host code as nvcc sees it): every warning is an error.
    list(APPEND cuda_options -Werror=all-warnings)
  endif()
  # Host compiler behind nvcc: the same warnings, and no FMA contraction in host code (the host
  # side of a .cu test computes the reference results device code must match bit for bit).
  list(JOIN host_warnings "," host_warnings_csv)
  list(APPEND cuda_options "-Xcompiler=${host_warnings_csv},-ffp-contract=off")
  target_compile_options(${target} PRIVATE
    "$<$<COMPILE_LANG_AND_ID:CXX,GNU,Clang,AppleClang,IntelLLVM>:${host_warnings}>"
    "$<$<COMPILE_LANG_AND_ID:CUDA,NVIDIA>:${cuda_options}>")

  set(have_cuda 0)
  set(have_mpi 0)
  set(have_nccl 0)
  if("CUDA" IN_LIST arg_DEPS AND QCOLL_ENABLE_CUDA)
    target_link_libraries(${target} PRIVATE CUDA::cudart)
    set(have_cuda 1)
  endif()
  if("MPI" IN_LIST arg_DEPS AND QCOLL_ENABLE_MPI)
    target_link_libraries(${target} PRIVATE MPI::MPI_CXX)
    set(have_mpi 1)
  endif()
  if("NCCL" IN_LIST arg_DEPS AND QCOLL_ENABLE_NCCL)
    target_link_libraries(${target} PRIVATE NCCL::nccl CUDA::cudart)
    set(have_nccl 1)
    set(have_cuda 1)
  endif()
  target_compile_definitions(${target} PRIVATE
    QCOLL_HAVE_CUDA=${have_cuda} QCOLL_HAVE_MPI=${have_mpi} QCOLL_HAVE_NCCL=${have_nccl})

  get_target_property(type ${target} TYPE)
  if(have_cuda AND NOT type STREQUAL "INTERFACE_LIBRARY")
    # One CUDA runtime per process: the shared one that CUDA::cudart names, also for .cu files
    # (CMake would otherwise add the static runtime to CUDA links as well).
    set_target_properties(${target} PROPERTIES CUDA_RUNTIME_LIBRARY Shared)
  endif()
endfunction()

function(qcoll_add_program target source)
  cmake_parse_arguments(PARSE_ARGV 2 arg "" "OUTPUT_DIRECTORY;OUTPUT_NAME" "")
  if(source MATCHES "\\.cu$")
    if(NOT QCOLL_ENABLE_CUDA)
      return()
    endif()
    set(deps CUDA MPI NCCL)
  else()
    set(deps CUDA MPI)
  endif()
  add_executable(${target} "${source}")
  qcoll_configure_target(${target} DEPS ${deps})
  if(arg_OUTPUT_DIRECTORY)
    set_target_properties(${target} PROPERTIES RUNTIME_OUTPUT_DIRECTORY "${arg_OUTPUT_DIRECTORY}")
  endif()
  if(arg_OUTPUT_NAME)
    set_target_properties(${target} PROPERTIES OUTPUT_NAME "${arg_OUTPUT_NAME}")
  endif()
endfunction()

function(qcoll_add_program_subdirectories dir)
  file(GLOB children LIST_DIRECTORIES true CONFIGURE_DEPENDS "${dir}/*")
  list(SORT children)
  foreach(child IN LISTS children)
    if(IS_DIRECTORY "${child}" AND EXISTS "${child}/CMakeLists.txt")
      add_subdirectory("${child}")
    endif()
  endforeach()
endfunction()

# Writes "<target>\t<path of its executable>" for every executable target of this project, so
# scripts can run a program by target name without knowing where it was placed.
function(qcoll_write_executable_list output)
  set(content "")
  set(dirs "${PROJECT_SOURCE_DIR}")
  while(dirs)
    list(POP_FRONT dirs dir)
    get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
    foreach(target IN LISTS targets)
      get_target_property(type ${target} TYPE)
      if(type STREQUAL "EXECUTABLE")
        string(APPEND content "${target}\t$<TARGET_FILE:${target}>\n")
      endif()
    endforeach()
    get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
    list(APPEND dirs ${subdirs})
  endwhile()
  get_property(multi_config GLOBAL PROPERTY GENERATOR_IS_MULTI_CONFIG)
  if(multi_config)
    string(REGEX REPLACE "\\.txt$" "-$<CONFIG>.txt" output "${output}")
  endif()
  file(GENERATE OUTPUT "${output}" CONTENT "${content}")
endfunction()

function(qcoll_print_summary)
  set(cuda "${QCOLL_ENABLE_CUDA}")
  if(QCOLL_ENABLE_CUDA)
    set(cuda "ON (${CMAKE_CUDA_COMPILER}, architectures ${CMAKE_CUDA_ARCHITECTURES})")
  endif()
  set(nccl "${QCOLL_ENABLE_NCCL}")
  if(QCOLL_ENABLE_NCCL)
    set(nccl "ON (${NCCL_LIBRARY}, ${NCCL_VERSION})")
  endif()
  set(mpi "${QCOLL_ENABLE_MPI}")
  if(QCOLL_ENABLE_MPI)
    list(JOIN QCOLL_MPIEXEC_FLAGS " " mpiexec_flags)
    set(mpi "ON (${MPIEXEC_EXECUTABLE} ${mpiexec_flags})")
  endif()
  message(STATUS "qcoll ${PROJECT_VERSION}: build type '${CMAKE_BUILD_TYPE}'")
  message(STATUS "  CUDA: ${cuda}")
  message(STATUS "  NCCL: ${nccl}")
  message(STATUS "  MPI:  ${mpi}")
  message(STATUS "  tests ${QCOLL_BUILD_TESTS}, benchmarks ${QCOLL_BUILD_BENCH}, examples ${QCOLL_BUILD_EXAMPLES}")
endfunction()
