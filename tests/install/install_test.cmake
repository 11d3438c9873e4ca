# The install test (CTest "install_package"; SPEC E1): installs the build tree
# into a fresh prefix, builds the outside project in project/ against it with
# find_package(ccalloc CONFIG) (C++ on the static libraries, C on
# libccalloc.so and on the static libraries), builds project/consumer.c again
# with only `pkg-config --cflags --libs ccalloc`, and runs every program (on a
# simulated device; the process-wide allocator uses a GPU if there is one).
#
# cmake -DBUILD_DIR=... -DWORK_DIR=... -DGENERATOR=... [-DMAKE_PROGRAM=...]
#       -DC_COMPILER=... -DCXX_COMPILER=... -DPKG_CONFIG=... [-DEXPECT_CLI=ON]
#       -P install_test.cmake
cmake_minimum_required(VERSION 3.22)
set(PROJECT_DIR ${CMAKE_CURRENT_LIST_DIR}/project)
set(PREFIX ${WORK_DIR}/prefix)

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install test: ${what} failed (${rc}):\n${ARGN}\n${out}\n${err}")
  endif()
  set(run_out "${out}" PARENT_SCOPE)
endfunction()

function(run_program name)
  run("running ${name}" ${ARGN})
  if(NOT run_out MATCHES ": ok")
    message(FATAL_ERROR "install test: ${name} printed no 'ok':\n${run_out}")
  endif()
  message(STATUS "${run_out}")
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

# 1. install
run("cmake --install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${PREFIX})
file(GLOB_RECURSE _config ${PREFIX}/*/ccallocConfig.cmake)
file(GLOB_RECURSE _pc ${PREFIX}/*/pkgconfig/ccalloc.pc)
file(GLOB_RECURSE _shared ${PREFIX}/*/libccalloc.so)
foreach(_needed _config _pc _shared)
  if(NOT ${_needed})
    message(FATAL_ERROR "install test: nothing installed for ${_needed} under ${PREFIX}")
  endif()
endforeach()
foreach(_header ccalloc/ccalloc.h ccalloc/frontend/caching_allocator.hpp ccalloc/base/detail/pointer_map.hpp)
  if(NOT EXISTS ${PREFIX}/include/${_header})
    message(FATAL_ERROR "install test: ${PREFIX}/include/${_header} was not installed")
  endif()
endforeach()
if(EXISTS ${PREFIX}/include/ccalloc/replay)
  message(FATAL_ERROR "install test: the replay headers (tools layer) were installed")
endif()
if(EXPECT_CLI AND NOT EXISTS ${PREFIX}/bin/ccalloc)
  message(FATAL_ERROR "install test: the CLI was not installed to ${PREFIX}/bin/ccalloc")
endif()

# 2. find_package(ccalloc CONFIG)
set(_configure ${CMAKE_COMMAND} -S ${PROJECT_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${PREFIX} -DCMAKE_BUILD_TYPE=Release
    -DCMAKE_C_COMPILER=${C_COMPILER} -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
if(MAKE_PROGRAM)
  list(APPEND _configure -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM})
endif()
run("configuring the outside project" ${_configure})
run("building the outside project" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run_program(consumer_cpp ${WORK_DIR}/build/consumer_cpp)
run_program(consumer_c_shared ${WORK_DIR}/build/consumer_c_shared)
run_program(consumer_c_static ${WORK_DIR}/build/consumer_c_static)

# 3. pkg-config
if(NOT PKG_CONFIG)
  message(FATAL_ERROR "install test: pkg-config not found (scripts/deps.sh installs it)")
endif()
get_filename_component(_pc_dir ${_pc} DIRECTORY)
set(ENV{PKG_CONFIG_PATH} ${_pc_dir})
run("pkg-config --modversion" ${PKG_CONFIG} --modversion ccalloc)
string(STRIP "${run_out}" _version)
run("pkg-config --cflags --libs" ${PKG_CONFIG} --cflags --libs ccalloc)
separate_arguments(_flags UNIX_COMMAND "${run_out}")
run("pkg-config --variable=libdir" ${PKG_CONFIG} --variable=libdir ccalloc)
string(STRIP "${run_out}" _libdir)
run("compiling consumer.c with pkg-config's flags"
    ${C_COMPILER} -std=c99 -Wall -Wextra -Werror ${PROJECT_DIR}/consumer.c ${_flags} -Wl,-rpath,${_libdir}
    -o ${WORK_DIR}/consumer_pc)
run_program(consumer_pc ${WORK_DIR}/consumer_pc)
message(STATUS "install test: ok (ccalloc ${_version} in ${PREFIX}: find_package and pkg-config)")
