# Third-party dependencies, all from Debian packages (scripts/deps.sh installs them).
find_package(Threads REQUIRED)
find_package(Protobuf REQUIRED)          # module mode: Debian ships no protobuf CMake config
find_package(gRPC CONFIG REQUIRED)
find_package(OpenSSL REQUIRED)          # the daemon's checks of TLS certificates (libssl-dev, as gRPC's)
find_package(Boost 1.74 REQUIRED)        # header-only: Boost.Interprocess, Boost.Beast (metrics)
find_package(spdlog CONFIG REQUIRED)
find_package(nlohmann_json CONFIG REQUIRED)
find_package(simdjson CONFIG REQUIRED)   # metadata.json of large jobs (common/format/metadata.cc)
find_package(CLI11 CONFIG REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
pkg_check_modules(URING REQUIRED IMPORTED_TARGET liburing)  # bench/write_bench: io_uring against threads
pkg_check_modules(ISAL REQUIRED IMPORTED_TARGET libisal)  # daemon/parity: Reed-Solomon (libisal-dev)
pkg_check_modules(SYSTEMD REQUIRED IMPORTED_TARGET libsystemd)  # daemon/observe/systemd_notify: sd_notify, watchdog

# The Python package (client/python) is built for the system interpreter, where Debian's
# python3-torch and python3-numpy live. Python3 must be found before pybind11 so that pybind11 uses
# the same interpreter (its FindPython mode).
if(NOT DEFINED Python3_EXECUTABLE AND EXISTS /usr/bin/python3)
  set(Python3_EXECUTABLE /usr/bin/python3 CACHE FILEPATH "Python interpreter the flashckpt package is built for")
endif()
find_package(Python3 COMPONENTS Interpreter Development)
if(Python3_FOUND)
  find_package(pybind11 CONFIG QUIET)
endif()
# A sanitized extension module cannot be loaded into an uninstrumented interpreter, so sanitizer
# builds leave the package out unless asked for.
set(_fc_python_default OFF)
if(Python3_FOUND AND pybind11_FOUND AND NOT FLASHCKPT_SANITIZE)
  set(_fc_python_default ON)
endif()
option(FLASHCKPT_WITH_PYTHON "Build the flashckpt Python package (needs Python3 development files and pybind11)"
       ${_fc_python_default})
if(FLASHCKPT_WITH_PYTHON AND NOT (Python3_FOUND AND pybind11_FOUND))
  message(FATAL_ERROR "FLASHCKPT_WITH_PYTHON is ON but Python3 (Interpreter, Development) or pybind11 was "
                      "not found; install python3-dev and pybind11-dev (scripts/deps.sh), or pass "
                      "-DFLASHCKPT_WITH_PYTHON=OFF")
endif()
