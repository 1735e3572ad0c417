# Defines the interface target `llaisys_cublas` (cuBLAS + cuBLASLt) when they can be found, either in
# the CUDA toolkit or in the `nvidia-cublas` wheel (site-packages/nvidia/cu13 or nvidia/cublas).
find_package(CUDAToolkit QUIET)
if(TARGET CUDA::cublas AND TARGET CUDA::cublasLt)
  add_library(llaisys_cublas INTERFACE)
  target_link_libraries(llaisys_cublas INTERFACE CUDA::cublas CUDA::cublasLt)
  return()
endif()

find_package(Python 3.9 COMPONENTS Interpreter QUIET)
if(Python_Interpreter_FOUND)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import nvidia, os; print(';'.join(os.path.join(p, d) for p in nvidia.__path__ for d in ('cu13', 'cublas')))"
    OUTPUT_VARIABLE _llaisys_wheel_dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
foreach(_dir IN LISTS _llaisys_wheel_dirs)
  if(EXISTS "${_dir}/include/cublas_v2.h")
    file(GLOB _cublas "${_dir}/lib/libcublas.so*")
    file(GLOB _cublaslt "${_dir}/lib/libcublasLt.so*")
    if(_cublas AND _cublaslt)
      list(GET _cublas 0 _cublas)
      list(GET _cublaslt 0 _cublaslt)
      add_library(llaisys_cublas INTERFACE)
      target_include_directories(llaisys_cublas INTERFACE "${_dir}/include")
      target_link_libraries(llaisys_cublas INTERFACE "${_cublas}" "${_cublaslt}")
      message(STATUS "llaisys: cuBLAS from the nvidia-cublas wheel at ${_dir}")
      return()
    endif()
  endif()
endforeach()
