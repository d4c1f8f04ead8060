#!/usr/bin/env bash
# Installs missing Debian packages, configures build/, builds the demo and runs it: ZeRO-3 vs
# ZeRO++ training of a small model on 8 in-process ranks in 2 nodes.
# Usage: bash scripts/demo.sh [demo options; --help lists them]
set -euo pipefail

# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

qcoll_install_packages
qcoll_configure
cmake --build "$BUILD_DIR" -j "$JOBS" --target demo
# <build>/qcoll-executables.txt lists "<target><TAB><executable>" for every program of the build.
program="$(awk -F'\t' '$1 == "demo" { print $2; exit }' "$BUILD_DIR/qcoll-executables.txt")"
echo "running $program $*"
exec "$program" "$@"
