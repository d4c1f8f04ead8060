// A consumer of qcoll's host headers: checks the version and a bf16 round trip.
#include <qcoll/qcoll.hpp>

#include <cstdio>

int main() {
  if (qcoll::version() != QCOLL_VERSION) {
    std::fprintf(stderr, "qcoll::version() = %d, QCOLL_VERSION = %d\n", qcoll::version(), QCOLL_VERSION);
    return 1;
  }
  // 1.0 is exactly representable in bfloat16, so the round trip must return it unchanged.
  const qcoll::bfloat16 one = qcoll::from_float<qcoll::bfloat16>(1.0f);
  if (qcoll::to_float(one) != 1.0f) {
    std::fprintf(stderr, "bfloat16 round trip of 1.0 gave %g\n", static_cast<double>(qcoll::to_float(one)));
    return 2;
  }
  std::printf("qcoll %d.%d.%d\n", QCOLL_VERSION_MAJOR, QCOLL_VERSION_MINOR, QCOLL_VERSION_PATCH);
  return 0;
}
