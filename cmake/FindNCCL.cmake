# FindNCCL
# --------
# Finds NVIDIA's NCCL: nccl.h and libnccl.
#
# Looks in NCCL_ROOT (CMake variable or environment, searched first by find_package itself),
# NCCL_HOME (environment), the CUDA toolkit
# (CUDAToolkit_INCLUDE_DIRS / CUDAToolkit_LIBRARY_DIR when find_package(CUDAToolkit) ran first)
# and the standard system paths.
#
# Result variables: NCCL_FOUND, NCCL_INCLUDE_DIRS, NCCL_LIBRARIES, NCCL_VERSION.
# Cache variables: NCCL_INCLUDE_DIR, NCCL_LIBRARY.
# Imported target: NCCL::nccl (shared library; its include directory; CUDA::cudart when known,
# since nccl.h includes cuda_runtime.h).

find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ENV NCCL_HOME ${CUDAToolkit_INCLUDE_DIRS} "${CUDAToolkit_LIBRARY_ROOT}"
  PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl
  HINTS ENV NCCL_HOME "${CUDAToolkit_LIBRARY_DIR}" "${CUDAToolkit_LIBRARY_ROOT}"
  PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu)
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)

set(NCCL_VERSION "")
if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines
       REGEX "^#define[ \t]+NCCL_(MAJOR|MINOR|PATCH)[ \t]+[0-9]+")
  foreach(_nccl_part IN ITEMS MAJOR MINOR PATCH)
    set(_nccl_${_nccl_part} "")
    foreach(_nccl_line IN LISTS _nccl_version_lines)
      if(_nccl_line MATCHES "NCCL_${_nccl_part}[ \t]+([0-9]+)")
        set(_nccl_${_nccl_part} "${CMAKE_MATCH_1}")
      endif()
    endforeach()
  endforeach()
  if(NOT _nccl_MAJOR STREQUAL "" AND NOT _nccl_MINOR STREQUAL "" AND NOT _nccl_PATCH STREQUAL "")
    set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
  endif()
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND)
  set(NCCL_INCLUDE_DIRS "${NCCL_INCLUDE_DIR}")
  set(NCCL_LIBRARIES "${NCCL_LIBRARY}")
  if(NOT TARGET NCCL::nccl)
    add_library(NCCL::nccl UNKNOWN IMPORTED)
    set_target_properties(NCCL::nccl PROPERTIES
      IMPORTED_LOCATION "${NCCL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
    if(TARGET CUDA::cudart)
      set_property(TARGET NCCL::nccl APPEND PROPERTY INTERFACE_LINK_LIBRARIES CUDA::cudart)
    endif()
  endif()
endif()
