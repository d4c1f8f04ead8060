// The message of the qcoll::Error a callable raises, for tests that check error texts.
#pragma once

#include <string>

#include <qcoll/core/error.hpp>

namespace testing_support {

//! Runs fn(); returns the qcoll::Error message it raised, or "no error".
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const qcoll::Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace testing_support
