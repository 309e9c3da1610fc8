// The shared expert arenas a launcher derives for a deployment (/dev/shm/moeserve-<hash>), and the
// ones earlier launchers left: the name carries a fingerprint of the model's files, so a folder
// whose weights changed gets a new arena; an owner record (/dev/shm/NAME.owner, the launcher's
// pid) tells a left-behind arena from one in use.
//
// Thread-safety: plain functions over the file system; call them from the launcher's thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe::deploy {

// The arena name of a deployment of `model_dir` (its files' fingerprint included) in `format`
// and `group`.
std::string DerivedArenaName(const std::string& model_dir, const std::string& format, int group);

// Writes NAME.owner (this process's pid) for each name, so that RemoveOrphanArenas of another
// launcher leaves them alone while this one lives.
void ClaimArenas(const std::vector<std::string>& names);
// Removes each name's segment, its parts and its owner record.
void ReleaseArenas(const std::vector<std::string>& names);

// Removes derived arenas (moeserve-<16 hex digits>[-sN]) in /dev/shm whose owner record names a
// process that is gone (or that have none) and that no process maps, except `keep`. Returns what
// it removed, with their bytes.
struct RemovedArena {
  std::string name;
  uint64_t bytes = 0;
};
std::vector<RemovedArena> RemoveOrphanArenas(const std::vector<std::string>& keep);

// "/dev/shm: 1.2 GiB used of 11.7 GiB (moeserve arenas 1.0 GiB)"; empty when /dev/shm cannot be read.
std::string ShmUsage();

}  // namespace moe::deploy
