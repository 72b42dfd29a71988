#include "common/dynlib.h"

#include <dlfcn.h>

#include <map>
#include <mutex>

namespace jax_ub {
namespace {
std::mutex g_mu;
std::map<std::string, std::vector<std::string>>& Candidates() {
  static auto* m = new std::map<std::string, std::vector<std::string>>();
  return *m;
}
}  // namespace

void SetLibraryCandidates(const std::string& lib, std::vector<std::string> paths) {
  std::lock_guard<std::mutex> lock(g_mu);
  Candidates()[lib] = std::move(paths);
}

std::vector<std::string> LibraryCandidates(const std::string& lib) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = Candidates().find(lib);
  return it == Candidates().end() ? std::vector<std::string>{} : it->second;
}

Status DynLib::Open(const std::string& what, const std::vector<std::string>& candidates) {
  if (handle_ != nullptr) return Status::Ok();
  std::string tried;
  for (const std::string& c : candidates) {
    void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h != nullptr) {
      handle_ = h;
      path_ = c;
      return Status::Ok();
    }
    const char* err = dlerror();
    tried += "\n  " + c + ": " + (err ? err : "unknown error");
  }
  return Status::Error(StrCat() << "could not load " << what << "; tried:" << tried
                                << "\n(install jax with its CUDA extra, e.g. pip install "
                                   "'jax_ub[cuda13]', which brings the nvidia-* wheels)");
}

void* DynLib::RawSym(const char* name) const {
  return handle_ == nullptr ? nullptr : dlsym(handle_, name);
}

}  // namespace jax_ub
