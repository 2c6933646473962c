# Warning flags and sanitizers applied to every flashckpt target through flashckpt_warnings.
add_library(flashckpt_warnings INTERFACE)
target_compile_options(flashckpt_warnings INTERFACE -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
                                                    -Wno-unused-parameter)
if(FLASHCKPT_WERROR)
  target_compile_options(flashckpt_warnings INTERFACE -Werror)
endif()

if(FLASHCKPT_SANITIZE)
  string(REPLACE ";" "," _fc_san "${FLASHCKPT_SANITIZE}")
  add_compile_options(-fsanitize=${_fc_san} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  add_link_options(-fsanitize=${_fc_san})
endif()
