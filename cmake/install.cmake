# `cmake --install` puts the headers, libqkv, the qkv CLI and a CMake package in place, so that
# `find_package(qkv CONFIG)` gives the target qkv::qkv.
include(CMakePackageConfigHelpers)

# The layers' public headers; detail/ holds what the layers above share but users do not call.
set(QKV_HEADER_EXCLUDES PATTERN detail EXCLUDE)
if(NOT QKV_WITH_VIZ)
  list(APPEND QKV_HEADER_EXCLUDES PATTERN viz EXCLUDE)
endif()
if(NOT MPI_CXX_FOUND)
  list(APPEND QKV_HEADER_EXCLUDES PATTERN dist EXCLUDE)
endif()
install(DIRECTORY include/qkv DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} ${QKV_HEADER_EXCLUDES})
install(TARGETS qkv EXPORT qkvTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(MPI_CXX_FOUND)
  install(TARGETS qkv_mpi EXPORT qkvTargets LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
endif()
if(QKV_BUILD_APPS)
  install(TARGETS qkv_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

set(QKV_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/qkv)
install(EXPORT qkvTargets NAMESPACE qkv:: DESTINATION ${QKV_CMAKE_DIR})
configure_package_config_file(cmake/qkvConfig.cmake.in ${CMAKE_CURRENT_BINARY_DIR}/qkvConfig.cmake
  INSTALL_DESTINATION ${QKV_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/qkvConfigVersion.cmake
  COMPATIBILITY SameMajorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/qkvConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/qkvConfigVersion.cmake
  DESTINATION ${QKV_CMAKE_DIR})
