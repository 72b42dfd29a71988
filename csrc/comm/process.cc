#include "comm/process.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace jax_ub {
namespace {

// /proc/<pid>/stat's pid (field 1), state (field 3) and start time (field 22). 1: read; 0: no
// such entry; -1: could not tell (permissions, a read error, a format this code does not know).
int ReadStat(int pid, long* own_pid, char* state, uint64_t* start) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return errno == ENOENT || errno == ESRCH ? 0 : -1;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  const int read_errno = std::ferror(f) ? errno : 0;
  std::fclose(f);
  if (n == 0) return read_errno == 0 || read_errno == ESRCH ? 0 : -1;  // gone since the open
  buf[n] = '\0';
  *own_pid = std::strtol(buf, nullptr, 10);
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

// The process's thread count (/proc/<pid>/status "Threads:"), or -1.
long Threads(int pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/status", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return -1;
  char line[256];
  long threads = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::strncmp(line, "Threads:", 8) == 0) {
      threads = std::strtol(line + 8, nullptr, 10);
      break;
    }
  }
  std::fclose(f);
  return threads;
}

// The pid names no process in this pid namespace (kill ignores /proc's hidepid).
bool NoSuchPid(int pid) { return kill(pid, 0) == -1 && errno == ESRCH; }

}  // namespace

ProcessId ThisProcess() {
  ProcessId me;
  me.pid = static_cast<int32_t>(getpid());
  long own = 0;
  char state = 0;
  uint64_t start = 0;
  // /proc must be this pid namespace's (not, e.g., the host's after `unshare -p` without a new
  // /proc mount): its entry for our pid must be us. Else the start time stays unknown, and the
  // peers never check this process.
  if (ReadStat(me.pid, &own, &state, &start) == 1 && own == me.pid) me.start_ticks = start;
  struct stat st{};
  if (stat("/proc/self/ns/pid", &st) == 0) {
    me.pidns_dev = static_cast<uint64_t>(st.st_dev);
    me.pidns_ino = static_cast<uint64_t>(st.st_ino);
  }
  return me;
}

bool Checkable(const ProcessId& p) { return WhyNotCheckable(p).empty(); }

std::string WhyNotCheckable(const ProcessId& p) {
  static const ProcessId me = ThisProcess();
  if (me.start_ticks == 0 || me.pidns_ino == 0) {
    return "this process cannot read its own /proc entry";
  }
  if (p.pid <= 0 || p.start_ticks == 0) return "it could not describe itself (no /proc there)";
  if (p.pidns_dev != me.pidns_dev || p.pidns_ino != me.pidns_ino) {
    return "it runs in another pid namespace (another container)";
  }
  long own = 0;
  char state = 0;
  uint64_t start = 0;
  // Visible now, as itself (a /proc mounted with hidepid hides other users' processes: such a
  // peer is not checkable rather than "gone").
  if (ReadStat(p.pid, &own, &state, &start) != 1 || own != p.pid || start != p.start_ticks) {
    return "this process's /proc does not show it (hidepid, or it had already exited)";
  }
  if (state == 'Z' || state == 'X') return "it had already exited when it connected";
  return std::string();
}

std::string ProcessGone(const ProcessId& p) {
  long own = 0;
  char state = 0;
  uint64_t start = 0;
  const int r = ReadStat(p.pid, &own, &state, &start);
  if (r < 0) return "";
  // No /proc entry: gone, unless the pid still exists and /proc only hides it from us.
  if (r == 0) return NoSuchPid(p.pid) ? "has exited" : "";
  if (start != p.start_ticks) return "has exited (its pid now belongs to another process)";
  // A zombie main thread with other threads still running is a live process.
  if ((state == 'Z' || state == 'X') && Threads(p.pid) <= 1) {
    return "has exited (a zombie, not yet reaped by its parent)";
  }
  return "";
}

}  // namespace jax_ub
