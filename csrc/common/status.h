// Status: the error value of jax_ub's core (no XLA headers here). FFI handlers convert it to
// ffi::Error at the boundary; nothing in jax_ub calls exit() or abort().
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>
#include <type_traits>
#include <utility>

namespace jax_ub {

class Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status Error(std::string msg) { return Status(std::move(msg)); }
  bool ok() const { return !failed_; }
  const std::string& message() const { return msg_; }

 private:
  explicit Status(std::string msg) : failed_(true), msg_(std::move(msg)) {}
  bool failed_ = false;
  std::string msg_;
};

// Builds a message from streamed parts: Error(StrCat() << "x=" << x). Deliberately not built on
// iostreams: a process may hold several C++ runtimes (jaxlib's, ours), and locale-based number
// formatting across them has crashed; to_string/snprintf need no locale facets.
class StrCat {
 public:
  StrCat& operator<<(const std::string& v) {
    s_ += v;
    return *this;
  }
  StrCat& operator<<(const char* v) {
    s_ += (v == nullptr ? "(null)" : v);
    return *this;
  }
  StrCat& operator<<(char v) {
    s_ += v;
    return *this;
  }
  StrCat& operator<<(bool v) {
    s_ += v ? "true" : "false";
    return *this;
  }
  StrCat& operator<<(const void* v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%p", v);
    s_ += buf;
    return *this;
  }
  template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
  StrCat& operator<<(T v) {
    s_ += std::to_string(v);
    return *this;
  }
  operator std::string() const { return s_; }  // NOLINT(google-explicit-constructor)
  const std::string& str() const { return s_; }

 private:
  std::string s_;
};

}  // namespace jax_ub

#define JAX_UB_STRINGIFY_(x) #x
#define JAX_UB_STRINGIFY(x) JAX_UB_STRINGIFY_(x)
#define JAX_UB_WHERE __FILE__ ":" JAX_UB_STRINGIFY(__LINE__)

// Returns a Status naming the call, the CUDA error and file:line when a CUDA runtime call fails.
#define JAX_UB_CUDA_RETURN(expr)                                                              \
  do {                                                                                        \
    cudaError_t jax_ub_err_ = (expr);                                                         \
    if (jax_ub_err_ != cudaSuccess) {                                                         \
      return ::jax_ub::Status::Error(                                                         \
          ::jax_ub::StrCat() << #expr << " failed: " << cudaGetErrorName(jax_ub_err_) << " (" \
                             << cudaGetErrorString(jax_ub_err_) << ") at " << JAX_UB_WHERE);  \
    }                                                                                         \
  } while (0)

// Propagates a failed Status, prefixing context.
#define JAX_UB_RETURN_IF_ERROR(expr)         \
  do {                                       \
    ::jax_ub::Status jax_ub_st_ = (expr);    \
    if (!jax_ub_st_.ok()) return jax_ub_st_; \
  } while (0)
