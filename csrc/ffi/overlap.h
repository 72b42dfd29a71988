// FFI handler symbols of the overlap family (Python stem: jax_ub/overlap.py).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxUbAgGemm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxUbAllGather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxUbGemmRs);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxUbReduceScatter);
