// FFI handler symbols of the gemm family (Python stem: jax_ub/gemm.py).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxUbGemm);
