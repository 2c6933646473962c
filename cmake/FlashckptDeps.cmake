# Third-party dependencies, all from Debian packages (scripts/deps.sh installs them).
find_package(Threads REQUIRED)
find_package(Protobuf REQUIRED)          # module mode: Debian ships no protobuf CMake config
find_package(gRPC CONFIG REQUIRED)
find_package(Boost 1.74 REQUIRED)        # header-only Boost.Interprocess
find_package(spdlog CONFIG REQUIRED)
find_package(nlohmann_json CONFIG REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
