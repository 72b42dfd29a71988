#include "gemm/cublaslt.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <tuple>
#include <vector>

#include "common/dynlib.h"
#include "gemm/cublaslt_api.h"

namespace jax_ub {

#define JAX_UB_DTYPE_NAME(name, text, value) \
  case DType::name: return text;
const char* DTypeName(DType t) {
  switch (t) { JAX_UB_DTYPES(JAX_UB_DTYPE_NAME) }
  return "unknown";
}
#undef JAX_UB_DTYPE_NAME

size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : IsFp8(t) ? 1 : 2; }

std::string GemmTypes::Problem() const {
  const bool same = a == b && b == out;
  if (!IsFp8(a) && !IsFp8(b)) {
    if (fast_accum) {
      return StrCat() << "fast accumulation applies to FP8 GEMMs only; got " << Describe(*this);
    }
    return same ? std::string()
                : StrCat() << "a, b and the result must share one of float32, float16, bfloat16; "
                              "got "
                           << Describe(*this);
  }
  if (!IsFp8(a) || !IsFp8(b)) {
    return StrCat() << "an FP8 GEMM takes two FP8 operands (float8_e4m3fn or float8_e5m2); got "
                    << Describe(*this);
  }
  if (a == DType::kE5M2 && b == DType::kE5M2) {
    return StrCat() << "FP8 operands must be e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3 (cuBLASLt "
                       "has no e5m2 x e5m2 kernel); got "
                    << Describe(*this);
  }
  if (out != DType::kBF16 && out != DType::kF32) {
    return StrCat() << "an FP8 GEMM writes bfloat16 or float32; got " << Describe(*this);
  }
  return std::string();
}

int GemmTypes::Code() const {
  if (a == b && b == out && !fast_accum) return static_cast<int>(a);
  return static_cast<int>(a) | (static_cast<int>(b) + 1) << 8 | (static_cast<int>(out) + 1) << 16 |
         (fast_accum ? 1 : 0) << 24;
}

GemmTypes GemmTypes::FromCode(int code) {
  const DType a = static_cast<DType>(code & 0xff);
  const int b = (code >> 8) & 0xff, out = (code >> 16) & 0xff;
  return GemmTypes{a, b ? static_cast<DType>(b - 1) : a, out ? static_cast<DType>(out - 1) : a,
                   ((code >> 24) & 1) != 0};
}

std::string Describe(const GemmTypes& t) {
  if (t.a == t.b && t.b == t.out && !t.fast_accum) return DTypeName(t.a);
  return StrCat() << DTypeName(t.a) << " x " << DTypeName(t.b) << " -> " << DTypeName(t.out)
                  << (t.fast_accum ? ", fast accumulation" : "");
}

namespace {

cudaDataType CudaType(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kF16: return CUDA_R_16F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kE4M3: return CUDA_R_8F_E4M3;
    case DType::kE5M2: return CUDA_R_8F_E5M2;
  }
  return CUDA_R_32F;
}

// The loaded library and its entry points.
struct Api {
  DynLib lib;
  lt::CreateFn* Create = nullptr;
  lt::GetVersionFn* GetVersion = nullptr;
  lt::GetStatusStringFn* GetStatusString = nullptr;
  lt::MatmulDescCreateFn* MatmulDescCreate = nullptr;
  lt::MatmulDescDestroyFn* MatmulDescDestroy = nullptr;
  lt::MatmulDescSetAttributeFn* MatmulDescSetAttribute = nullptr;
  lt::MatrixLayoutCreateFn* MatrixLayoutCreate = nullptr;
  lt::MatrixLayoutDestroyFn* MatrixLayoutDestroy = nullptr;
  lt::MatmulPreferenceCreateFn* MatmulPreferenceCreate = nullptr;
  lt::MatmulPreferenceDestroyFn* MatmulPreferenceDestroy = nullptr;
  lt::MatmulPreferenceSetAttributeFn* MatmulPreferenceSetAttribute = nullptr;
  lt::MatmulAlgoGetHeuristicFn* MatmulAlgoGetHeuristic = nullptr;
  lt::MatmulFn* Matmul = nullptr;
  Status load_status;

  Status Load() {
    std::vector<std::string> candidates = LibraryCandidates("cublasLt");
    candidates.push_back("libcublasLt.so.13");
    candidates.push_back("libcublasLt.so.12");
    JAX_UB_RETURN_IF_ERROR(lib.Open("cuBLASLt (libcublasLt.so)", candidates));
    JAX_UB_RETURN_IF_ERROR(lib.Sym("cublasLtCreate", &Create));
    JAX_UB_RETURN_IF_ERROR(lib.Sym("cublasLtGetVersion", &GetVersion));
    JAX_UB_RETURN_IF_ERROR(lib.Sym("cublasLtGetStatusString", &GetStatusString));
    JAX_UB_RETURN_IF_ERROR(lib.Sym("cublasLtMatmulDescCreate", &MatmulDescCreate));
    JAX_UB_RETURN_IF_ERROR(lib.Sym("cublasLtMatmulDescDestroy", &MatmulDescDestroy));
    JAX_UB_RETURN_IF_ERROR(lib.Sym("cublasLtMatmulDescSetAttribute", &MatmulDescSetAttribute));
    JAX_UB_RETURN_IF_ERROR(lib.Sym("cublasLtMatrixLayoutCreate", &MatrixLayoutCreate));
    JAX_UB_RETURN_IF_ERROR(lib.Sym("cublasLtMatrixLayoutDestroy", &MatrixLayoutDestroy));
    JAX_UB_RETURN_IF_ERROR(lib.Sym("cublasLtMatmulPreferenceCreate", &MatmulPreferenceCreate));
    JAX_UB_RETURN_IF_ERROR(lib.Sym("cublasLtMatmulPreferenceDestroy", &MatmulPreferenceDestroy));
    JAX_UB_RETURN_IF_ERROR(
        lib.Sym("cublasLtMatmulPreferenceSetAttribute", &MatmulPreferenceSetAttribute));
    JAX_UB_RETURN_IF_ERROR(lib.Sym("cublasLtMatmulAlgoGetHeuristic", &MatmulAlgoGetHeuristic));
    JAX_UB_RETURN_IF_ERROR(lib.Sym("cublasLtMatmul", &Matmul));
    return Status::Ok();
  }

  std::string Err(lt::Status s) const {
    return StrCat() << (GetStatusString ? GetStatusString(s) : "CUBLAS_STATUS_?") << " (" << s
                    << ")";
  }
};

Api* GetApi() {
  static Api* api = [] {
    auto* a = new Api();  // never destroyed: handlers may run during interpreter shutdown
    a->load_status = a->Load();
    return a;
  }();
  return api;
}

// A plan: descriptors and the algorithm chosen by the heuristic for one GEMM configuration.
// Cached plans live for the process; a plan whose building failed frees what it had created.
struct Plan {
  lt::MatmulDesc desc = nullptr;
  lt::MatrixLayout a = nullptr, b = nullptr, c = nullptr;
  lt::MatmulAlgo algo{};
  std::vector<lt::MatmulAlgo> candidates;  // the heuristic's top results, best-ranked first
  bool tuned = false;                      // algo was picked by timing the candidates
  // FP8: the scale pointers are descriptor attributes, set at every run; a run holds this from
  // setting them until cublasLtMatmul has read the descriptor (it enqueues with the values).
  mutable std::mutex run_mu;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    Api* api = GetApi();
    for (lt::MatrixLayout l : {a, b, c}) {
      if (l != nullptr) api->MatrixLayoutDestroy(l);
    }
    if (desc != nullptr) api->MatmulDescDestroy(desc);
  }
};

// One GEMM configuration in words, for every cuBLASLt failure (the heuristic's, a run's).
std::string Describe(const GemmArgs& g, int align_a, int align_b, int align_c) {
  return StrCat() << Describe(g.types) << (g.types.a == DType::kF32 && g.tf32 ? " (tf32)" : "")
                  << " GEMM m=" << g.m << " n=" << g.n << " k=" << g.k << " trans_a=" << g.trans_a
                  << " trans_b=" << g.trans_b << " lda=" << g.lda << " ldb=" << g.ldb
                  << " ldc=" << g.ldc << " alignments a/b/c=" << align_a << "/" << align_b << "/"
                  << align_c << " B, workspace=" << g.workspace_bytes
                  << " B, sm_count=" << g.sm_count << (g.accumulate ? ", accumulating" : "");
}

// The last bool is `accumulate`: the heuristic does not see beta, but a GEMM with an addend reads C
// in its epilogue, so the fastest candidate may differ and is tuned (JAX_UB_GEMM_TUNE) apart.
// The types enter as GemmTypes::Code() (A, B and the result). The FP8 scale pointers do not: they
// are set at every run.
using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, int64_t,
                           int, bool, size_t, int, int, int, int, bool>;

std::mutex g_mu;
std::map<int, lt::Handle>& Handles() {
  static auto* m = new std::map<int, lt::Handle>();
  return *m;
}
std::set<int>& HeatedDevices() {  // devices on which GemmTune has run (see its heat-up)
  static auto* s = new std::set<int>();
  return *s;
}
std::map<PlanKey, std::unique_ptr<Plan>>& Plans() {
  static auto* m = new std::map<PlanKey, std::unique_ptr<Plan>>();
  return *m;
}

// The pointer alignment told to the heuristic and kept in the plan key, capped at 16 bytes: on
// H100/H200 the top algorithm is the same for 16..256 (0 of 60 shape and alignment pairs
// differ; probe: scripts/lt_align_probe.cu at tag lab-2026-11), and with the cap the trace-time
// warm-up (256-byte scratch) builds the very plan the op's chunk pointers (offsets into XLA's
// buffers) look up at execute time.
int Alignment(const void* p) {
  auto v = reinterpret_cast<uintptr_t>(p);
  int a = 16;
  while (a > 1 && (v % a) != 0) a /= 2;
  return a;
}

// The alignment class of an operand: 16, or the element size for a pointer short of 16 bytes
// (a row offset into a matrix whose rows are not a multiple of 16 bytes: odd K or N). Two classes
// an operand, so the trace-time warm-up can build (and load the kernel of) every plan an op will
// look up: a plan built here at execute time would load its kernel lazily inside the op, which can
// synchronize the context while a peer waits on this GPU. A plan for the element size serves every
// pointer at least that aligned.
int AlignClass(const void* p, size_t elem) {
  const int a = Alignment(p);
  return a >= 16 ? 16 : std::min(a, static_cast<int>(elem));
}

#define JAX_UB_LT_RETURN(api, expr)                                                      \
  do {                                                                                   \
    lt::Status jax_ub_lt_ = (expr);                                                      \
    if (jax_ub_lt_ != lt::kSuccess) {                                                    \
      return Status::Error(StrCat() << "cuBLASLt " << #expr << " failed: "               \
                                    << (api).Err(jax_ub_lt_) << " at " << JAX_UB_WHERE); \
    }                                                                                    \
  } while (0)

// FP8: the scale pointers of this run. cuBLASLt's A is our B (see BuildPlan), so its A scale is
// b_scale; the product a_scale * b_scale is the same either way.
Status SetScales(Api& api, lt::MatmulDesc desc, const GemmArgs& g) {
  const void* sa = g.b_scale;
  const void* sb = g.a_scale;
  JAX_UB_LT_RETURN(api, api.MatmulDescSetAttribute(desc, lt::kDescAScalePointer, &sa, sizeof(sa)));
  JAX_UB_LT_RETURN(api, api.MatmulDescSetAttribute(desc, lt::kDescBScalePointer, &sb, sizeof(sb)));
  return Status::Ok();
}

Status BuildPlan(Api& api, lt::Handle handle, const GemmArgs& g, int align_a, int align_b,
                 int align_c, Plan* plan) {
  const int compute =
      (g.types.a == DType::kF32 && g.tf32) ? lt::kCompute32FFastTF32 : lt::kCompute32F;
  JAX_UB_LT_RETURN(api, api.MatmulDescCreate(&plan->desc, compute, CUDA_R_32F));
  if (g.types.fp8()) {
    // Hopper's FP8 tensor cores accumulate in reduced precision. Fast accumulation off (the
    // default): cuBLASLt promotes the partial sums to fp32 at intervals along k, the fp32
    // accumulation the FP8 reference (a float32 dot of the dequantized operands) describes. On
    // (GemmTypes::fast_accum, the recipes' forward GEMMs): no promotion, faster, with an error
    // that grows with k (docs/fp8.md states the tolerance); backward GEMMs keep it off.
    const int8_t fast = g.types.fast_accum ? 1 : 0;
    JAX_UB_LT_RETURN(
        api, api.MatmulDescSetAttribute(plan->desc, lt::kDescFastAccum, &fast, sizeof(fast)));
    // The heuristic sees scaled operands (its pointers are replaced at every run).
    JAX_UB_RETURN_IF_ERROR(SetScales(api, plan->desc, g));
  }
  // Column-major view of the row-major product: C^T[n, m] = op(B)^T @ op(A)^T, so cuBLASLt's
  // "A" is our B and its "B" is our A.
  const int op_a = g.trans_b ? lt::kOpT : lt::kOpN;
  const int op_b = g.trans_a ? lt::kOpT : lt::kOpN;
  JAX_UB_LT_RETURN(api,
                   api.MatmulDescSetAttribute(plan->desc, lt::kDescTransA, &op_a, sizeof(op_a)));
  JAX_UB_LT_RETURN(api,
                   api.MatmulDescSetAttribute(plan->desc, lt::kDescTransB, &op_b, sizeof(op_b)));
  if (g.sm_count > 0) {
    const int32_t sms = g.sm_count;
    JAX_UB_LT_RETURN(
        api, api.MatmulDescSetAttribute(plan->desc, lt::kDescSmCountTarget, &sms, sizeof(sms)));
  }
  // Stored (pre-op) shapes of the column-major matrices.
  const uint64_t a_rows = g.trans_b ? g.k : g.n, a_cols = g.trans_b ? g.n : g.k;
  const uint64_t b_rows = g.trans_a ? g.m : g.k, b_cols = g.trans_a ? g.k : g.m;
  JAX_UB_LT_RETURN(api,
                   api.MatrixLayoutCreate(&plan->a, CudaType(g.types.b), a_rows, a_cols, g.ldb));
  JAX_UB_LT_RETURN(api,
                   api.MatrixLayoutCreate(&plan->b, CudaType(g.types.a), b_rows, b_cols, g.lda));
  JAX_UB_LT_RETURN(api, api.MatrixLayoutCreate(&plan->c, CudaType(g.types.out), g.n, g.m, g.ldc));

  lt::MatmulPreference pref = nullptr;
  JAX_UB_LT_RETURN(api, api.MatmulPreferenceCreate(&pref));
  const uint64_t ws = g.workspace_bytes;
  const uint32_t al_a = align_b, al_b = align_a, al_c = align_c;  // swapped like the operands
  Status st;
  constexpr int kMaxCandidates = 16;
  lt::HeuristicResult results[kMaxCandidates] = {};
  int found = 0;
  lt::Status s =
      api.MatmulPreferenceSetAttribute(pref, lt::kPrefMaxWorkspaceBytes, &ws, sizeof(ws));
  if (s == lt::kSuccess)
    s = api.MatmulPreferenceSetAttribute(pref, lt::kPrefMinAlignmentABytes, &al_a, sizeof(al_a));
  if (s == lt::kSuccess)
    s = api.MatmulPreferenceSetAttribute(pref, lt::kPrefMinAlignmentBBytes, &al_b, sizeof(al_b));
  if (s == lt::kSuccess)
    s = api.MatmulPreferenceSetAttribute(pref, lt::kPrefMinAlignmentCBytes, &al_c, sizeof(al_c));
  if (s == lt::kSuccess)
    s = api.MatmulPreferenceSetAttribute(pref, lt::kPrefMinAlignmentDBytes, &al_c, sizeof(al_c));
  if (s == lt::kSuccess)
    s = api.MatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->c, plan->c, pref,
                                   kMaxCandidates, results, &found);
  api.MatmulPreferenceDestroy(pref);
  if (s != lt::kSuccess) {
    // NOT_SUPPORTED here usually means no algorithm fits (alignment, leading dimension, workspace)
    return Status::Error(StrCat() << "cuBLASLt heuristic query failed for "
                                  << Describe(g, align_a, align_b, align_c) << ": " << api.Err(s));
  }
  for (int i = 0; i < found; ++i) {
    if (results[i].state == lt::kSuccess) plan->candidates.push_back(results[i].algo);
  }
  if (plan->candidates.empty()) {
    return Status::Error(StrCat() << "cuBLASLt found no algorithm for "
                                  << Describe(g, align_a, align_b, align_c));
  }
  plan->algo = plan->candidates.front();
  return Status::Ok();
}

}  // namespace

std::string CublasLtLoadError() {
  Api* api = GetApi();
  return api->load_status.ok() ? std::string() : api->load_status.message();
}

std::string CublasLtDescription() {
  Api* api = GetApi();
  if (!api->load_status.ok()) return api->load_status.message();
  return StrCat() << "cuBLASLt " << api->GetVersion() << " from " << api->lib.path();
}

size_t GemmPlanCacheSize() {
  std::lock_guard<std::mutex> lock(g_mu);
  return Plans().size();
}

namespace {

Status Lookup(Api* api, int device, const GemmArgs& g, lt::Handle* handle_out, Plan** plan_out) {
  if (!api->load_status.ok()) return api->load_status;
  if (g.m <= 0 || g.n <= 0 || g.k <= 0) {
    return Status::Error(StrCat() << "GEMM sizes must be positive; got m=" << g.m << " n=" << g.n
                                  << " k=" << g.k);
  }
  const std::string bad = g.types.Problem();
  if (!bad.empty()) return Status::Error(bad);
  if (g.types.fp8()) {
    if (g.trans_a || !g.trans_b) {
      return Status::Error(StrCat() << "an FP8 GEMM needs a stored [m, k] and b stored [n, k] "
                                       "(trans_a=0, trans_b=1); got trans_a="
                                    << g.trans_a << " trans_b=" << g.trans_b);
    }
    if (g.a_scale == nullptr || g.b_scale == nullptr) {
      return Status::Error("an FP8 GEMM needs the device pointers of both scales");
    }
  }
  const size_t es_a = DTypeSize(g.types.a), es_b = DTypeSize(g.types.b);
  const size_t es_c = DTypeSize(g.types.out);
  const int align_a = AlignClass(g.a, es_a), align_b = AlignClass(g.b, es_b);
  const int align_c = g.accumulate && g.c_in != nullptr
                          ? std::min(AlignClass(g.c, es_c), AlignClass(g.c_in, es_c))
                          : AlignClass(g.c, es_c);
  // TF32 is a float32 GEMM's choice: for the other types the flag names no other plan.
  const bool tf32 = g.tf32 && g.types.a == DType::kF32;
  const PlanKey key{device,      g.m,
                    g.n,         g.k,
                    g.trans_a,   g.trans_b,
                    g.lda,       g.ldb,
                    g.ldc,       g.types.Code(),
                    tf32,        g.workspace_bytes,
                    align_a,     align_b,
                    align_c,     g.sm_count,
                    g.accumulate};
  lt::Handle handle = nullptr;
  Plan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto hit = Handles().find(device);
    if (hit == Handles().end()) {
      JAX_UB_LT_RETURN(*api, api->Create(&handle));
      Handles()[device] = handle;
    } else {
      handle = hit->second;
    }
    auto it = Plans().find(key);
    if (it == Plans().end()) {
      auto p = std::make_unique<Plan>();
      JAX_UB_RETURN_IF_ERROR(BuildPlan(*api, handle, g, align_a, align_b, align_c, p.get()));
      it = Plans().emplace(key, std::move(p)).first;
    }
    plan = it->second.get();
  }
  *handle_out = handle;
  *plan_out = plan;
  return Status::Ok();
}

Status Run(Api* api, lt::Handle handle, const Plan* plan, const lt::MatmulAlgo& algo,
           const GemmArgs& g, cudaStream_t stream) {
  const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
  // Our B is cuBLASLt's A and vice versa (see BuildPlan).
  const void* addend = g.accumulate && g.c_in != nullptr ? g.c_in : g.c;
  auto matmul = [&] {
    return api->Matmul(handle, plan->desc, &alpha, g.b, plan->a, g.a, plan->b, &beta, addend,
                       plan->c, g.c, plan->c, &algo, g.workspace, g.workspace_bytes, stream);
  };
  lt::Status s;
  if (g.types.fp8()) {
    std::lock_guard<std::mutex> lock(plan->run_mu);
    JAX_UB_RETURN_IF_ERROR(SetScales(*api, plan->desc, g));
    s = matmul();
  } else {
    s = matmul();
  }
  if (s != lt::kSuccess) {
    StrCat scales;
    if (g.types.fp8()) {
      scales << ", scale pointers aligned to " << Alignment(g.a_scale) << "/"
             << Alignment(g.b_scale) << " B";
    }
    return Status::Error(StrCat() << "cublasLtMatmul failed for "
                                  << Describe(g, AlignClass(g.a, DTypeSize(g.types.a)),
                                              AlignClass(g.b, DTypeSize(g.types.b)),
                                              AlignClass(g.c, DTypeSize(g.types.out)))
                                  << std::string(scales) << ": " << api->Err(s));
  }
  return Status::Ok();
}

}  // namespace

Status Gemm(int device, const GemmArgs& g, cudaStream_t stream) {
  Api* api = GetApi();
  lt::Handle handle = nullptr;
  Plan* plan = nullptr;
  JAX_UB_RETURN_IF_ERROR(Lookup(api, device, g, &handle, &plan));
  lt::MatmulAlgo algo;
  std::vector<lt::MatmulAlgo> others;
  {
    std::lock_guard<std::mutex> lock(g_mu);  // GemmTune may be replacing it
    algo = plan->algo;
    if (g.types.fp8()) others = plan->candidates;
  }
  const Status st = Run(api, handle, plan, algo, g, stream);
  if (st.ok() || others.empty()) return st;
  // FP8: the heuristic's pick may refuse this run (cuBLASLt checks pointers only here): the next
  // candidate that runs becomes the plan's (once; the trace-time warm-up meets it first).
  for (const lt::MatmulAlgo& other : others) {
    if (std::memcmp(&other, &algo, sizeof(algo)) == 0) continue;
    if (Run(api, handle, plan, other, g, stream).ok()) {
      std::lock_guard<std::mutex> lock(g_mu);
      plan->algo = other;
      return Status::Ok();
    }
  }
  return Status::Error(StrCat() << st.message() << " (and so did the other " << others.size() - 1
                                << " candidates)");
}

Status GemmTune(int device, const GemmArgs& g, int candidates, int reps, cudaStream_t stream,
                GemmTuneResult* out) {
  Api* api = GetApi();
  if (!api->load_status.ok()) return api->load_status;
  lt::Handle handle = nullptr;
  Plan* plan = nullptr;
  JAX_UB_RETURN_IF_ERROR(Lookup(api, device, g, &handle, &plan));
  std::vector<lt::MatmulAlgo> algos;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (plan->tuned) {
      if (out) out->cached = true;
      return Status::Ok();
    }
    algos.assign(plan->candidates.begin(),
                 plan->candidates.begin() +
                     std::min<size_t>(plan->candidates.size(), std::max(candidates, 1)));
  }
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  JAX_UB_CUDA_RETURN(cudaEventCreate(&e0));
  JAX_UB_CUDA_RETURN(cudaEventCreate(&e1));
  // One warm-up run each, then kRounds rounds that time every candidate over back-to-back runs
  // (how the schedules issue them), at least kMinTimedMs of GPU time per timing (a GEMM of a few
  // microseconds is noise otherwise); a candidate's time is its median round. Interleaved, so a
  // clock or power change during tuning moves every candidate alike.
  constexpr int kRounds = 3, kMaxReps = 200;
  constexpr float kMinTimedMs = 1.0f, kHeatMs = 50.0f, kFirstHeatMs = 400.0f;
  // The heuristic's first stays unless another is faster by more than this: a gain within the
  // timing noise (a few percent from run to run) is a coin toss, not worth leaving the heuristic.
  constexpr float kMargin = 0.03f;
  std::vector<bool> ok(algos.size());
  std::vector<std::vector<float>> times(algos.size());
  auto timed = [&](size_t i, int n) -> float {  // ms per run, < 0 if it failed
    Status run;
    if (cudaEventRecord(e0, stream) != cudaSuccess) return -1;
    for (int r = 0; r < n && run.ok(); ++r) run = Run(api, handle, plan, algos[i], g, stream);
    cudaEventRecord(e1, stream);
    if (cudaEventSynchronize(e1) != cudaSuccess || !run.ok()) {
      cudaGetLastError();
      return -1;
    }
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    return ms / n;
  };
  int n = std::max(reps, 1);
  for (size_t i = 0; i < algos.size(); ++i) {
    // A candidate the heuristic offered may still fail to run here: it is skipped.
    const float ms = timed(i, 1);
    ok[i] = ms >= 0;
    if (ok[i] && n * ms < kMinTimedMs) {
      n = std::min(kMaxReps, std::max(n, static_cast<int>(kMinTimedMs / std::max(ms, 1e-4f)) + 1));
    }
  }
  // Heat: a GPU that was idle runs its first tens of milliseconds of GEMMs above the clocks its
  // power cap allows for longer, and there the candidates rank otherwise (on an H200, a chunk
  // GEMM's heuristic first ran 0.317 ms straight after compilation, 0.380 ms after other GEMMs,
  // where the third candidate was 8% faster). Tuning is for the sustained state of training.
  // A process's first tuning on a GPU heats longer: a GPU idle since the process started climbs
  // through its power states more slowly (an H100's first tuning kept the heuristic's first
  // where every later one kept a candidate 8% faster).
  bool first_on_device = false;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    first_on_device = HeatedDevices().insert(device).second;
  }
  const float heat_ms = first_on_device ? kFirstHeatMs : kHeatMs;
  for (size_t i = 0; i < algos.size(); ++i) {
    if (!ok[i]) continue;
    const float ms = timed(i, 1);
    if (ms > 0) timed(i, std::min(40 * kMaxReps, static_cast<int>(heat_ms / ms) + 1));
    break;
  }
  for (int round = 0; round < kRounds; ++round) {
    for (size_t i = 0; i < algos.size(); ++i) {
      if (!ok[i]) continue;
      const float ms = timed(i, n);
      ok[i] = ms >= 0;
      if (ok[i]) times[i].push_back(ms);
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  float best_ms = -1, first_ms = -1;
  size_t best = 0;
  for (size_t i = 0; i < algos.size(); ++i) {
    if (!ok[i] || times[i].empty()) continue;
    std::sort(times[i].begin(), times[i].end());
    const float ms = times[i][times[i].size() / 2];
    if (i == 0) first_ms = ms;
    if (best_ms < 0 || ms < best_ms) {
      best_ms = ms;
      best = i;
    }
  }
  if (first_ms > 0 && best != 0 && best_ms > first_ms * (1.0f - kMargin)) {
    best = 0;
    best_ms = first_ms;
  }
  if (best_ms < 0) {
    return Status::Error(StrCat() << "GEMM tuning: no candidate algorithm ran for m=" << g.m
                                  << " n=" << g.n << " k=" << g.k);
  }
  {
    std::lock_guard<std::mutex> lock(g_mu);
    plan->algo = algos[best];
    plan->tuned = true;
  }
  if (out) {
    out->candidates = static_cast<int>(algos.size());
    out->chosen = static_cast<int>(best);
    out->heuristic_ms = first_ms;
    out->best_ms = best_ms;
  }
  return Status::Ok();
}

}  // namespace jax_ub
