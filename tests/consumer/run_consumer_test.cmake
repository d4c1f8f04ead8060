# Builds a tiny project that uses qcoll one of three ways, and runs it. Called by CTest:
#
#   cmake -DMODE=<find_package|add_subdirectory|copy_in> -DQCOLL_SOURCE_DIR=<qcoll tree>
#         -DQCOLL_EXPECTED_VERSION=<x.y.z> -DWORK_DIR=<scratch directory>
#         [-DCONSUMER_GENERATOR=<generator>] [-DCONSUMER_MAKE_PROGRAM=<make/ninja>]
#         [-DCONSUMER_CXX=<C++ compiler>] [-DCONSUMER_NVCC=<nvcc>]
#         [-DCONSUMER_CUDA_HOST_COMPILER=<host compiler for nvcc>]
#         -P run_consumer_test.cmake
#
#   find_package      configure qcoll alone, `cmake --install` it into WORK_DIR/prefix, then build
#                     find_package/ against that prefix (and a .cu consumer when nvcc is given);
#   add_subdirectory  build add_subdirectory/, which pulls in the qcoll source tree;
#   copy_in           copy include/qcoll alone into WORK_DIR and compile main.cpp with a bare
#                     `<c++> -std=c++17`, and main.cu with `nvcc -std=c++17 -arch=sm_90 -c`.

cmake_minimum_required(VERSION 3.25)

foreach(var IN ITEMS MODE QCOLL_SOURCE_DIR QCOLL_EXPECTED_VERSION WORK_DIR)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer_test.cmake: -D${var}=... is required")
  endif()
endforeach()
if(NOT CONSUMER_CXX)
  set(CONSUMER_CXX c++)
endif()
set(consumer_dir "${CMAKE_CURRENT_LIST_DIR}")

# Runs a command; on failure prints it with its output and stops.
function(run)
  string(REPLACE ";" " " printable "${ARGN}")
  message(STATUS "$ ${printable}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "command failed (${rc}): ${printable}\n${out}")
  endif()
  string(STRIP "${out}" out)
  if(out)
    message(STATUS "${out}")
  endif()
endfunction()

# Arguments every nested configuration gets: same generator and compilers as the outer build.
set(configure_args "")
if(CONSUMER_GENERATOR)
  list(APPEND configure_args -G "${CONSUMER_GENERATOR}")
endif()
if(CONSUMER_MAKE_PROGRAM)
  list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${CONSUMER_MAKE_PROGRAM}")
endif()
list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CONSUMER_CXX}")

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

if(MODE STREQUAL "find_package")
  set(prefix "${WORK_DIR}/prefix")
  run(${CMAKE_COMMAND} -S "${QCOLL_SOURCE_DIR}" -B "${WORK_DIR}/qcoll-build" ${configure_args}
      "-DCMAKE_INSTALL_PREFIX=${prefix}"
      -DQCOLL_BUILD_TESTS=OFF -DQCOLL_BUILD_BENCH=OFF -DQCOLL_BUILD_EXAMPLES=OFF)
  run(${CMAKE_COMMAND} --install "${WORK_DIR}/qcoll-build")

  # The installed header set is exactly the source header set.
  file(GLOB_RECURSE source_headers RELATIVE "${QCOLL_SOURCE_DIR}/include" "${QCOLL_SOURCE_DIR}/include/qcoll/*")
  file(GLOB_RECURSE installed_headers RELATIVE "${prefix}/include" "${prefix}/include/qcoll/*")
  list(SORT source_headers)
  list(SORT installed_headers)
  if(NOT source_headers STREQUAL installed_headers)
    message(FATAL_ERROR "installed headers differ from include/qcoll:\n"
                        "  source:    ${source_headers}\n  installed: ${installed_headers}")
  endif()

  set(cuda_args "")
  if(CONSUMER_NVCC)
    list(APPEND cuda_args "-DCMAKE_CUDA_COMPILER=${CONSUMER_NVCC}")
    if(CONSUMER_CUDA_HOST_COMPILER)
      list(APPEND cuda_args "-DCMAKE_CUDA_HOST_COMPILER=${CONSUMER_CUDA_HOST_COMPILER}")
    endif()
  endif()
  run(${CMAKE_COMMAND} -S "${consumer_dir}/find_package" -B "${WORK_DIR}/consumer" ${configure_args}
      ${cuda_args} "-DCMAKE_PREFIX_PATH=${prefix}" "-DQCOLL_EXPECTED_VERSION=${QCOLL_EXPECTED_VERSION}")
  run(${CMAKE_COMMAND} --build "${WORK_DIR}/consumer")
  run("${WORK_DIR}/consumer/qcoll_consumer")
  if(CONSUMER_NVCC AND NOT EXISTS "${WORK_DIR}/consumer/qcoll_consumer_cuda")
    message(FATAL_ERROR "the CUDA consumer was not built")
  endif()

elseif(MODE STREQUAL "add_subdirectory")
  run(${CMAKE_COMMAND} -S "${consumer_dir}/add_subdirectory" -B "${WORK_DIR}/consumer" ${configure_args}
      "-DQCOLL_SOURCE_DIR=${QCOLL_SOURCE_DIR}")
  run(${CMAKE_COMMAND} --build "${WORK_DIR}/consumer")
  run("${WORK_DIR}/consumer/qcoll_consumer")

elseif(MODE STREQUAL "copy_in")
  # Only include/qcoll and the consumer's own source: nothing else of the repository is visible.
  file(COPY "${QCOLL_SOURCE_DIR}/include/qcoll" DESTINATION "${WORK_DIR}/third_party/include")
  file(COPY "${consumer_dir}/main.cpp" "${consumer_dir}/main.cu" DESTINATION "${WORK_DIR}")
  run("${CONSUMER_CXX}" -std=c++17 -I "${WORK_DIR}/third_party/include" "${WORK_DIR}/main.cpp"
      -o "${WORK_DIR}/consumer")
  run("${WORK_DIR}/consumer")
  if(CONSUMER_NVCC)
    run("${CONSUMER_NVCC}" -std=c++17 -arch=sm_90 -I "${WORK_DIR}/third_party/include" -c "${WORK_DIR}/main.cu"
        -o "${WORK_DIR}/main_cuda.o")
  else()
    message(STATUS "no nvcc: the CUDA copy-in check was not run")
  endif()

else()
  message(FATAL_ERROR "run_consumer_test.cmake: unknown MODE '${MODE}'")
endif()
