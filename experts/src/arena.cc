#include "moe/experts/arena.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe::experts {

constexpr size_t kHugePage = 2u << 20;
constexpr char kMagic[8] = {'M', 'O', 'E', 'A', 'R', 'E', 'N', 'A'};
constexpr uint32_t kVersion = 2;
// A shared arena is cut into parts, each its own segment (NAME, NAME.1, NAME.2, ...): the kernel
// hands out a segment's pages one at a time, so one segment filled by 32 threads fills no faster
// than by one (4.8 GB in about a second on the 32-core machine); parts fill side by side. (A
// 9.66 GB bf16 arena on that machine: 20.8-22.2 GB/s of checkpoint in 16 parts, 24.2-25.4 in 36.)
constexpr int kMaxParts = 64;

// The first 2 MiB of a shared segment's first part; the data starts after it, 2 MiB aligned, and
// goes on in the other parts, mapped right after it.
struct SegmentHeader {
  char magic[8];
  uint32_t version;
  std::atomic<uint32_t> ready;
  uint64_t key;
  uint64_t bytes;
  int64_t creator_pid;
  uint32_t parts;
  uint64_t part_bytes;  // data bytes in each part
};

namespace {

size_t RoundUp(size_t v, size_t m) { return (v + m - 1) / m * m; }

std::string SegmentPath(const std::string& name) { return name[0] == '/' ? name : "/" + name; }

std::string PartPath(const std::string& path, int part) {
  return part == 0 ? path : absl::StrCat(path, ".", part);
}

// Removes the parts after the first of segment `path` (any that exist).
void UnlinkOtherParts(const std::string& path) {
  for (int part = 1; part < kMaxParts; ++part) ::shm_unlink(PartPath(path, part).c_str());
}

// Reserves `bytes` of address space 2 MiB aligned; returns the aligned start (PROT_NONE).
uint8_t* ReserveAligned(size_t bytes) {
  void* raw = ::mmap(nullptr, bytes + kHugePage, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  auto* base = static_cast<uint8_t*>(raw);
  auto* aligned = reinterpret_cast<uint8_t*>(RoundUp(reinterpret_cast<uintptr_t>(base), kHugePage));
  if (aligned > base) ::munmap(base, aligned - base);
  const size_t tail = (base + bytes + kHugePage) - (aligned + bytes);
  if (tail > 0) ::munmap(aligned + bytes, tail);
  return aligned;
}

// Maps part `part` (of `bytes`) of segment `path` at `at`: created (read-write, sized) or
// attached (read-only, checked for its size).
absl::Status MapPart(const std::string& path, int part, size_t bytes, bool create, uint8_t* at) {
  const std::string part_path = PartPath(path, part);
  const int fd = create ? ::shm_open(part_path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600)
                        : ::shm_open(part_path.c_str(), O_RDONLY, 0);
  if (fd < 0 && !create) {
    return absl::FailedPreconditionError(absl::StrCat("shared memory ", part_path, ": ", std::strerror(errno),
                                                      "; the segment is incomplete: remove its parts (/dev/shm",
                                                      path, "*)"));
  }
  if (fd < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("shared memory ", part_path, ": ", std::strerror(errno)));
  }
  struct stat st;
  if (create ? ::ftruncate(fd, static_cast<off_t>(bytes)) != 0
             : ::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    const int err = errno;
    ::close(fd);
    return create ? absl::ResourceExhaustedError(absl::StrCat("shared memory ", part_path, ": cannot size to ",
                                                              bytes >> 20, " MiB: ", std::strerror(err)))
                  : absl::FailedPreconditionError(absl::StrCat("shared memory ", part_path,
                                                               " is not the size its first part records; remove ",
                                                               "the segment's parts (/dev/shm", path, "*)"));
  }
  void* p = ::mmap(at, bytes, create ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("shared memory ", part_path, ": mmap failed: ", std::strerror(err)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<HostArena>> HostArena::CreatePrivate(size_t bytes) {
  std::unique_ptr<HostArena> arena(new HostArena());
  const size_t size = RoundUp(std::max<size_t>(bytes, 1), kHugePage);
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
  if (p != MAP_FAILED) {
    arena->page_kind_ = "2 MiB hugetlb pages";
  } else {
    uint8_t* aligned = ReserveAligned(size);
    p = aligned == nullptr ? MAP_FAILED
                           : ::mmap(aligned, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot map ", size >> 20, " MiB for the expert arena: ", std::strerror(errno)));
    }
    arena->page_kind_ = ::madvise(p, size, MADV_HUGEPAGE) == 0 ? "transparent huge pages" : "4 KiB pages";
  }
  arena->mapping_ = arena->data_ = static_cast<uint8_t*>(p);
  arena->mapping_size_ = size;
  arena->size_ = bytes;
  return arena;
}

absl::StatusOr<std::unique_ptr<HostArena>> HostArena::OpenShared(const std::string& name, uint64_t key, size_t bytes,
                                                                  size_t min_part_bytes) {
  const std::string path = SegmentPath(name);
  // The cut: up to kMaxParts parts of at least min_part_bytes, 2 MiB multiples.
  const size_t data = RoundUp(std::max<size_t>(bytes, 1), kHugePage);
  const int parts = static_cast<int>(std::clamp<size_t>(data / std::max<size_t>(min_part_bytes, 1), 1, kMaxParts));
  const size_t part_bytes = RoundUp((data + parts - 1) / parts, kHugePage);
  std::unique_ptr<HostArena> arena(new HostArena());
  bool replaced = false;  // a segment of other weights was there
  for (int attempt = 0; attempt < 2; ++attempt) {
    int fd = ::shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    const bool created = fd >= 0;
    SegmentHeader seen{};  // an existing segment's header, read before mapping it
    if (!created) {
      if (errno != EEXIST) {
        return absl::ResourceExhaustedError(absl::StrCat("shared memory ", path, ": ", std::strerror(errno)));
      }
      fd = ::shm_open(path.c_str(), O_RDONLY, 0);
      if (fd < 0) return absl::UnavailableError(absl::StrCat("shared memory ", path, ": ", std::strerror(errno)));
      struct stat st;
      if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < kHugePage ||
          ::pread(fd, &seen, sizeof(seen), 0) != static_cast<ssize_t>(sizeof(seen))) {
        ::close(fd);
        return absl::UnavailableError(absl::StrCat("shared memory ", path, " is being created; try again"));
      }
      if (std::all_of(seen.magic, seen.magic + 8, [](char c) { return c == 0; })) {
        ::close(fd);  // sized, its header not written yet (for microseconds, unless its creator died then)
        return absl::UnavailableError(absl::StrCat("shared memory ", path, " is being created; try again (if it ",
                                                   "stays so, remove /dev/shm", path, "*)"));
      }
      const bool ours = std::memcmp(seen.magic, kMagic, 8) == 0 && seen.version == kVersion;
      if (!ours || seen.parts < 1 || seen.parts > kMaxParts ||
          static_cast<size_t>(st.st_size) != kHugePage + seen.part_bytes) {
        ::close(fd);
        return absl::FailedPreconditionError(
            absl::StrCat("shared memory ", path, " is not an expert arena of this moeserve version; remove it ",
                         "with `rm /dev/shm", path, "*` or choose another name"));
      }
      const bool creator_alive = ::kill(static_cast<pid_t>(seen.creator_pid), 0) == 0 || errno == EPERM;
      const bool complete = seen.ready.load(std::memory_order_acquire) != 0;
      if (seen.key != key || seen.bytes != bytes || seen.parts * seen.part_bytes < bytes) {
        // Other weights (the model's files changed, another format or split): never served; it is
        // replaced. Processes that mapped it keep their copy until they unmap it.
        ::close(fd);
        if (!complete && creator_alive) {
          return absl::UnavailableError(absl::StrCat("shared memory ", path, " is being filled with other expert ",
                                                     "weights by process ", seen.creator_pid,
                                                     "; try again when it is done, or choose another name"));
        }
        ::shm_unlink(path.c_str());
        UnlinkOtherParts(path);
        replaced = true;
        continue;
      }
      if (!complete) {
        ::close(fd);
        if (creator_alive) {
          return absl::UnavailableError(absl::StrCat("shared memory ", path, " is still being filled by process ",
                                                     seen.creator_pid, "; try again when it is done"));
        }
        ::shm_unlink(path.c_str());  // its creator died mid-load: start over
        UnlinkOtherParts(path);
        continue;
      }
    } else if (::ftruncate(fd, static_cast<off_t>(kHugePage + part_bytes)) != 0) {
      const int err = errno;
      ::close(fd);
      ::shm_unlink(path.c_str());
      return absl::ResourceExhaustedError(absl::StrCat("shared memory ", path, ": cannot size to ",
                                                       (kHugePage + part_bytes) >> 20, " MiB: ", std::strerror(err)));
    }
    const int n_parts = created ? parts : static_cast<int>(seen.parts);
    const size_t n_part_bytes = created ? part_bytes : static_cast<size_t>(seen.part_bytes);
    const size_t map_size = kHugePage + n_parts * n_part_bytes;
    uint8_t* aligned = ReserveAligned(map_size);
    void* p = aligned == nullptr ? MAP_FAILED
                                 : ::mmap(aligned, kHugePage + n_part_bytes,
                                          created ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0);
    const int map_err = errno;
    ::close(fd);
    auto fail = [&](absl::Status status) {
      if (aligned != nullptr) ::munmap(aligned, map_size);
      if (created) {
        ::shm_unlink(path.c_str());
        UnlinkOtherParts(path);
      }
      return status;
    };
    if (p == MAP_FAILED) {
      return fail(absl::ResourceExhaustedError(
          absl::StrCat("shared memory ", path, ": mmap failed: ", std::strerror(map_err))));
    }
    auto* header = static_cast<SegmentHeader*>(p);
    if (created) {  // at once, so that others see who is filling it
      std::memcpy(header->magic, kMagic, 8);
      header->version = kVersion;
      header->key = key;
      header->bytes = bytes;
      header->creator_pid = ::getpid();
      header->parts = static_cast<uint32_t>(parts);
      header->part_bytes = part_bytes;
      header->ready.store(0, std::memory_order_release);
      UnlinkOtherParts(path);  // parts a dead creator may have left
    }
    for (int part = 1; part < n_parts; ++part) {
      if (absl::Status st = MapPart(path, part, n_part_bytes, created, aligned + kHugePage + part * n_part_bytes);
          !st.ok()) {
        return fail(st);
      }
    }
    arena->attached_ = !created;
    arena->mapping_ = aligned;
    arena->mapping_size_ = map_size;
    arena->header_ = header;
    arena->data_ = aligned + kHugePage;
    arena->size_ = bytes;
    arena->page_kind_ = absl::StrCat("shared memory ", path, n_parts > 1 ? absl::StrCat(" in ", n_parts, " parts") : "",
                                     !created   ? " (attached)"
                                     : replaced ? " (created, replacing a segment of other expert weights)"
                                                : " (created)");
    return arena;
  }
  return absl::UnavailableError(absl::StrCat("shared memory ", path, ": could not replace a stale segment"));
}

absl::Status HostArena::Unlink(const std::string& name) {
  const std::string path = SegmentPath(name);
  if (::shm_unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::InternalError(absl::StrCat("shared memory ", path, ": ", std::strerror(errno)));
  }
  UnlinkOtherParts(path);
  return absl::OkStatus();
}

void HostArena::Publish() {
  if (header_ != nullptr && !attached_) header_->ready.store(1, std::memory_order_release);
}

HostArena::~HostArena() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
}

}  // namespace moe::experts
