#include "shm_arenas.h"

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "moe/core/files_fingerprint.h"
#include "moe/experts/arena.h"

namespace moe::deploy {
namespace {

constexpr char kShm[] = "/dev/shm/";

std::string OwnerPath(const std::string& name) { return absl::StrCat(kShm, name, ".owner"); }

std::vector<std::string> ShmEntries() {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(kShm); d != nullptr) {
    while (const dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
    ::closedir(d);
  }
  return names;
}

uint64_t FileBytes(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

// Whether the process named in NAME.owner lives.
bool OwnerAlive(const std::string& name) {
  std::ifstream in(OwnerPath(name));
  std::string text;
  int64_t pid = 0;
  if (!std::getline(in, text) || !absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &pid) || pid <= 0) return false;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

// The /dev/shm segments (main part names, without ".N") some process maps now.
std::set<std::string> MappedSegments() {
  std::set<std::string> mapped;
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return mapped;
  while (const dirent* e = ::readdir(proc)) {
    int pid = 0;
    if (!absl::SimpleAtoi(e->d_name, &pid)) continue;
    std::ifstream maps(absl::StrCat("/proc/", pid, "/maps"));
    std::string line;
    while (std::getline(maps, line)) {
      const size_t at = line.find(kShm);
      if (at == std::string::npos) continue;
      std::string name = line.substr(at + sizeof(kShm) - 1);
      name = std::string(absl::StripSuffix(name, " (deleted)"));
      if (const size_t dot = name.find('.'); dot != std::string::npos) name.resize(dot);
      mapped.insert(name);
    }
  }
  ::closedir(proc);
  return mapped;
}

}  // namespace

std::string DerivedArenaName(const std::string& model_dir, const std::string& format, int group) {
  std::error_code ec;
  const auto canonical = std::filesystem::weakly_canonical(model_dir, ec);
  // FNV-1a: the same name from any process for the same files, so that a restarted launcher finds
  // the arena its predecessor left, and another name once the files change.
  uint64_t h = 14695981039346656037ull;
  for (char ch : absl::StrCat(ec ? model_dir : canonical.string(), "|", format, "|", group, "|",
                              core::WeightFilesFingerprint(model_dir))) {
    h = (h ^ static_cast<uint8_t>(ch)) * 1099511628211ull;
  }
  return absl::StrFormat("moeserve-%016x", h);
}

void ClaimArenas(const std::vector<std::string>& names) {
  for (const std::string& name : names) std::ofstream(OwnerPath(name)) << ::getpid() << "\n";
}

void ReleaseArenas(const std::vector<std::string>& names) {
  for (const std::string& name : names) {
    (void)experts::HostArena::Unlink(name);
    ::unlink(OwnerPath(name).c_str());
  }
}

std::vector<RemovedArena> RemoveOrphanArenas(const std::vector<std::string>& keep) {
  static const std::regex kDerived("moeserve-[0-9a-f]{16}(-s[0-9]+)?");
  const std::vector<std::string> entries = ShmEntries();
  std::set<std::string> segments;  // derived names with a segment or an owner record
  for (const std::string& entry : entries) {
    const std::string base = entry.substr(0, entry.find('.'));
    if (std::regex_match(base, kDerived)) segments.insert(base);
  }
  std::vector<RemovedArena> removed;
  if (segments.empty()) return removed;
  const std::set<std::string> mapped = MappedSegments();
  for (const std::string& name : segments) {
    if (std::find(keep.begin(), keep.end(), name) != keep.end() || OwnerAlive(name) || mapped.count(name) > 0) {
      continue;
    }
    RemovedArena r{name, 0};
    for (const std::string& entry : entries) {
      if (entry == name || (entry.size() > name.size() + 1 && entry.compare(0, name.size() + 1, name + ".") == 0)) {
        r.bytes += FileBytes(kShm + entry);
      }
    }
    ReleaseArenas({name});
    removed.push_back(r);
  }
  return removed;
}

std::string ShmUsage() {
  struct statvfs vfs;
  if (::statvfs(kShm, &vfs) != 0 || vfs.f_blocks == 0) return "";
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const double total = static_cast<double>(vfs.f_blocks) * vfs.f_frsize / gib;
  const double used = static_cast<double>(vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize / gib;
  uint64_t ours = 0;
  for (const std::string& entry : ShmEntries()) {
    if (entry.rfind("moeserve-", 0) == 0) ours += FileBytes(kShm + entry);
  }
  return absl::StrFormat("/dev/shm: %.2f GiB used of %.2f GiB (moeserve arenas: %.2f GiB)", used, total,
                         static_cast<double>(ours) / gib);
}

}  // namespace moe::deploy
