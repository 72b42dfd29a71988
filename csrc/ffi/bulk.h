// FFI handler symbol of the bulk family (Python stem: jax_ub/bulk.py).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxUbBulk);
