// FFI handler symbols that exist for jax_ub's own tests only (no jax_ub op calls them).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxUbTestUnwritten);
