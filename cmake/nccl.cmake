# Defines the interface target `llaisys_nccl` when NCCL can be found: a system install (nccl.h and
# libnccl.so on the usual paths or under NCCL_ROOT), or the `nvidia-nccl-cu13` wheel
# (site-packages/nvidia/nccl/{include,lib}). Tensor parallelism on CUDA needs it; a CUDA build without it
# still builds and says so (llaisys.build_info()["nccl"] is None).
find_path(_llaisys_nccl_inc nccl.h HINTS ENV NCCL_ROOT PATH_SUFFIXES include)
find_library(_llaisys_nccl_lib NAMES nccl libnccl.so.2 HINTS ENV NCCL_ROOT PATH_SUFFIXES lib lib64)
if(NOT (_llaisys_nccl_inc AND _llaisys_nccl_lib))
  find_package(Python 3.9 COMPONENTS Interpreter QUIET)
  if(Python_Interpreter_FOUND)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c "import nvidia.nccl as n; print(';'.join(n.__path__))"
      OUTPUT_VARIABLE _llaisys_nccl_dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  foreach(_dir IN LISTS _llaisys_nccl_dirs)
    if(EXISTS "${_dir}/include/nccl.h" AND EXISTS "${_dir}/lib/libnccl.so.2")
      set(_llaisys_nccl_inc "${_dir}/include")
      set(_llaisys_nccl_lib "${_dir}/lib/libnccl.so.2")
      message(STATUS "llaisys: NCCL from the nvidia-nccl-cu13 wheel at ${_dir}")
      break()
    endif()
  endforeach()
endif()
if(_llaisys_nccl_inc AND _llaisys_nccl_lib)
  add_library(llaisys_nccl INTERFACE)
  target_include_directories(llaisys_nccl INTERFACE "${_llaisys_nccl_inc}")
  target_link_libraries(llaisys_nccl INTERFACE "${_llaisys_nccl_lib}")
endif()
