// The slice of the NCCL C API that jax_ub calls, declared here so the build needs no NCCL headers
// (the library itself is dlopen()ed at run time from jax's nvidia-nccl-cu12/-cu13 wheel, never
// linked). Values and layouts are those of the public nccl.h (stable since NCCL 2.x);
// comm/nccl_api_check.cc static_asserts every one of them, and every function signature, against
// the real header whenever one is found at build time.
//
// ncclConfig_t is a versioned struct that grows from release to release: NCCL reads `size` bytes of
// it, checks `magic`, and gives every field newer than `version` its default. jax_ub declares only
// the leading fields it sets (ConfigPrefix, version 2.14.0) to create nonblocking communicators.
#pragma once

#include <cuda_runtime_api.h>  // cudaStream_t

#include <cstddef>

namespace jax_ub::nccl {

// ncclResult_t. A distinct enum (not a bare int) so that api_check can map our types one-to-one
// onto the real ones; 32 bits like the real enum, which is all the calling convention sees.
enum Result : int {
  kSuccess = 0,
  kUnhandledCudaError = 1,
  kSystemError = 2,
  kInternalError = 3,
  kInvalidArgument = 4,
  kInvalidUsage = 5,
  kRemoteError = 6,
  kInProgress = 7,
  kTimeout = 8,
};

// ncclDataType_t (only the values jax_ub may use).
enum DataType : int {
  kInt8 = 0,
  kUint8 = 1,
  kInt32 = 2,
  kUint32 = 3,
  kInt64 = 4,
  kUint64 = 5,
  kFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  kBfloat16 = 9,
};

// ncclRedOp_t (built-in operators).
enum RedOp : int {
  kSum = 0,
  kProd = 1,
  kMax = 2,
  kMin = 3,
  kAvg = 4,
};

// ncclUniqueId: NCCL_UNIQUE_ID_BYTES opaque bytes, passed by value to ncclCommInitRank.
constexpr size_t kUniqueIdBytes = 128;
struct UniqueId {
  char internal[kUniqueIdBytes];
};

// The leading fields of ncclConfig_t (NCCL >= 2.14), filled as NCCL_CONFIG_INITIALIZER would for
// a caller built against nccl.h 2.14.0 that sets `blocking`; `size` covers these fields only.
struct ConfigPrefix {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
};
constexpr unsigned int kConfigMagic = 0xcafebeef;
constexpr unsigned int kConfigVersion = 21400;  // NCCL_VERSION(2, 14, 0)

// ncclComm_t: an opaque pointer.
struct CommOpaque;
using Comm = CommOpaque*;

// Function types, one per entry point (names as in nccl.h without the "nccl" prefix).
using GetVersionFn = Result(int* version);
using GetUniqueIdFn = Result(UniqueId* unique_id);
using CommInitRankFn = Result(Comm* comm, int nranks, UniqueId comm_id, int rank);
using CommInitRankConfigFn = Result(Comm* comm, int nranks, UniqueId comm_id, int rank,
                                    ConfigPrefix* config);
using CommDestroyFn = Result(Comm comm);
using CommAbortFn = Result(Comm comm);
using CommGetAsyncErrorFn = Result(Comm comm, Result* async_error);
using GetErrorStringFn = const char*(Result result);
using GetLastErrorFn = const char*(Comm comm);  // comm may be null
using GroupStartFn = Result();
using GroupEndFn = Result();
using SendFn = Result(const void* sendbuff, size_t count, DataType datatype, int peer, Comm comm,
                      cudaStream_t stream);
using RecvFn = Result(void* recvbuff, size_t count, DataType datatype, int peer, Comm comm,
                      cudaStream_t stream);
using AllGatherFn = Result(const void* sendbuff, void* recvbuff, size_t sendcount,
                           DataType datatype, Comm comm, cudaStream_t stream);
using CommCountFn = Result(Comm comm, int* count);
using CommUserRankFn = Result(Comm comm, int* rank);

}  // namespace jax_ub::nccl
