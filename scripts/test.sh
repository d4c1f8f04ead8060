#!/usr/bin/env bash
# Installs missing Debian packages, configures build/, builds everything and runs every test.
# Usage: bash scripts/test.sh [extra ctest arguments, e.g. -L unit]
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

qcoll_install_packages
qcoll_configure
cmake --build "$BUILD_DIR" -j "$JOBS"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$CTEST_JOBS" "$@"
