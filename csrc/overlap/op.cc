// What every overlap schedule shares: the chunk GEMM and the op frame (see op.h).
#include "overlap/op.h"

#include <chrono>
#include <mutex>

namespace jax_ub {

Status RowGemm::Run(int device, const void* x, int64_t m, void* y, cudaStream_t s,
                    const void* addend) const {
  GemmArgs g = RowMajorGemm(m, n, k, types, tf32, x, w, y, workspace, workspace_bytes, sm_count);
  if (ld > 0) {
    g.ldc = ld;
    if (!types.fp8()) g.ldb = ld;
  }
  g.a_scale = x_scale;
  g.b_scale = w_scale;
  g.accumulate = addend != nullptr;
  g.c_in = addend;
  return Gemm(device, g, s);
}

Status CapacityError(const Communicator& c, size_t need) {
  return Status::Error(StrCat() << "registered buffer holds " << c.capacity() << " bytes, op needs "
                                << need << " (the op was traced before jax_ub.initialize()?)");
}

Status RunOp(Communicator* c, const char* op, cudaStream_t xla,
             const std::function<Status()>& check, const std::string& what,
             const std::function<Status(uint64_t, OpTrace&)>& body) {
  struct HostTime {  // every return path counts the op's host time
    Communicator* c;
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    ~HostTime() {
      c->AddHostOp(std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now() - t0)
                       .count());
    }
  } host_time{c};
  const bool injected = c->TakeInjected(Communicator::kFailCheck);
  JAX_UB_RETURN_IF_ERROR(c->Usable());  // an earlier failure says more than a capacity check
  // The check reads the capacity and transport, which Grow changes under this lock.
  std::lock_guard<std::mutex> op_lock(c->op_mutex());
  if (c->destroyed()) {
    return Status::Error(
        "its communicator was freed (jax_ub.shutdown()) while this op was being "
        "launched: call shutdown() only after the program's results are ready");
  }
  if (injected) return Status::Error("injected failure before the op began (test hook)");
  JAX_UB_RETURN_IF_ERROR(check());
  // Once the op has its epoch, any failure leaves it half done: abandon the communicator.
  uint64_t e = 0;
  auto abandon = [&](const Status& st) {
    c->Abandon(xla, StrCat() << Where(*c, op) << ": failed after it started (epoch " << e
                             << "): " << st.message()
                             << "; its peers may wait for it, so this communicator is unusable "
                                "now (restart the processes)");
    return st;
  };
  Status st = c->Begin(op, xla, &e, what);
  if (!st.ok()) return e == 0 ? st : abandon(st);
  OpTrace t(*c, op, e, xla);
  st = c->TakeInjected(Communicator::kFailBody)
           ? Status::Error("injected failure after the op began (test hook)")
           : body(e, t);
  if (st.ok()) st = c->End(xla);
  return st.ok() ? st : abandon(st);
}

}  // namespace jax_ub
