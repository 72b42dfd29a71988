# The fingerprint of the extension's sources: sha256 over "<path>\n<sha256 of the file>\n" for every
# C++/CUDA file under a directory (paths relative to it, '/'-separated, in byte order).
# jax_ub/_ext.py (source_hash) computes the same from a source checkout's csrc/ and warns when the
# loaded extension was built from other sources. Keep the two in sync (tests/cpu/test_source_hash.py).
#
# Script mode, for that test: cmake -DJAX_UB_HASH_DIR=<dir> -P cmake/source_hash.cmake

set(JAX_UB_SOURCE_PATTERNS *.cc *.cu *.h *.cuh *.cpp *.hpp)

# out_var: the hash; files_var (optional): the absolute paths hashed, for CMAKE_CONFIGURE_DEPENDS.
function(jax_ub_source_hash dir out_var)
  set(_globs "")
  foreach(_p IN LISTS JAX_UB_SOURCE_PATTERNS)
    list(APPEND _globs "${dir}/${_p}")
  endforeach()
  file(GLOB_RECURSE _files RELATIVE "${dir}" ${_globs})
  list(SORT _files)  # byte order, as Python's sorted() of ASCII paths
  set(_manifest "")
  set(_abs "")
  foreach(_f IN LISTS _files)
    file(SHA256 "${dir}/${_f}" _h)
    string(APPEND _manifest "${_f}\n${_h}\n")
    list(APPEND _abs "${dir}/${_f}")
  endforeach()
  string(SHA256 _hash "${_manifest}")
  set(${out_var} "${_hash}" PARENT_SCOPE)
  if(ARGC GREATER 2)
    set(${ARGV2} "${_abs}" PARENT_SCOPE)
  endif()
endfunction()

if(CMAKE_SCRIPT_MODE_FILE AND DEFINED JAX_UB_HASH_DIR)
  jax_ub_source_hash("${JAX_UB_HASH_DIR}" _jax_ub_hash)
  message("${_jax_ub_hash}")
endif()
