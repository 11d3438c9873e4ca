# cli_expect.cmake: runs a command and checks its exit status and output, for
# the CLI tests in tests/CMakeLists.txt.
#
#   cmake -DEXE=path -DARGS="a|b|c" [-DEXPECT_RC=N] [-DEXPECT_STDOUT=regex]
#         [-DEXPECT_STDERR=regex] [-DWRITE_FILE=path -DWRITE_LINES="l1|l2"]
#         -P cli_expect.cmake
#
#         [-DREJECT_ESC=ON]
#
# ARGS and WRITE_LINES are '|'-separated (a ';' would be split by add_test).
# WRITE_FILE, when given, is written first with WRITE_LINES, one per line
# (an empty WRITE_LINES writes an empty file); "<ESC>" in WRITE_LINES is
# the escape character (0x1b); "@FILE@" in ARGS is replaced by its path.
# "<EMPTY>" in ARGS is an empty argument (e.g. -o|<EMPTY> for -o '').
# REJECT_ESC fails the test when stdout or stderr holds an escape character.
# EXPECT_RC defaults to 0. An empty value is the same as none (so a caller
# may pass every -D).
if("${EXPECT_RC}" STREQUAL "")
  set(EXPECT_RC 0)
endif()
string(ASCII 27 _esc)
string(REPLACE "|" ";" _args "${ARGS}")
if(NOT "${WRITE_FILE}" STREQUAL "")
  if(WRITE_LINES STREQUAL "")
    file(WRITE "${WRITE_FILE}" "")
  else()
    string(REPLACE "|" "\n" _text "${WRITE_LINES}")
    string(REPLACE "<ESC>" "${_esc}" _text "${_text}")
    file(WRITE "${WRITE_FILE}" "${_text}\n")
  endif()
  string(REPLACE "@FILE@" "${WRITE_FILE}" _args "${_args}")
endif()
if("${_args}" MATCHES "<EMPTY>")
  # A CMake list cannot pass an empty argument: run through sh, each argument
  # single-quoted, "<EMPTY>" as ''.
  set(_cmd "'${EXE}'")
  foreach(_a IN LISTS _args)
    if(_a STREQUAL "<EMPTY>")
      string(APPEND _cmd " ''")
    else()
      string(APPEND _cmd " '${_a}'")
    endif()
  endforeach()
  execute_process(COMMAND sh -c "${_cmd}"
    RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
else()
  execute_process(COMMAND "${EXE}" ${_args}
    RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
endif()
set(_shown "command: ${EXE} ${_args}\nexit status: ${_rc}\nstdout:\n${_out}\nstderr:\n${_err}")
if(NOT _rc STREQUAL "${EXPECT_RC}")
  message(FATAL_ERROR "expected exit status ${EXPECT_RC}\n${_shown}")
endif()
if(NOT "${EXPECT_STDOUT}" STREQUAL "" AND NOT _out MATCHES "${EXPECT_STDOUT}")
  message(FATAL_ERROR "stdout does not match '${EXPECT_STDOUT}'\n${_shown}")
endif()
if(NOT "${EXPECT_STDERR}" STREQUAL "" AND NOT _err MATCHES "${EXPECT_STDERR}")
  message(FATAL_ERROR "stderr does not match '${EXPECT_STDERR}'\n${_shown}")
endif()
if(REJECT_ESC AND ("${_out}${_err}" MATCHES "${_esc}"))
  message(FATAL_ERROR "the output holds a raw escape character\n${_shown}")
endif()
