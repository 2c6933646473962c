# What `cmake --install build [--prefix P]` puts where (GNUInstallDirs):
#   bin/                       flashckptd, flashckpt, flashckpt-sim (RPATH: $ORIGIN/../<libdir>)
#   <libdir>/                  libflashckpt.so.<version>, SONAME libflashckpt.so.1, libflashckpt.so
#   include/flashckpt/         the public headers
#   <libdir>/cmake/flashckpt/  find_package(flashckpt CONFIG) -> flashckpt::client
#   <libdir>/pkgconfig/        flashckpt.pc
#   lib/systemd/system/        flashckptd.service (ExecStart= names the installed daemon)
#   share/doc/flashckpt/       README.md, flashckptd.conf.example, each program's --help
# Components: programs, runtime (the library), dev (headers, CMake package, pkg-config, the .so
# link), service (unit, docs); python (client/python/CMakeLists.txt) for the Python package.
include(CMakePackageConfigHelpers)

install(TARGETS flashckptd flashckpt_cli flashckpt-sim RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT programs)

if(FLASHCKPT_BUILD_SHARED)
  install(TARGETS flashckpt_client EXPORT flashckptTargets
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev
          INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/client/include/flashckpt DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
          COMPONENT dev FILES_MATCHING PATTERN "*.h")
  install(EXPORT flashckptTargets NAMESPACE flashckpt:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/flashckpt
          FILE flashckptTargets.cmake COMPONENT dev)
  configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/flashckptConfig.cmake.in
                                ${PROJECT_BINARY_DIR}/install/flashckptConfig.cmake
                                INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/flashckpt)
  write_basic_package_version_file(${PROJECT_BINARY_DIR}/install/flashckptConfigVersion.cmake
                                   VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
  install(FILES ${PROJECT_BINARY_DIR}/install/flashckptConfig.cmake
                ${PROJECT_BINARY_DIR}/install/flashckptConfigVersion.cmake
          DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/flashckpt COMPONENT dev)
  # flashckpt.pc finds the prefix from its own place (${pcfiledir}), so an installed tree can move.
  file(RELATIVE_PATH FLASHCKPT_PC_TO_PREFIX /${CMAKE_INSTALL_LIBDIR}/pkgconfig /)
  string(REGEX REPLACE "/$" "" FLASHCKPT_PC_TO_PREFIX "${FLASHCKPT_PC_TO_PREFIX}")
  configure_file(${PROJECT_SOURCE_DIR}/cmake/flashckpt.pc.in ${PROJECT_BINARY_DIR}/install/flashckpt.pc @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/install/flashckpt.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig
          COMPONENT dev)
endif()

# The unit names the daemon where this install puts it.
file(READ ${PROJECT_SOURCE_DIR}/deploy/systemd/flashckptd.service _fc_unit)
string(REPLACE "/usr/local/bin/flashckptd" "${CMAKE_INSTALL_FULL_BINDIR}/flashckptd" _fc_unit "${_fc_unit}")
file(WRITE ${PROJECT_BINARY_DIR}/install/flashckptd.service "${_fc_unit}")
install(FILES ${PROJECT_BINARY_DIR}/install/flashckptd.service DESTINATION lib/systemd/system COMPONENT service)

# Each program's --help, as the built program prints it.
set(_fc_help_files)
foreach(_fc_prog flashckptd flashckpt_cli flashckpt-sim)
  get_target_property(_fc_name ${_fc_prog} OUTPUT_NAME)
  if(NOT _fc_name)
    set(_fc_name ${_fc_prog})
  endif()
  set(_fc_out ${PROJECT_BINARY_DIR}/install/doc/${_fc_name}.help.txt)
  add_custom_command(OUTPUT ${_fc_out}
                     COMMAND ${CMAKE_COMMAND} -E make_directory ${PROJECT_BINARY_DIR}/install/doc
                     COMMAND $<TARGET_FILE:${_fc_prog}> --help > ${_fc_out}
                     DEPENDS ${_fc_prog} COMMENT "Writing ${_fc_name} --help" VERBATIM)
  list(APPEND _fc_help_files ${_fc_out})
endforeach()
add_custom_target(flashckpt_help_docs ALL DEPENDS ${_fc_help_files})
install(FILES ${_fc_help_files} ${PROJECT_SOURCE_DIR}/README.md ${PROJECT_SOURCE_DIR}/deploy/flashckptd.conf.example
        DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT service)

# Debian packages (scripts/package.sh, from a build configured with CMAKE_INSTALL_PREFIX=/usr):
#   flashckptd        programs + service: the daemon, the CLI, the simulator, the unit, the docs;
#                     postinst creates the system user flashckpt and /var/lib/flashckpt, prerm
#                     stops the service, postrm (purge) removes the config postinst made
#   libflashckpt1     runtime: libflashckpt.so.1
#   libflashckpt-dev  dev: headers, the .so link, the CMake package and flashckpt.pc
# Dependencies on Debian's libraries come from dpkg-shlibdeps.
if(FLASHCKPT_BUILD_SHARED)
  set(CPACK_GENERATOR DEB)
  set(CPACK_PACKAGE_NAME flashckpt)
  set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
  set(CPACK_PACKAGE_CONTACT "flashckpt maintainers <flashckpt@localhost>")
  set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "per-node asynchronous checkpoint daemon for large-model training")
  set(CPACK_DEB_COMPONENT_INSTALL ON)
  set(CPACK_COMPONENTS_ALL programs service runtime dev)
  set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS ${CMAKE_LIBRARY_OUTPUT_DIRECTORY})
  set(CPACK_DEBIAN_PACKAGE_SECTION utils)
  set(CPACK_DEBIAN_DAEMON_PACKAGE_NAME flashckptd)
  set(CPACK_DEBIAN_DAEMON_PACKAGE_DEPENDS "libflashckpt1 (= ${PROJECT_VERSION})")
  set(CPACK_DEBIAN_DAEMON_PACKAGE_CONTROL_EXTRA ${PROJECT_SOURCE_DIR}/deploy/debian/postinst
      ${PROJECT_SOURCE_DIR}/deploy/debian/prerm ${PROJECT_SOURCE_DIR}/deploy/debian/postrm)
  set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME libflashckpt1)
  set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION libs)
  set(CPACK_DEBIAN_DEV_PACKAGE_NAME libflashckpt-dev)
  set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
  set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "libflashckpt1 (= ${PROJECT_VERSION})")
  include(CPack)
  cpack_add_component_group(daemon)
  cpack_add_component_group(runtime)
  cpack_add_component_group(dev)
  cpack_add_component(programs GROUP daemon)
  cpack_add_component(service GROUP daemon)
  cpack_add_component(runtime GROUP runtime)
  cpack_add_component(dev GROUP dev)
endif()
