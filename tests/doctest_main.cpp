// The one doctest main() shared by every tests/unit/test_*.cpp executable.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
