# GPU runtime shim (src/gpu/): which runtime backs libkvwire, and the compile of every GPU
# backend and kernel whose toolchain is present, so that CI proves they compile on machines
# without a GPU.
#
#   KVWIRE_GPU=auto|cuda|hip|none   libkvwire's backend. auto: cuda when nvcc and the CUDA
#                                   runtime are found, else hip when hipcc and libamdhip64 are,
#                                   else none. cuda wins in auto because the CUDA runtime is
#                                   linked statically (libcudart_static, which loads libcuda.so.1
#                                   only when first used), so libkvwire stays loadable on any
#                                   machine; libamdhip64 would become a hard dependency.
#                                   none: no GPU toolchain is looked at.
#   KVWIRE_GPU_BUILD_ALL=ON         also compile (and unit-test) the other backend found.
#   KVWIRE_CUDA_ROOT=/usr/local/cuda
#   KVWIRE_CUDA_ARCHS=90            SM architectures of the CUDA kernels (a ;-list).
#   KVWIRE_HIP_ARCHS=gfx90a;gfx940  AMD targets of the HIP kernels (Debian 12's ROCm 5.2 knows
#                                   these two; gfx942/gfx950 need a newer ROCm).
#
# Kernels (src/gpu/kernels/*.cu) are compiled by nvcc and hipcc through custom commands, not
# CMake's CUDA/HIP languages: the tree's global flags (sanitizers, -Wall) are host-compiler
# flags that must not reach nvcc, and hipcc here is Debian's wrapper around clang 15.
#
# Results for the top level: KVWIRE_GPU_LIB_SOURCES (objects for libkvwire),
# KVWIRE_GPU_LIB_LINK (its extra link libraries), and for the GPU unit tests
# KVWIRE_GPU_EXTRA_SOURCES / KVWIRE_GPU_EXTRA_LINK (the backends libkvwire does not hold).

set(KVWIRE_GPU auto CACHE STRING "GPU runtime of libkvwire: none | cuda | hip | auto")
set_property(CACHE KVWIRE_GPU PROPERTY STRINGS none cuda hip auto)
option(KVWIRE_GPU_BUILD_ALL "Also compile and unit-test the GPU backend libkvwire does not use" ON)
set(KVWIRE_CUDA_ROOT /usr/local/cuda CACHE PATH "CUDA toolkit root")
set(KVWIRE_CUDA_ARCHS 90 CACHE STRING "SM architectures of the CUDA kernels (;-list)")
set(KVWIRE_HIP_ARCHS "gfx90a;gfx940" CACHE STRING "AMD GPU targets of the HIP kernels (;-list)")
if(NOT KVWIRE_GPU MATCHES "^(none|cuda|hip|auto)$")
  message(FATAL_ERROR "KVWIRE_GPU=${KVWIRE_GPU}: expected none, cuda, hip or auto")
endif()

include(CheckCXXSourceCompiles)
# A header check without linking: compile `code` against `include_dir`.
function(kvwire_gpu_header_has out include_dir defs code)
  set(CMAKE_REQUIRED_INCLUDES ${include_dir})
  set(CMAKE_REQUIRED_DEFINITIONS ${defs})
  set(CMAKE_REQUIRED_QUIET ON)
  set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)
  # The result is cached under its own name (check_cxx_source_compiles skips a defined one).
  check_cxx_source_compiles("${code}" KVWIRE_CHECK_${out})
  if(KVWIRE_CHECK_${out})
    set(${out} 1 PARENT_SCOPE)
  else()
    set(${out} 0 PARENT_SCOPE)
  endif()
endfunction()

# --- CUDA toolchain ---------------------------------------------------------------------------
set(_cuda_found FALSE)
set(_cuda_why "KVWIRE_GPU=none")
set(KVWIRE_GPU_CUDA_HAS_DMABUF 0)
set(KVWIRE_NVCC_FOUND "")
set(KVWIRE_CUDA_INCLUDE_FOUND "")
if(NOT KVWIRE_GPU STREQUAL none)
  find_program(KVWIRE_NVCC nvcc HINTS ${KVWIRE_CUDA_ROOT}/bin)
  if(NOT KVWIRE_NVCC)
    set(_cuda_why "nvcc not found (looked in ${KVWIRE_CUDA_ROOT}/bin and PATH)")
  else()
    # The toolkit around the real nvcc (/usr/local/bin/nvcc is often a link into it).
    get_filename_component(_cuda_root ${KVWIRE_NVCC} REALPATH)
    get_filename_component(_cuda_root ${_cuda_root} DIRECTORY)
    get_filename_component(_cuda_root ${_cuda_root} DIRECTORY)
    find_path(KVWIRE_CUDA_INCLUDE cuda_runtime_api.h
      HINTS ${_cuda_root}/include ${_cuda_root}/targets/x86_64-linux/include NO_DEFAULT_PATH)
    find_library(KVWIRE_CUDART_STATIC libcudart_static.a
      HINTS ${_cuda_root}/lib64 ${_cuda_root}/targets/x86_64-linux/lib NO_DEFAULT_PATH)
    if(NOT KVWIRE_CUDA_INCLUDE OR NOT KVWIRE_CUDART_STATIC)
      set(_cuda_why "nvcc at ${KVWIRE_NVCC}, but no cuda_runtime_api.h or libcudart_static.a under ${_cuda_root}")
    else()
      set(_cuda_found TRUE)
      set(KVWIRE_NVCC_FOUND ${KVWIRE_NVCC})
      set(KVWIRE_CUDA_INCLUDE_FOUND ${KVWIRE_CUDA_INCLUDE})
      execute_process(COMMAND ${KVWIRE_NVCC} --version OUTPUT_VARIABLE _nvcc_version
                      ERROR_QUIET)
      string(REGEX MATCH "release [0-9.]+" _nvcc_version "${_nvcc_version}")
      kvwire_gpu_header_has(KVWIRE_GPU_CUDA_HAS_DMABUF ${KVWIRE_CUDA_INCLUDE} ""
        "#include <cuda.h>\nauto* f = &cuMemGetHandleForAddressRange;\nint x = CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD;\nint main() { return 0; }")
    endif()
  endif()
endif()

# --- HIP toolchain ----------------------------------------------------------------------------
set(_hip_found FALSE)
set(_hip_why "KVWIRE_GPU=none")
set(KVWIRE_GPU_HIP_HAS_HSA_DMABUF 0)
set(KVWIRE_GPU_HIP_HAS_HIP_DMABUF 0)
set(KVWIRE_HIPCC_FOUND "")
set(KVWIRE_HIP_INCLUDE_FOUND "")
set(_hip_defs -D__HIP_PLATFORM_AMD__ -D__HIP_PLATFORM_HCC__)
if(NOT KVWIRE_GPU STREQUAL none)
  find_program(KVWIRE_HIPCC hipcc HINTS /opt/rocm/bin)
  find_path(KVWIRE_HIP_INCLUDE hip/hip_runtime_api.h HINTS /opt/rocm/include)
  find_library(KVWIRE_AMDHIP64 amdhip64 HINTS /opt/rocm/lib)
  if(NOT KVWIRE_HIPCC OR NOT KVWIRE_HIP_INCLUDE OR NOT KVWIRE_AMDHIP64)
    set(_hip_why "hipcc, hip/hip_runtime_api.h or libamdhip64 not found (Debian: apt-get install hipcc libamdhip64-dev)")
  else()
    set(_hip_found TRUE)
    set(KVWIRE_HIPCC_FOUND ${KVWIRE_HIPCC})
    set(KVWIRE_HIP_INCLUDE_FOUND ${KVWIRE_HIP_INCLUDE})
    kvwire_gpu_header_has(KVWIRE_GPU_HIP_HAS_HSA_DMABUF ${KVWIRE_HIP_INCLUDE} "${_hip_defs}"
      "#include <hsa/hsa_ext_amd.h>\nauto* f = &hsa_amd_portable_export_dmabuf;\nint main() { return 0; }")
    kvwire_gpu_header_has(KVWIRE_GPU_HIP_HAS_HIP_DMABUF ${KVWIRE_HIP_INCLUDE} "${_hip_defs}"
      "#include <hip/hip_runtime_api.h>\nauto* f = &hipMemGetHandleForAddressRange;\nint x = hipMemRangeHandleTypeDmaBufFd;\nint main() { return 0; }")
  endif()
endif()

# --- choice ------------------------------------------------------------------------------------
if(KVWIRE_GPU STREQUAL cuda AND NOT _cuda_found)
  message(FATAL_ERROR "KVWIRE_GPU=cuda: ${_cuda_why}")
elseif(KVWIRE_GPU STREQUAL hip AND NOT _hip_found)
  message(FATAL_ERROR "KVWIRE_GPU=hip: ${_hip_why}")
endif()
set(KVWIRE_GPU_BACKEND none)
if(KVWIRE_GPU STREQUAL cuda OR (KVWIRE_GPU STREQUAL auto AND _cuda_found))
  set(KVWIRE_GPU_BACKEND cuda)
elseif(KVWIRE_GPU STREQUAL hip OR (KVWIRE_GPU STREQUAL auto AND _hip_found))
  set(KVWIRE_GPU_BACKEND hip)
endif()
set(_build_cuda FALSE)
set(_build_hip FALSE)
if(KVWIRE_GPU_BACKEND STREQUAL cuda OR (KVWIRE_GPU_BUILD_ALL AND _cuda_found))
  set(_build_cuda TRUE)
endif()
if(KVWIRE_GPU_BACKEND STREQUAL hip OR (KVWIRE_GPU_BUILD_ALL AND _hip_found))
  set(_build_hip TRUE)
endif()

if(KVWIRE_GPU_BACKEND STREQUAL none)
  if(KVWIRE_GPU STREQUAL none)
    set(KVWIRE_GPU_NONE_REASON "configured with KVWIRE_GPU=none")
  else()
    set(KVWIRE_GPU_NONE_REASON "KVWIRE_GPU=auto: ${_cuda_why}; ${_hip_why}")
  endif()
else()
  set(KVWIRE_GPU_NONE_REASON "the none backend; this build's default is ${KVWIRE_GPU_BACKEND}")
endif()
string(REPLACE "\"" "'" KVWIRE_GPU_NONE_REASON "${KVWIRE_GPU_NONE_REASON}")
foreach(b CUDA HIP)
  string(TOLOWER ${b} _b)
  set(KVWIRE_GPU_DEFAULT_${b} 0)
  if(KVWIRE_GPU_BACKEND STREQUAL _b)
    set(KVWIRE_GPU_DEFAULT_${b} 1)
  endif()
  set(KVWIRE_GPU_BUILT_${b} 0)
  if(_build_${_b})
    set(KVWIRE_GPU_BUILT_${b} 1)
  endif()
endforeach()
set(KVWIRE_GPU_BUILD_ALL_01 0)
if(KVWIRE_GPU_BUILD_ALL)
  set(KVWIRE_GPU_BUILD_ALL_01 1)
endif()
string(REPLACE ";" "," KVWIRE_CUDA_ARCHS_STR "${KVWIRE_CUDA_ARCHS}")
string(REPLACE ";" "," KVWIRE_HIP_ARCHS_STR "${KVWIRE_HIP_ARCHS}")

message(STATUS "kvwire gpu: libkvwire backend: ${KVWIRE_GPU_BACKEND} (KVWIRE_GPU=${KVWIRE_GPU})")
if(_cuda_found)
  message(STATUS "kvwire gpu: cuda: nvcc ${_nvcc_version} at ${KVWIRE_NVCC}; kernels for sm_${KVWIRE_CUDA_ARCHS_STR}; dma-buf export in headers: ${KVWIRE_GPU_CUDA_HAS_DMABUF}; built: ${_build_cuda}")
else()
  message(STATUS "kvwire gpu: cuda: not built: ${_cuda_why}")
endif()
if(_hip_found)
  message(STATUS "kvwire gpu: hip: hipcc at ${KVWIRE_HIPCC}; kernels for ${KVWIRE_HIP_ARCHS_STR}; dma-buf export in headers: hsa ${KVWIRE_GPU_HIP_HAS_HSA_DMABUF}, hip ${KVWIRE_GPU_HIP_HAS_HIP_DMABUF}; built: ${_build_hip}")
else()
  message(STATUS "kvwire gpu: hip: not built: ${_hip_why}")
endif()

configure_file(${CMAKE_CURRENT_LIST_DIR}/gpu_config.h.in ${KVWIRE_PROTO_OUT}/src/gpu/gpu_config.h
               @ONLY)

# --- targets -----------------------------------------------------------------------------------
kvwire_component(kvwire_gpu src/gpu/*.cc)
set(_kernel_sources ${CMAKE_CURRENT_SOURCE_DIR}/src/gpu/kernels/kv_record_encode.cu)

# Compiles `ARGN` (.cu files) with `backend`'s compiler into objects listed in `out` (under the
# calling directory's binary dir); kernels include from the repository root.
function(kvwire_gpu_kernels backend out)
  set(objs)
  foreach(src ${ARGN})
    get_filename_component(name ${src} NAME_WE)
    set(obj ${CMAKE_CURRENT_BINARY_DIR}/gpu/${backend}/${name}.o)
    if(backend STREQUAL cuda)
      set(arch_flags)
      foreach(a ${KVWIRE_CUDA_ARCHS})
        list(APPEND arch_flags -gencode arch=compute_${a},code=sm_${a})
      endforeach()
      # PTX of the newest architecture too, so that newer GPUs can JIT it.
      list(GET KVWIRE_CUDA_ARCHS -1 last)
      list(APPEND arch_flags -gencode arch=compute_${last},code=compute_${last})
      set(cmd ${KVWIRE_NVCC} -std=c++17 -O3 -Xcompiler=-fPIC ${arch_flags})
      if(CMAKE_CXX_COMPILER_LAUNCHER MATCHES ccache)
        list(PREPEND cmd ${CMAKE_CXX_COMPILER_LAUNCHER})
      endif()
    else()
      set(arch_flags)
      foreach(a ${KVWIRE_HIP_ARCHS})
        list(APPEND arch_flags --offload-arch=${a})
      endforeach()
      set(cmd ${KVWIRE_HIPCC} -x hip -std=c++17 -O3 -fPIC ${arch_flags})
    endif()
    add_custom_command(
      OUTPUT ${obj}
      COMMAND ${cmd} -I${PROJECT_SOURCE_DIR} -MD -MF ${obj}.d -c ${src} -o ${obj}
      DEPFILE ${obj}.d
      DEPENDS ${src}
      COMMENT "${backend} kernels: ${name}.cu"
      VERBATIM)
    list(APPEND objs ${obj})
  endforeach()
  set(${out} ${objs} PARENT_SCOPE)
endfunction()

set(KVWIRE_GPU_LIB_SOURCES $<TARGET_OBJECTS:kvwire_gpu>)
set(KVWIRE_GPU_LIB_LINK)
set(KVWIRE_GPU_EXTRA_SOURCES)
set(KVWIRE_GPU_EXTRA_LINK)
set(_all_kernel_objects)
# A backend's objects and libraries go into libkvwire when it is the configured backend, else
# into the extra set only the GPU tests link (so every backend is built and tested).
macro(kvwire_gpu_route backend srcs link)
  if(KVWIRE_GPU_BACKEND STREQUAL ${backend})
    list(APPEND KVWIRE_GPU_LIB_SOURCES ${srcs})
    list(APPEND KVWIRE_GPU_LIB_LINK ${link})
  else()
    list(APPEND KVWIRE_GPU_EXTRA_SOURCES ${srcs})
    list(APPEND KVWIRE_GPU_EXTRA_LINK ${link})
  endif()
endmacro()

if(_build_cuda)
  kvwire_component(kvwire_gpu_cuda src/gpu/cuda/*.cc)
  target_include_directories(kvwire_gpu_cuda SYSTEM PRIVATE ${KVWIRE_CUDA_INCLUDE})
  kvwire_gpu_kernels(cuda _cuda_kernels ${_kernel_sources})
  list(APPEND _all_kernel_objects ${_cuda_kernels})
  set(KVWIRE_GPU_CUDA_KERNEL_OBJECTS ${_cuda_kernels})
  kvwire_gpu_route(cuda "$<TARGET_OBJECTS:kvwire_gpu_cuda>;${_cuda_kernels}"
                   "${KVWIRE_CUDART_STATIC};${CMAKE_DL_LIBS};rt;Threads::Threads")
endif()
if(_build_hip)
  kvwire_component(kvwire_gpu_hip src/gpu/hip/*.cc)
  target_include_directories(kvwire_gpu_hip SYSTEM PRIVATE ${KVWIRE_HIP_INCLUDE})
  target_compile_definitions(kvwire_gpu_hip PRIVATE __HIP_PLATFORM_AMD__ __HIP_PLATFORM_HCC__)
  kvwire_gpu_kernels(hip _hip_kernels ${_kernel_sources})
  list(APPEND _all_kernel_objects ${_hip_kernels})
  set(KVWIRE_GPU_HIP_KERNEL_OBJECTS ${_hip_kernels})
  kvwire_gpu_route(hip "$<TARGET_OBJECTS:kvwire_gpu_hip>;${_hip_kernels}" "${KVWIRE_AMDHIP64}")
endif()
# Every kernel object is built by `ninja` (all), used or not: the compile must never rot.
add_custom_target(kvwire_gpu_kernels ALL DEPENDS ${_all_kernel_objects})
