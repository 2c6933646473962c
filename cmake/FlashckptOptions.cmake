# Warning flags and sanitizers applied to every flashckpt target through flashckpt_warnings.
add_library(flashckpt_warnings INTERFACE)
target_compile_options(flashckpt_warnings INTERFACE -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
                                                    -Wno-unused-parameter)
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
  add_compile_options(-fsanitize=fuzzer-no-link)
endif()

if(FLASHCKPT_SANITIZE)
  string(REPLACE ";" "," _fc_san "${FLASHCKPT_SANITIZE}")
  add_compile_options(-fsanitize=${_fc_san} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  add_link_options(-fsanitize=${_fc_san})
endif()
