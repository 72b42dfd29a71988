// Shared by the binding files of the _jax_ub_cuda module (bind/*.cc): they decode arguments, call
// jax_ub's core, and turn a failed Status into a Python exception. No logic of their own.
#pragma once

#include <nanobind/nanobind.h>

#include <stdexcept>

#include "common/status.h"

namespace jax_ub {

namespace nb = nanobind;

// A failed Status as RuntimeError (its message).
inline void Raise(const Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message());
}

void BindNccl(nb::module_& m);   // bind/nccl.cc
void BindEnums(nb::module_& m);  // bind/enums.cc

}  // namespace jax_ub
