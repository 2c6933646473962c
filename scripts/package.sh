#!/usr/bin/env bash
# Builds the Debian packages flashckptd, libflashckpt1 and libflashckpt-dev into build-package/
# (a build of its own, configured for /usr; no tests, no Python package). Prints the .deb paths.
#   scripts/package.sh            install them: dpkg -i build-package/*.deb
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
JOBS="${FLASHCKPT_JOBS:-$(nproc)}"
# FLASHCKPT_PACKAGE_CMAKE_ARGS: more configure arguments (the packaging test passes the -Werror of
# scripts/test.sh's build/, so that the compiler cache, when there is one, already holds every object).
GENERATOR=()
if command -v ninja >/dev/null && [ ! -f build-package/Makefile ]; then GENERATOR=(-G Ninja); fi
# shellcheck disable=SC2086  # the extra arguments are words
cmake -S . -B build-package "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_INSTALL_PREFIX=/usr \
  -DFLASHCKPT_BUILD_TESTS=OFF -DFLASHCKPT_WITH_PYTHON=OFF ${FLASHCKPT_PACKAGE_CMAKE_ARGS:-} >/dev/null
cmake --build build-package -j"$JOBS"
rm -f build-package/*.deb
(cd build-package && cpack -G DEB >/dev/null)
ls -1 "$PWD"/build-package/*.deb
