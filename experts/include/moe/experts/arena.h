// HostArena: one region of host memory for all routed expert weights of a host.
//
// Private arenas are anonymous memory, 2 MiB aligned, backed by huge pages where the kernel
// gives them (explicit hugetlb pages first, then transparent huge pages), 4 KiB pages otherwise.
// Shared arenas are a named POSIX shared-memory segment (/dev/shm/NAME, in parts NAME.1, NAME.2,
// ... when large): the first process creates and fills it, then Publish()es it; later processes (a restarted worker,
// the other workers of the host) attach read-only in well under a second, without reloading. A segment records a key
// (model and its files' sizes and times, format, layout); a complete segment of another key is replaced, never
// attached.
//
// Thread-safety: immutable after Publish(); data() may be read from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace moe::experts {

class HostArena {
 public:
  // kResourceExhausted when the memory cannot be had.
  static absl::StatusOr<std::unique_ptr<HostArena>> CreatePrivate(size_t bytes);
  // Attaches to segment `name` if it holds `key` and is complete; otherwise creates it (a stale
  // segment whose creator died is replaced, and so is a segment of another key). kFailedPrecondition
  // if `name` is not an arena of this format; kUnavailable if another live process is still filling
  // it. A segment of more than
  // min_part_bytes comes in parts (/dev/shm/NAME, NAME.1, ... up to 64), mapped end to end, so
  // that the threads filling it get pages side by side.
  static absl::StatusOr<std::unique_ptr<HostArena>> OpenShared(const std::string& name, uint64_t key, size_t bytes,
                                                               size_t min_part_bytes = 256u << 20);
  // Removes segment `name` and its parts (the memory goes once every process has unmapped it).
  static absl::Status Unlink(const std::string& name);

  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // True when the weights were already there (attached to a published segment): do not load.
  bool attached() const { return attached_; }
  // Marks a created shared segment complete, so others may attach. No-op for private arenas.
  void Publish();
  // "2 MiB hugetlb pages", "transparent huge pages", "4 KiB pages", "shared memory (...)".
  const std::string& page_kind() const { return page_kind_; }

 private:
  HostArena() = default;
  uint8_t* mapping_ = nullptr;  // what to munmap
  size_t mapping_size_ = 0;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool attached_ = false;
  struct SegmentHeader* header_ = nullptr;
  std::string page_kind_;
};

}  // namespace moe::experts
