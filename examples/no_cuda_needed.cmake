# no_cuda_needed.cmake: none of BINARIES ('|'-separated) lists libcudart or
# libcuda as NEEDED, and each executable among them runs (exit 0) with
# LD_LIBRARY_PATH emptied and CUDA_VISIBLE_DEVICES hiding every GPU.
#   cmake -DREADELF=readelf -DBINARIES="a|b" -P no_cuda_needed.cmake
string(REPLACE "|" ";" _binaries "${BINARIES}")
foreach(_bin IN LISTS _binaries)
  execute_process(COMMAND "${READELF}" -d "${_bin}" OUTPUT_VARIABLE _dyn RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "readelf -d ${_bin} failed")
  endif()
  if(_dyn MATCHES "NEEDED[^\n]*(libcudart|libcuda\\.)")
    message(FATAL_ERROR "${_bin} needs a CUDA library at load time:\n${_dyn}")
  endif()
  if(NOT _bin MATCHES "\\.so")
    execute_process(COMMAND ${CMAKE_COMMAND} -E env LD_LIBRARY_PATH= CUDA_VISIBLE_DEVICES= "${_bin}"
      RESULT_VARIABLE _run OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
    if(NOT _run EQUAL 0)
      message(FATAL_ERROR "${_bin} failed without the CUDA libraries on the path (${_run}):\n${_out}\n${_err}")
    endif()
  endif()
  message(STATUS "${_bin}: no CUDA library needed")
endforeach()
