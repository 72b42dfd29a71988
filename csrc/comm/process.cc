#include "comm/process.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace jax_ub {
namespace {

// /proc/<pid>/stat's state (field 3) and start time (field 22). 1: read; 0: no such process;
// -1: could not tell (permissions, a format this code does not know).
int ReadStat(int pid, char* state, uint64_t* start) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return errno == ENOENT || errno == ESRCH ? 0 : -1;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  if (n == 0) return 0;  // the process went away between open and read
  buf[n] = '\0';
  // Field 2 is the command name in parentheses, which may itself hold spaces or parentheses:
  // the fields after it start after the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr || p[1] != ' ') return -1;
  p += 2;
  *state = *p;
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p, ' ');
    if (p == nullptr) return -1;
    ++p;
  }
  char* end = nullptr;
  *start = std::strtoull(p, &end, 10);
  return end == p ? -1 : 1;
}

}  // namespace

ProcessId ThisProcess() {
  ProcessId me;
  me.pid = static_cast<int32_t>(getpid());
  char state = 0;
  uint64_t start = 0;
  if (ReadStat(me.pid, &state, &start) == 1) me.start_ticks = start;
  struct stat st {};
  if (stat("/proc/self/ns/pid", &st) == 0) {
    me.pidns_dev = static_cast<uint64_t>(st.st_dev);
    me.pidns_ino = static_cast<uint64_t>(st.st_ino);
  }
  return me;
}

bool Checkable(const ProcessId& p) {
  static const ProcessId me = ThisProcess();
  if (p.pid <= 0 || p.start_ticks == 0 || me.pidns_ino == 0) return false;
  if (p.pidns_dev != me.pidns_dev || p.pidns_ino != me.pidns_ino) return false;
  char state = 0;
  uint64_t start = 0;
  // Visible now, as itself (a /proc mounted with hidepid hides other users' processes: such a
  // peer is not checkable rather than "gone").
  return ReadStat(p.pid, &state, &start) == 1 && start == p.start_ticks && state != 'Z' &&
         state != 'X';
}

std::string ProcessGone(const ProcessId& p) {
  char state = 0;
  uint64_t start = 0;
  const int r = ReadStat(p.pid, &state, &start);
  if (r < 0) return "";
  if (r == 0) return "has exited";
  if (start != p.start_ticks) return "has exited (its pid now belongs to another process)";
  if (state == 'Z' || state == 'X') return "has exited (a zombie, not yet reaped by its parent)";
  return "";
}

}  // namespace jax_ub
