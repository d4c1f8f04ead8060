# Finds the optional engines of qcoll's own programs (tests, benchmarks, examples) and declares
#   QCOLL_ENABLE_CUDA  - compile .cu programs with nvcc         (default: a CUDA compiler works)
#   QCOLL_ENABLE_NCCL  - link NCCL into CUDA programs           (default: CUDA on and NCCL found)
#   QCOLL_ENABLE_MPI   - link MPI, build tests/mpi              (default: MPI found)
# An option forced ON whose dependency is missing stops the configuration with a message.
#
# Included (not called) from the top-level CMakeLists.txt, because enable_language(CUDA) must run
# at directory scope.

include_guard(DIRECTORY)

# --- MPI ------------------------------------------------------------------------------------
# qcoll uses the C API only; skipping the deprecated C++ bindings keeps mpi.h warning-free.
set(MPI_CXX_SKIP_MPICXX ON CACHE BOOL "Do not use the MPI C++ bindings (qcoll uses the C API)")
find_package(MPI COMPONENTS CXX QUIET)
option(QCOLL_ENABLE_MPI "Build qcoll's MPI tests and link MPI into its programs" ${MPI_CXX_FOUND})
if(QCOLL_ENABLE_MPI AND NOT MPI_CXX_FOUND)
  message(FATAL_ERROR "qcoll: QCOLL_ENABLE_MPI is ON but no MPI (CXX) was found. Install an MPI "
                      "(Debian: libopenmpi-dev openmpi-bin) or configure with -DQCOLL_ENABLE_MPI=OFF.")
endif()

# --- CUDA -----------------------------------------------------------------------------------
include(CheckLanguage)
check_language(CUDA)
if(CMAKE_CUDA_COMPILER)
  set(_qcoll_cuda_found ON)
else()
  set(_qcoll_cuda_found OFF)
endif()
option(QCOLL_ENABLE_CUDA "Build qcoll's CUDA programs and tests (.cu) with nvcc" ${_qcoll_cuda_found})

if(QCOLL_ENABLE_CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    message(FATAL_ERROR "qcoll: QCOLL_ENABLE_CUDA is ON but no working CUDA compiler was found. "
                        "Pass -DCMAKE_CUDA_COMPILER=/path/to/nvcc or -DQCOLL_ENABLE_CUDA=OFF.")
  endif()
  # Default device code: sm_80 and sm_90 (A100, H100), each as SASS plus PTX. Never `native`:
  # the build machine may have no GPU, and binaries must not depend on the one it has.
  # (CMake's own CUDAARCHS environment variable, when set, is respected too.)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
    set(CMAKE_CUDA_ARCHITECTURES "80;90" CACHE STRING "CUDA architectures qcoll's programs are compiled for")
  endif()
  if(NOT DEFINED CMAKE_CUDA_STANDARD)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
endif()

# QCOLL_CUDA_COMPILE_ONLY: for builds that compile CUDA code on a machine that cannot run it
# (.ci/run): every .cu program (GPU tests, examples, header tests, device benchmarks) with its
# host half at -O0 and its device code assembled by ptxas at -O0 (cicc still optimizes). The
# programs still run correctly, only slower. Measured with nvcc --time on tests/gpu/test_kernels.cu:
# gcc on the host half 34 s at -O1, 19 s at -O0; ptxas 15 + 18 s at -O3, 9 + 11 s at -O0; cicc
# 28 + 28 s either way. The emulated GPU tests (tests/emu) still compile the same sources with
# the host compiler at -O1 and -Werror. nvcc's -O is the host half's optimization; nvcc puts its
# own -O after any -Xcompiler=-O and takes the last of several -O with a warning, so the -O of the
# configuration's flags is replaced, at directory scope, before any program's directory is added.
# The benchmarks' quick build (QCOLL_BENCH_QUICK_BUILD) does the same for bench/ alone.
option(QCOLL_CUDA_COMPILE_ONLY "Compile qcoll's CUDA programs for a machine that does not run them: host half and ptxas at -O0" OFF)
macro(qcoll_cuda_unoptimized)
  foreach(config IN ITEMS RELEASE RELWITHDEBINFO MINSIZEREL DEBUG)
    string(REGEX REPLACE "(^| )-O[0-9s]" "" CMAKE_CUDA_FLAGS_${config} "${CMAKE_CUDA_FLAGS_${config}}")
    string(APPEND CMAKE_CUDA_FLAGS_${config} " -O0")
  endforeach()
  if(NOT CMAKE_CUDA_FLAGS MATCHES "-Xptxas=-O0")
    string(APPEND CMAKE_CUDA_FLAGS " -Xptxas=-O0")
  endif()
endmacro()
if(QCOLL_ENABLE_CUDA AND QCOLL_CUDA_COMPILE_ONLY)
  qcoll_cuda_unoptimized()
endif()

# --- NCCL (needs CUDA) ------------------------------------------------------------------------
set(_qcoll_nccl_found OFF)
if(QCOLL_ENABLE_CUDA)
  find_package(NCCL QUIET)
  if(NCCL_FOUND)
    set(_qcoll_nccl_found ON)
  endif()
endif()
option(QCOLL_ENABLE_NCCL "Link NCCL into qcoll's CUDA programs and tests" ${_qcoll_nccl_found})
if(QCOLL_ENABLE_NCCL AND NOT QCOLL_ENABLE_CUDA)
  message(FATAL_ERROR "qcoll: QCOLL_ENABLE_NCCL needs QCOLL_ENABLE_CUDA.")
endif()
if(QCOLL_ENABLE_NCCL AND NOT NCCL_FOUND)
  message(FATAL_ERROR "qcoll: QCOLL_ENABLE_NCCL is ON but nccl.h / libnccl were not found. "
                      "Set NCCL_ROOT to the NCCL installation or configure with -DQCOLL_ENABLE_NCCL=OFF.")
endif()

# --- How CTest launches MPI programs ----------------------------------------------------------
if(QCOLL_ENABLE_MPI)
  # Open MPI refuses to start as root and to place more ranks than cores unless told; CI runs as
  # root on two cores with up to 8 ranks. Other MPIs get no extra flags.
  set(_qcoll_mpiexec_default_flags "")
  if(MPIEXEC_EXECUTABLE)
    execute_process(COMMAND "${MPIEXEC_EXECUTABLE}" --version OUTPUT_VARIABLE _qcoll_mpiexec_version
                    ERROR_VARIABLE _qcoll_mpiexec_version RESULT_VARIABLE _qcoll_rc TIMEOUT 20)
    if(_qcoll_mpiexec_version MATCHES "Open MPI|OpenRTE|open-mpi")
      set(_qcoll_mpiexec_default_flags "--allow-run-as-root;--oversubscribe")
      set(QCOLL_MPI_IS_OPENMPI ON)
    endif()
  endif()
  set(QCOLL_MPIEXEC_FLAGS "${_qcoll_mpiexec_default_flags}" CACHE STRING
      "Extra mpiexec flags for qcoll's MPI tests, placed after the rank count")
  if(NOT MPIEXEC_EXECUTABLE)
    message(WARNING "qcoll: MPI found but no mpiexec; MPI tests are built but not registered.")
  endif()
endif()
