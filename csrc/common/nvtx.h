// NVTX ranges in the "jax_ub" domain, so that Nsight Systems (or any NVTX tool) shows each op and,
// nested in it, each chunk copy and chunk GEMM as they are enqueued on the host thread (the tool
// projects them onto the GPU streams they launched work on). The message is the op or step name
// (a static string: no formatting on the op path); the payload is the op's epoch or the chunk's
// source rank. NVTX v3 is header-only: with no tool attached each call is an indirect call to a
// no-op. Built without the NVTX headers (a toolkit that lacks them), the functions do nothing.
#pragma once

#include <cstdint>

#if defined(__has_include)
#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define JAX_UB_HAVE_NVTX 1
#endif
#endif

namespace jax_ub::nvtx {

#ifdef JAX_UB_HAVE_NVTX
inline constexpr bool kCompiled = true;

inline nvtxDomainHandle_t Domain() {
  static const nvtxDomainHandle_t domain = nvtxDomainCreateA("jax_ub");
  return domain;
}

// ARGB colours: ops blue, GEMMs green, copies orange.
inline uint32_t ColorOf(const char* name) {
  if (name[0] == 'g') return 0xff2e8b57;  // "gemm"
  if (name[0] == 'a' || name[0] == 'm' || name[0] == 'b') return 0xff4169e1;  // op names
  return 0xffff8c00;  // "copy", "local_copy", "publish", "reduce", ...
}

inline void Push(const char* name, int64_t payload) {
  nvtxEventAttributes_t a = {};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.colorType = NVTX_COLOR_ARGB;
  a.color = ColorOf(name);
  a.payloadType = NVTX_PAYLOAD_TYPE_INT64;
  a.payload.llValue = payload;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = name;
  nvtxDomainRangePushEx(Domain(), &a);
}

inline void Pop() { nvtxDomainRangePop(Domain()); }
#else
inline constexpr bool kCompiled = false;
inline void Push(const char*, int64_t) {}
inline void Pop() {}
#endif

}  // namespace jax_ub::nvtx
