# python/flashattn_wheel_cuda.cmake — whether `pip install .` builds the CUDA backend, and for
# which architectures. Included by python/CMakeLists.txt before the core project is added; the C++
# build (root CMakeLists.txt, presets) is not affected: there FLASHATTN_CUDA stays OFF unless set.
#
# FLASHATTN_CUDA, from -Ccmake.define.FLASHATTN_CUDA=... or else the environment variable of that
# name: ON builds the CUDA backend (failing where it cannot), OFF builds a CPU-only package, AUTO
# (the default) builds it where nvcc is found and there is something to build for:
#   1. FLASHATTN_CUDA_ARCHS (environment), e.g. "80;90a" or "8.0 9.0";
#   2. TORCH_CUDA_ARCH_LIST (environment, PyTorch's spelling), e.g. "8.0;9.0+PTX";
#   3. the GPUs that nvidia-smi lists (their compute capabilities).
# Compute capability 9.0 is built as sm_90a, as scripts/demo does; below 8.0 there are no kernels.
# The CUTLASS headers the kernels compile against are installed by scripts/setup-cuda when missing.
# An explicit -DCMAKE_CUDA_ARCHITECTURES wins over the detected list. The decision and its reason
# are printed and kept in FLASHATTN_WHEEL_CUDA_SUMMARY (installed as flashattn/_build_config.py).

set(_flashattn_option_help "Build the CUDA backends (needs nvcc and CUTLASS headers)")

# A cache entry that the core's option() created in an earlier configure of a reused build
# directory is not a choice of the user's: it is dropped so that AUTO applies.
if(DEFINED CACHE{FLASHATTN_CUDA})
  get_property(_flashattn_help CACHE FLASHATTN_CUDA PROPERTY HELPSTRING)
  if(_flashattn_help STREQUAL _flashattn_option_help)
    unset(FLASHATTN_CUDA CACHE)
  endif()
endif()

if(DEFINED FLASHATTN_CUDA)
  set(_flashattn_request "${FLASHATTN_CUDA}")
  set(_flashattn_from "FLASHATTN_CUDA=${FLASHATTN_CUDA}")
elseif(DEFINED ENV{FLASHATTN_CUDA} AND NOT "$ENV{FLASHATTN_CUDA}" STREQUAL "")
  set(_flashattn_request "$ENV{FLASHATTN_CUDA}")
  set(_flashattn_from "environment FLASHATTN_CUDA=$ENV{FLASHATTN_CUDA}")
else()
  set(_flashattn_request AUTO)
  set(_flashattn_from "FLASHATTN_CUDA not set: AUTO")
endif()
string(TOUPPER "${_flashattn_request}" _flashattn_request)
if(_flashattn_request MATCHES "^(1|ON|TRUE|YES)$")
  set(_flashattn_request ON)
elseif(_flashattn_request MATCHES "^(0|OFF|FALSE|NO)$")
  set(_flashattn_request OFF)
elseif(NOT _flashattn_request STREQUAL "AUTO")
  message(FATAL_ERROR "flashattn: FLASHATTN_CUDA must be ON, OFF or AUTO; got '${_flashattn_request}'")
endif()

# "8.0;9.0+PTX", "80 90a", "sm_86" ... -> "80;90a;86" in CMake's spelling; below 8.0 dropped.
function(_flashattn_normalise_archs raw out_var)
  string(REGEX REPLACE "[ ,\n\t]+" ";" items "${raw}")
  set(archs "")
  foreach(item IN LISTS items)
    string(TOLOWER "${item}" item)
    string(REGEX REPLACE "\\+ptx$" "" item "${item}")
    string(REGEX REPLACE "^sm_" "" item "${item}")
    string(REPLACE "." "" item "${item}")
    if(NOT item MATCHES "^[0-9]+a?$")
      continue()
    endif()
    string(REGEX REPLACE "a$" "" number "${item}")
    if(number LESS 80)
      message(STATUS "flashattn: sm_${number} skipped: the CUDA kernels need sm_80 or newer")
      continue()
    endif()
    if(item STREQUAL "90")
      set(item 90a)
    endif()
    list(APPEND archs ${item})
  endforeach()
  list(REMOVE_DUPLICATES archs)
  set(${out_var} "${archs}" PARENT_SCOPE)
endfunction()

set(_flashattn_archs "")
set(_flashattn_archs_from "")
if(DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(_flashattn_archs "${CMAKE_CUDA_ARCHITECTURES}")
  set(_flashattn_archs_from "CMAKE_CUDA_ARCHITECTURES")
elseif(DEFINED ENV{FLASHATTN_CUDA_ARCHS} AND NOT "$ENV{FLASHATTN_CUDA_ARCHS}" STREQUAL "")
  _flashattn_normalise_archs("$ENV{FLASHATTN_CUDA_ARCHS}" _flashattn_archs)
  set(_flashattn_archs_from "FLASHATTN_CUDA_ARCHS=$ENV{FLASHATTN_CUDA_ARCHS}")
elseif(DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT "$ENV{TORCH_CUDA_ARCH_LIST}" STREQUAL "")
  _flashattn_normalise_archs("$ENV{TORCH_CUDA_ARCH_LIST}" _flashattn_archs)
  set(_flashattn_archs_from "TORCH_CUDA_ARCH_LIST=$ENV{TORCH_CUDA_ARCH_LIST}")
else()
  find_program(_flashattn_nvidia_smi nvidia-smi)
  if(_flashattn_nvidia_smi)
    execute_process(COMMAND ${_flashattn_nvidia_smi} --query-gpu=compute_cap --format=csv,noheader
                    RESULT_VARIABLE _flashattn_rc OUTPUT_VARIABLE _flashattn_caps ERROR_QUIET
                    OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(_flashattn_rc EQUAL 0 AND NOT _flashattn_caps STREQUAL "")
      _flashattn_normalise_archs("${_flashattn_caps}" _flashattn_archs)
      string(REGEX REPLACE "[\n]+" ", " _flashattn_caps "${_flashattn_caps}")
      set(_flashattn_archs_from "the GPUs nvidia-smi lists (compute capability ${_flashattn_caps})")
    endif()
  endif()
endif()

# nvcc: CUDACXX, then PATH, then CUDA_HOME / the usual install folder.
set(_flashattn_nvcc "")
if(DEFINED ENV{CUDACXX} AND EXISTS "$ENV{CUDACXX}")
  set(_flashattn_nvcc "$ENV{CUDACXX}")
else()
  find_program(_flashattn_nvcc_found nvcc HINTS "$ENV{CUDA_HOME}/bin" /usr/local/cuda/bin)
  if(_flashattn_nvcc_found)
    set(_flashattn_nvcc "${_flashattn_nvcc_found}")
  endif()
endif()

set(_flashattn_cutlass "${CMAKE_CURRENT_LIST_DIR}/../.deps/cutlass/include")
if(_flashattn_request STREQUAL "OFF")
  set(FLASHATTN_CUDA OFF)
  set(_flashattn_why "${_flashattn_from}")
elseif(_flashattn_request STREQUAL "ON")
  set(FLASHATTN_CUDA ON)
  set(_flashattn_why "${_flashattn_from}")
elseif(NOT _flashattn_nvcc)
  set(FLASHATTN_CUDA OFF)
  set(_flashattn_why "AUTO: no nvcc found (CUDACXX, PATH, CUDA_HOME)")
elseif(NOT _flashattn_archs)
  set(FLASHATTN_CUDA OFF)
  set(_flashattn_why "AUTO: nvcc found but no GPU visible and no FLASHATTN_CUDA_ARCHS / TORCH_CUDA_ARCH_LIST (sm_80 or newer)")
else()
  set(FLASHATTN_CUDA ON)
  set(_flashattn_why "AUTO: nvcc found, architectures from ${_flashattn_archs_from}")
  if(NOT EXISTS "${_flashattn_cutlass}/cute/tensor.hpp" AND NOT DEFINED FLASHATTN_CUTLASS_DIR)
    message(STATUS "flashattn: installing the CUTLASS headers (scripts/setup-cuda)")
    execute_process(COMMAND bash "${CMAKE_CURRENT_LIST_DIR}/../scripts/setup-cuda" RESULT_VARIABLE _flashattn_rc)
    # A GPU machine should not end up with a package that refuses its GPU's tensors at run time
    # for want of headers: the install stops and says how to go on.
    if(NOT _flashattn_rc EQUAL 0)
      message(FATAL_ERROR
        "flashattn: nvcc and ${_flashattn_archs_from} were found, so the CUDA backend is to be built, "
        "but scripts/setup-cuda could not install the CUTLASS headers it compiles against (no access to "
        "PyPI?). Install them (pip install the nvidia-cutlass version that scripts/setup-cuda names, or "
        "copy them to .deps/cutlass), or point -Ccmake.define.FLASHATTN_CUTLASS_DIR=<dir with cute/> at "
        "them; or build a CPU-only package with FLASHATTN_CUDA=OFF.")
    endif()
  endif()
endif()

if(FLASHATTN_CUDA)
  if(_flashattn_archs AND NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES "${_flashattn_archs}")
  endif()
  if(_flashattn_nvcc AND NOT DEFINED CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_COMPILER "${_flashattn_nvcc}")
  endif()
  set(_flashattn_built "CUDA backend built for sm ${CMAKE_CUDA_ARCHITECTURES}")
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(_flashattn_built "CUDA backend built for the core's default architectures")
  endif()
else()
  set(_flashattn_built "CPU-only (no CUDA backend)")
endif()
set(FLASHATTN_WHEEL_CUDA_SUMMARY "${_flashattn_built}: ${_flashattn_why}")
string(REPLACE "\"" "'" FLASHATTN_WHEEL_CUDA_SUMMARY "${FLASHATTN_WHEEL_CUDA_SUMMARY}")
message(STATUS "flashattn: ${FLASHATTN_WHEEL_CUDA_SUMMARY}")
