// Run-time loading of the NVIDIA libraries that jax itself ships (nvidia-cublas, nvidia-nccl
// wheels), so one build of jax_ub works with the CUDA 12 and CUDA 13 jax packages and links no
// system library.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace jax_ub {

// A dlopen()ed library. Candidates are tried in order (full paths found by Python first, then
// sonames on the loader's default path). Never dlclose()d: handlers may still reference symbols.
class DynLib {
 public:
  Status Open(const std::string& what, const std::vector<std::string>& candidates);
  bool is_open() const { return handle_ != nullptr; }
  const std::string& path() const { return path_; }
  // Looks up a symbol; fills *fn or returns an error naming the library and the symbol.
  template <typename Fn>
  Status Sym(const char* name, Fn** fn) const {
    void* p = RawSym(name);
    if (p == nullptr) {
      return Status::Error(StrCat() << "symbol " << name << " not found in " << path_);
    }
    *fn = reinterpret_cast<Fn*>(p);
    return Status::Ok();
  }

 private:
  void* RawSym(const char* name) const;
  void* handle_ = nullptr;
  std::string path_;
};

// Library search paths handed over from Python (jax_ub/_ext.py finds the wheel directories).
void SetLibraryCandidates(const std::string& lib, std::vector<std::string> paths);
std::vector<std::string> LibraryCandidates(const std::string& lib);

}  // namespace jax_ub
