// Test hooks: FFI handlers that no jax_ub op calls.
//
// jax_ub_test_unwritten returns success and writes nothing into its result. The GPU tests fill the
// allocator with NaN buffers before an op ("poison") so that an element the op leaves unwritten
// reads NaN; tests/gpu/test_poison.py calls this handler to show that the poison does reach an
// output nobody writes. If XLA's allocator stopped handing the freed block back, that test fails
// instead of every "poisoned output" check silently checking nothing.
#include "ffi/test_hooks.h"

#include "ffi/common.h"

namespace jax_ub {
namespace {

ffi::Error TestUnwrittenExecute(ffi::Result<ffi::AnyBuffer> out) {
  (void)out;
  return ffi::Error::Success();
}

}  // namespace

// clang-format off: the Bind() slots and their comments as a table
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxUbTestUnwritten, TestUnwrittenExecute,
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());  // left as it was
// clang-format on

}  // namespace jax_ub
