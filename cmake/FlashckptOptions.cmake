# Warning flags and sanitizers applied to every flashckpt target through flashckpt_warnings.
add_library(flashckpt_warnings INTERFACE)
target_compile_options(flashckpt_warnings INTERFACE -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
                                                    -Wno-unused-parameter)
# Clang checks the lock annotations (common/base/thread_annotations.h): GUARDED_BY, REQUIRES, EXCLUDES.
if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  target_compile_options(flashckpt_warnings INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Wthread-safety>)
endif()
if(FLASHCKPT_WERROR)
  target_compile_options(flashckpt_warnings INTERFACE -Werror)
endif()

# Fuzzing (tests/fuzz): libFuzzer comes with clang only. Every target is compiled with libFuzzer's
# coverage instrumentation and, unless told otherwise, AddressSanitizer + UndefinedBehaviorSanitizer;
# the fuzz targets alone link libFuzzer's main (-fsanitize=fuzzer).
if(FLASHCKPT_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang" OR NOT CMAKE_C_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "FLASHCKPT_FUZZ needs clang (libFuzzer), found ${CMAKE_CXX_COMPILER_ID}: configure a fresh "
                        "build directory with CC=clang CXX=clang++ (scripts/deps.sh installs clang)")
  endif()
  if(NOT FLASHCKPT_SANITIZE)
    set(FLASHCKPT_SANITIZE "address;undefined")
  elseif(NOT FLASHCKPT_SANITIZE MATCHES "address")
    message(FATAL_ERROR "FLASHCKPT_FUZZ runs under AddressSanitizer; FLASHCKPT_SANITIZE='${FLASHCKPT_SANITIZE}' "
                        "cannot be combined with it")
  endif()
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=fuzzer-no-link>)
endif()

if(FLASHCKPT_SANITIZE)
  string(REPLACE ";" "," _fc_san "${FLASHCKPT_SANITIZE}")
  # C and C++ only: nvcc (CUDA sources) does not take these flags.
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=${_fc_san};-fno-omit-frame-pointer;-fno-sanitize-recover=all>")
  add_link_options(-fsanitize=${_fc_san})
endif()

# CUDA: the client's device-to-host snapshot path and restore to device memory (runtime API only;
# the GPU tests add a small kernel). AUTO turns it on where nvcc and the CUDA toolkit are found, and
# leaves it off in sanitizer and fuzzing builds (nvcc does not take their flags, and CUDA's driver
# needs ASAN_OPTIONS=protect_shadow_gap=0); ON requires it; OFF builds without it.
set(FLASHCKPT_WITH_CUDA AUTO CACHE STRING "Build the CUDA path: AUTO (where nvcc and the toolkit are found), ON, OFF")
set_property(CACHE FLASHCKPT_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${FLASHCKPT_WITH_CUDA}" _fc_cuda_mode)
if(NOT _fc_cuda_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "FLASHCKPT_WITH_CUDA must be AUTO, ON or OFF, got '${FLASHCKPT_WITH_CUDA}'")
endif()
set(FLASHCKPT_CUDA OFF)
if(_fc_cuda_mode STREQUAL "OFF")
  message(STATUS "CUDA: off (FLASHCKPT_WITH_CUDA=OFF)")
elseif(_fc_cuda_mode STREQUAL "AUTO" AND (FLASHCKPT_SANITIZE OR FLASHCKPT_FUZZ))
  message(STATUS "CUDA: off (FLASHCKPT_WITH_CUDA=AUTO leaves it out of sanitizer and fuzzing builds)")
else()
  # nvcc is often not on PATH: look where the toolkit installs it.
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    find_program(FLASHCKPT_NVCC nvcc HINTS /usr/local/cuda/bin)
    if(FLASHCKPT_NVCC)
      set(CMAKE_CUDA_COMPILER ${FLASHCKPT_NVCC})
    endif()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)  # A100, H100: a fixed list, so the build is the same on every host
    endif()
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    enable_language(CUDA)
    find_package(CUDAToolkit)
  endif()
  if(CMAKE_CUDA_COMPILER AND CUDAToolkit_FOUND)
    set(FLASHCKPT_CUDA ON)
    message(STATUS "CUDA: on (toolkit ${CUDAToolkit_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES})")
  elseif(_fc_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "FLASHCKPT_WITH_CUDA=ON but nvcc or the CUDA toolkit was not found; install the toolkit "
                        "(e.g. under /usr/local/cuda), set CUDACXX to nvcc, or pass -DFLASHCKPT_WITH_CUDA=OFF")
  else()
    message(STATUS "CUDA: off (nvcc or the CUDA toolkit not found)")
  endif()
endif()
