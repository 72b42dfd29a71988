// Compile-time check that comm/nccl_api.h matches the real nccl.h, when CMakeLists.txt found one
// at configure time (the nvidia-nccl wheel's include/ or the CUDA toolkit's) and defined
// JAX_UB_HAVE_NCCL_H for this file alone. Nothing here runs; the library is never linked.
#include "comm/nccl_api.h"

#if defined(JAX_UB_HAVE_NCCL_H) && __has_include(<nccl.h>)
#include <nccl.h>

#include <cstddef>
#include <type_traits>

namespace jax_ub::nccl {
namespace {

// Maps each of our declared types onto its counterpart in nccl.h (recursively through pointers,
// const and function types), so a whole signature can be compared with std::is_same.
template <typename T>
struct Real {
  using type = T;
};
template <typename T>
using RealT = typename Real<T>::type;
template <>
struct Real<Result> {
  using type = ncclResult_t;
};
template <>
struct Real<DataType> {
  using type = ncclDataType_t;
};
template <>
struct Real<RedOp> {
  using type = ncclRedOp_t;
};
template <>
struct Real<UniqueId> {
  using type = ncclUniqueId;
};
template <>
struct Real<ConfigPrefix> {
  using type = ncclConfig_t;
};
template <>
struct Real<CommOpaque> {
  using type = ::ncclComm;
};
template <typename T>
struct Real<T*> {
  using type = RealT<T>*;
};
template <typename T>
struct Real<const T> {
  using type = const RealT<T>;
};
template <typename R, typename... A>
struct Real<R(A...)> {
  using type = RealT<R>(RealT<A>...);
};

template <typename Ours, typename Theirs>
constexpr bool kSame = std::is_same_v<RealT<Ours>, Theirs>;

constexpr int I(int v) { return v; }

// Types: same size and alignment, hence the same calling convention.
static_assert(std::is_same_v<Comm, CommOpaque*> && kSame<Comm, ncclComm_t>);
static_assert(sizeof(Result) == sizeof(ncclResult_t) && alignof(Result) == alignof(ncclResult_t));
static_assert(sizeof(DataType) == sizeof(ncclDataType_t) &&
              alignof(DataType) == alignof(ncclDataType_t));
static_assert(sizeof(RedOp) == sizeof(ncclRedOp_t) && alignof(RedOp) == alignof(ncclRedOp_t));
static_assert(kUniqueIdBytes == NCCL_UNIQUE_ID_BYTES);
static_assert(sizeof(UniqueId) == sizeof(ncclUniqueId) &&
              alignof(UniqueId) == alignof(ncclUniqueId));
static_assert(offsetof(UniqueId, internal) == offsetof(ncclUniqueId, internal));

// ncclResult_t
static_assert(I(kSuccess) == I(ncclSuccess));
static_assert(I(kUnhandledCudaError) == I(ncclUnhandledCudaError));
static_assert(I(kSystemError) == I(ncclSystemError));
static_assert(I(kInternalError) == I(ncclInternalError));
static_assert(I(kInvalidArgument) == I(ncclInvalidArgument));
static_assert(I(kInvalidUsage) == I(ncclInvalidUsage));
static_assert(I(kRemoteError) == I(ncclRemoteError));
static_assert(I(kInProgress) == I(ncclInProgress));
// kTimeout (8) is only in newer headers (2.32 has it, 2.28 does not); we only ever print it.

// ncclDataType_t
static_assert(I(kInt8) == I(ncclInt8) && I(kUint8) == I(ncclUint8));
static_assert(I(kInt32) == I(ncclInt32) && I(kUint32) == I(ncclUint32));
static_assert(I(kInt64) == I(ncclInt64) && I(kUint64) == I(ncclUint64));
static_assert(I(kFloat16) == I(ncclFloat16) && I(kFloat32) == I(ncclFloat32));
static_assert(I(kFloat64) == I(ncclFloat64) && I(kBfloat16) == I(ncclBfloat16));

// ncclRedOp_t
static_assert(I(kSum) == I(ncclSum) && I(kProd) == I(ncclProd) && I(kMax) == I(ncclMax));
static_assert(I(kMin) == I(ncclMin) && I(kAvg) == I(ncclAvg));

// Entry points.
static_assert(kSame<GetVersionFn, decltype(ncclGetVersion)>);
static_assert(kSame<GetUniqueIdFn, decltype(ncclGetUniqueId)>);
static_assert(kSame<CommInitRankFn, decltype(ncclCommInitRank)>);
static_assert(kSame<CommInitRankConfigFn, decltype(ncclCommInitRankConfig)>);
// ConfigPrefix: the leading fields of ncclConfig_t, at the same offsets and of the same types.
static_assert(offsetof(ConfigPrefix, size) == offsetof(ncclConfig_t, size));
static_assert(offsetof(ConfigPrefix, magic) == offsetof(ncclConfig_t, magic));
static_assert(offsetof(ConfigPrefix, version) == offsetof(ncclConfig_t, version));
static_assert(offsetof(ConfigPrefix, blocking) == offsetof(ncclConfig_t, blocking));
static_assert(std::is_same_v<decltype(ncclConfig_t::size), size_t> &&
              std::is_same_v<decltype(ncclConfig_t::magic), unsigned int> &&
              std::is_same_v<decltype(ncclConfig_t::version), unsigned int> &&
              std::is_same_v<decltype(ncclConfig_t::blocking), int>);
static_assert(kConfigVersion == NCCL_VERSION(2, 14, 0));
static_assert(alignof(ConfigPrefix) <= alignof(ncclConfig_t));
static_assert(kSame<CommDestroyFn, decltype(ncclCommDestroy)>);
static_assert(kSame<CommAbortFn, decltype(ncclCommAbort)>);
static_assert(kSame<CommGetAsyncErrorFn, decltype(ncclCommGetAsyncError)>);
static_assert(kSame<GetErrorStringFn, decltype(ncclGetErrorString)>);
static_assert(kSame<GetLastErrorFn, decltype(ncclGetLastError)>);
static_assert(kSame<GroupStartFn, decltype(ncclGroupStart)>);
static_assert(kSame<GroupEndFn, decltype(ncclGroupEnd)>);
static_assert(kSame<SendFn, decltype(ncclSend)>);
static_assert(kSame<RecvFn, decltype(ncclRecv)>);
static_assert(kSame<AllGatherFn, decltype(ncclAllGather)>);
static_assert(kSame<CommCountFn, decltype(ncclCommCount)>);
static_assert(kSame<CommUserRankFn, decltype(ncclCommUserRank)>);

}  // namespace
}  // namespace jax_ub::nccl
#define JAX_UB_NCCL_API_CHECKED NCCL_VERSION_CODE
#else
#define JAX_UB_NCCL_API_CHECKED 0
#endif

namespace jax_ub {
// NCCL_VERSION_CODE of the nccl.h our declarations were checked against; 0 when none was found.
int NcclApiCheckedVersion() { return JAX_UB_NCCL_API_CHECKED; }
}  // namespace jax_ub
