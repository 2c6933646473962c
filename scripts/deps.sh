#!/usr/bin/env bash
# Installs the Debian packages flashckpt builds and tests with. Idempotent: quiet when all are present.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git ccache
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libssl-dev
  libboost-dev libspdlog-dev nlohmann-json3-dev libcli11-dev libxxhash-dev
  libgtest-dev liburing-dev fio libsystemd-dev
  python3 python3-numpy python3-yaml
  python3-dev python3-torch python3-pybind11 pybind11-dev
  # tests/python/test_typing.py: the package's type hints, checked as the package and as a user sees them.
  mypy
  # tests/install: `pip install client/python` into a venv, offline; the Debian packages (dpkg-shlibdeps).
  python3-venv python3-pip python3-setuptools dpkg-dev
  # The fuzz pass (tests/fuzz): clang (/usr/bin/clang), its sanitizer and libFuzzer runtimes, and
  # llvm-symbolizer for the stacks in its reports.
  clang libclang-rt-dev llvm
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "deps: installing ${missing[*]}" >&2
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
$SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
