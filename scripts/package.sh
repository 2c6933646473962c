#!/usr/bin/env bash
# Builds the Debian packages flashckptd, libflashckpt1 and libflashckpt-dev into build-package/
# (a build of its own, configured for /usr; no tests, no Python package). Prints the .deb paths.
#   scripts/package.sh            install them: dpkg -i build-package/*.deb
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
JOBS="${FLASHCKPT_JOBS:-$(nproc)}"
cmake -S . -B build-package -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_INSTALL_PREFIX=/usr \
  -DFLASHCKPT_BUILD_TESTS=OFF -DFLASHCKPT_WITH_PYTHON=OFF >/dev/null
cmake --build build-package -j"$JOBS"
rm -f build-package/*.deb
(cd build-package && cpack -G DEB >/dev/null)
ls -1 "$PWD"/build-package/*.deb
