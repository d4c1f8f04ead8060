# shellcheck shell=bash
# Sourced by scripts/demo.sh and scripts/test.sh.
#
# Environment:
#   BUILD_DIR         build directory (default: <repo>/build)
#   JOBS              parallel build jobs (default: 2)
#   CTEST_JOBS        tests run at once (default: 2; a test with more ranks than that, PROCESSORS in
#                     tests/CMakeLists.txt, runs alone)
#   QCOLL_CMAKE_ARGS  extra arguments for the CMake configure step (word-split)

QCOLL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$QCOLL_ROOT/build}"
JOBS="${JOBS:-2}"
CTEST_JOBS="${CTEST_JOBS:-2}"

# Debian packages needed to build and test qcoll. The CUDA toolkit is optional and not installed
# here; when /usr/local/cuda/bin/nvcc exists the CUDA programs are built as well.
QCOLL_DEBIAN_PACKAGES=(cmake make ninja-build g++ doctest-dev libopenmpi-dev openmpi-bin)
# Additional packages of the checks in scripts/fuzz.sh and scripts/sanitize.sh: clang with
# libFuzzer and its sanitizer runtimes (libclang-rt-dev holds libclang_rt.fuzzer and .asan) for
# the fuzz targets and the ASan tree; GCC's TSan runtime (libtsan) comes with g++.
# shellcheck disable=SC2034 # used by scripts/fuzz.sh and scripts/sanitize.sh
QCOLL_CHECK_PACKAGES=(cmake make ninja-build g++ doctest-dev libopenmpi-dev openmpi-bin clang libclang-rt-dev)

# Installs the missing packages of the given list (default: QCOLL_DEBIAN_PACKAGES) with apt-get
# update + install, nothing when all are present. Without dpkg/apt-get (not Debian) it only checks
# that cmake and a C++ compiler exist.
qcoll_install_packages() {
  if ((${#} == 0)); then
    set -- "${QCOLL_DEBIAN_PACKAGES[@]}"
  fi
  if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
    command -v cmake >/dev/null 2>&1 || { echo "error: cmake not found" >&2; return 1; }
    command -v c++ >/dev/null 2>&1 || { echo "error: no C++ compiler (c++) found" >&2; return 1; }
    return 0
  fi
  local missing=() package
  for package in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'; then
      missing+=("$package")
    fi
  done
  if ((${#missing[@]} == 0)); then
    return 0
  fi
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    sudo=(sudo)
  fi
  echo "installing missing packages: ${missing[*]}"
  "${sudo[@]}" apt-get update
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
}

# Appends `-G Ninja` to the array named $2 when build directory $1 is new and ninja is installed
# (see qcoll_configure).
qcoll_generator_args() {
  local -n qcoll_args_out="$2"
  if [ ! -f "$1/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then
    qcoll_args_out+=(-G Ninja)
  fi
}

# Configures $BUILD_DIR (Release, compile_commands.json, nvcc from /usr/local/cuda when present).
# A new build directory uses Ninja where it is installed: it keeps both cores busy across targets,
# where Make's per-target steps leave one idle for minutes of a full build. An existing build
# directory keeps the generator it was made with.
qcoll_configure() {
  local args=(-S "$QCOLL_ROOT" -B "$BUILD_DIR" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)
  qcoll_generator_args "$BUILD_DIR" args
  local nvcc=/usr/local/cuda/bin/nvcc
  if [ -x "$nvcc" ] && ! grep -q '^CMAKE_CUDA_COMPILER:' "$BUILD_DIR/CMakeCache.txt" 2>/dev/null; then
    args+=("-DCMAKE_CUDA_COMPILER=$nvcc")
  fi
  # shellcheck disable=SC2206
  args+=(${QCOLL_CMAKE_ARGS:-})
  cmake "${args[@]}"
}
