# The IPC handle parser's libFuzzer target (SPEC R3), included from the
# top-level CMakeLists.txt. When fuzz/CMakeLists.txt (issue 9) defines
# ccalloc_add_fuzzer, this file uses it; else it builds the target itself.
# Merge note: once fuzz/CMakeLists.txt exists, this whole file can become one
# line there: ccalloc_add_fuzzer(ipc_handle LIBS ccalloc_ipc_handle).
if(CCALLOC_BUILD_FUZZERS)
  if(COMMAND ccalloc_add_fuzzer)
    ccalloc_add_fuzzer(ipc_handle LIBS ccalloc_ipc_handle)
  else()
    # The parser's source is compiled into the target, so that it too is
    # instrumented for coverage (the library ccalloc_ipc_handle is not).
    add_executable(fuzz_ipc_handle ${CMAKE_CURRENT_LIST_DIR}/fuzz_ipc_handle.cpp
                   ${PROJECT_SOURCE_DIR}/src/frontend/ipc_handle.cpp)
    target_link_libraries(fuzz_ipc_handle PRIVATE ccalloc_base ccalloc_warnings)
    target_compile_options(fuzz_ipc_handle PRIVATE -fsanitize=fuzzer,address,undefined)
    target_link_options(fuzz_ipc_handle PRIVATE -fsanitize=fuzzer,address,undefined)
    add_test(NAME fuzz_ipc_handle_corpus
             COMMAND fuzz_ipc_handle -runs=0 ${CMAKE_CURRENT_LIST_DIR}/corpus/ipc_handle)
    set_tests_properties(fuzz_ipc_handle_corpus PROPERTIES LABELS "fuzz" TIMEOUT 120)
  endif()
endif()
