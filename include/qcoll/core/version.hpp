#pragma once
//! \file
//! qcoll's one version source. CMake reads QCOLL_VERSION from this file.

//! Version as one integer: major * 10000 + minor * 100 + patch.
#define QCOLL_VERSION 100

//! Major part of QCOLL_VERSION.
#define QCOLL_VERSION_MAJOR (QCOLL_VERSION / 10000)
//! Minor part of QCOLL_VERSION.
#define QCOLL_VERSION_MINOR (QCOLL_VERSION / 100 % 100)
//! Patch part of QCOLL_VERSION.
#define QCOLL_VERSION_PATCH (QCOLL_VERSION % 100)

#define QCOLL_DETAIL_CAT2(a, b) a##b
#define QCOLL_DETAIL_CAT(a, b) QCOLL_DETAIL_CAT2(a, b)

//! Name of the versioned inline namespace, e.g. `v100`. Two builds of different versions never
//! share a mangled name, so they cannot collide at link time.
#define QCOLL_ABI_NAMESPACE QCOLL_DETAIL_CAT(v, QCOLL_VERSION)

//! Opens `namespace qcoll { inline namespace vNNN {`.
#define QCOLL_NAMESPACE_BEGIN \
  namespace qcoll {           \
  inline namespace QCOLL_ABI_NAMESPACE {
//! Closes what QCOLL_NAMESPACE_BEGIN opened.
#define QCOLL_NAMESPACE_END \
  }                         \
  }

QCOLL_NAMESPACE_BEGIN
//! The version this header set was built as, at run time (same value as QCOLL_VERSION).
constexpr int version() noexcept { return QCOLL_VERSION; }
QCOLL_NAMESPACE_END
