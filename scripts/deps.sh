#!/usr/bin/env bash
# Installs the Debian packages flashckpt builds and tests with, then makes the Python environment of
# the torch 2 and Paddle tests and benchmarks (see torch2_venv below). Idempotent: quiet when all is present.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git ccache
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libssl-dev
  libboost-dev libspdlog-dev nlohmann-json3-dev libsimdjson-dev libcli11-dev libxxhash-dev
  libgtest-dev liburing-dev fio libsystemd-dev
  # daemon/parity: Intel's ISA-L, its Reed-Solomon code.
  libisal-dev
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
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
  $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The torch 2 environment (PaddlePaddle's too): a virtual environment of /usr/bin/python3 (the
# Python the extension module is built for; not a python3 that comes first on PATH) with the pinned
# packages of client/python/requirements-torch2.txt, from PyPI. The tests that need it
# (tests/python/CMakeLists.txt: FLASHCKPT_TORCH2_PYTHON) run with its python.
# - An environment whose stamp holds the sha256 of the requirements file is taken as it is: no pip.
# - Any other is brought to the file from a folder of wheels (FLASHCKPT_WHEELS), which `pip download`
#   fills and never downloads into twice: a run that stopped half way, a changed pin or a deleted
#   environment downloads only what the folder lacks. (pip's own HTTP cache is not enough: it keeps
#   nothing of a server that sends no caching headers, as some mirrors and proxies do.)
# - Without PyPI it says so on stderr and goes on (exit 0): the build and the other tests need none
#   of it, and the tests that do are reported skipped, with the reason.
torch2_venv() {
  local venv="${FLASHCKPT_VENV:-$HOME/.cache/flashckpt/venv}"
  local wheels="${FLASHCKPT_WHEELS:-$HOME/.cache/flashckpt/wheels}"
  local reqs
  reqs="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/client/python/requirements-torch2.txt"
  local stamp="$venv/flashckpt-requirements.sha256" want
  want=$(sha256sum "$reqs" | cut -d' ' -f1)
  if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  echo "deps: preparing the torch 2 environment $venv from $reqs (about 4 GB of wheels the first time)" >&2
  local started=$SECONDS
  if [ ! -x "$venv/bin/python" ]; then
    mkdir -p "$(dirname "$venv")"
    if ! /usr/bin/python3 -m venv "$venv"; then
      echo "deps: ERROR: '/usr/bin/python3 -m venv $venv' failed (python3-venv missing?): the torch 2 tests" \
           "and benchmarks will be skipped" >&2
      return 0
    fi
  fi
  rm -f "$stamp"
  local pip=("$venv/bin/python" -m pip --no-input -q)
  if ! "${pip[@]}" download --progress-bar off --only-binary :all: -d "$wheels" -r "$reqs" >&2; then
    echo "deps: ERROR: could not download the packages of $reqs into $wheels (is PyPI reachable?): the" \
         "torch 2 tests and benchmarks will be skipped, saying so. Run scripts/deps.sh again once it is;" \
         "the wheels already in $wheels are not downloaded again." >&2
    return 0
  fi
  local downloaded=$SECONDS
  if ! "${pip[@]}" install --no-index --find-links "$wheels" -r "$reqs" >&2; then
    echo "deps: ERROR: could not install $reqs into $venv from $wheels: the torch 2 tests and benchmarks" \
         "will be skipped" >&2
    return 0
  fi
  echo "$want" >"$stamp"
  echo "deps: torch 2 environment ready: $venv ($(du -sh "$venv" | cut -f1)); download" \
       "$((downloaded - started)) s, install $((SECONDS - downloaded)) s" >&2
}
torch2_venv
