# Install rules: libkvwire.so (with its SONAME link), the public headers, a CMake package
# (find_package(kvwire) -> kvwire::kvwire) and a pkg-config file (kvwire.pc).
#
#   cmake --install build [--prefix DIR]
#
# Only the shared library is exported. Its object libraries and PRIVATE dependencies
# (protobuf, OpenSSL, ibverbs, most of abseil) stay inside the .so; consumers see only what
# the public headers need: abseil's status, statusor, time and span.
include(CMakePackageConfigHelpers)

set(KVWIRE_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvwire)

# The public headers use std::optional and friends.
target_compile_features(kvwire PUBLIC cxx_std_17)

install(TARGETS kvwire EXPORT kvwireTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/include/kvwire
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h")

# --- CMake package ------------------------------------------------------------------------
install(EXPORT kvwireTargets
  NAMESPACE kvwire::
  FILE kvwireTargets.cmake
  DESTINATION ${KVWIRE_CMAKE_INSTALL_DIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/kvwireConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/kvwireConfig.cmake
  INSTALL_DESTINATION ${KVWIRE_CMAKE_INSTALL_DIR})
# 0.x: a minor release may break the API, so only the same major.minor is compatible.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/kvwireConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/kvwireConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/kvwireConfigVersion.cmake
  DESTINATION ${KVWIRE_CMAKE_INSTALL_DIR})

# --- pkg-config ---------------------------------------------------------------------------
# The prefix is only known at install time (`cmake --install --prefix` overrides the one
# configured), so kvwire.pc is made in two steps: everything but the prefix now, the prefix
# when installing. The placeholder survives the first step because it expands to itself.
set(KVWIRE_PC_PREFIX "@KVWIRE_PC_PREFIX@")
foreach(dir LIBDIR INCLUDEDIR)  # relative to the prefix unless configured absolute
  if(IS_ABSOLUTE "${CMAKE_INSTALL_${dir}}")
    set(KVWIRE_PC_${dir} "${CMAKE_INSTALL_${dir}}")
  else()
    set(KVWIRE_PC_${dir} "\${prefix}/${CMAKE_INSTALL_${dir}}")
  endif()
endforeach()
configure_file(${CMAKE_CURRENT_LIST_DIR}/kvwire.pc.in ${CMAKE_CURRENT_BINARY_DIR}/kvwire.pc.in @ONLY)
install(CODE "
  set(KVWIRE_PC_PREFIX \"\${CMAKE_INSTALL_PREFIX}\")
  configure_file(\"${CMAKE_CURRENT_BINARY_DIR}/kvwire.pc.in\"
                 \"${CMAKE_CURRENT_BINARY_DIR}/kvwire.pc\" @ONLY)")
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/kvwire.pc
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
