#include "moe/experts/arena.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe::experts {

constexpr size_t kHugePage = 2u << 20;
constexpr char kMagic[8] = {'M', 'O', 'E', 'A', 'R', 'E', 'N', 'A'};
constexpr uint32_t kVersion = 1;

// The first 2 MiB of a shared segment; the data starts after it, 2 MiB aligned.
struct SegmentHeader {
  char magic[8];
  uint32_t version;
  std::atomic<uint32_t> ready;
  uint64_t key;
  uint64_t bytes;
  int64_t creator_pid;
};

namespace {

size_t RoundUp(size_t v, size_t m) { return (v + m - 1) / m * m; }

std::string SegmentPath(const std::string& name) { return name[0] == '/' ? name : "/" + name; }

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

absl::StatusOr<std::unique_ptr<HostArena>> HostArena::OpenShared(const std::string& name, uint64_t key, size_t bytes) {
  const std::string path = SegmentPath(name);
  const size_t total = kHugePage + RoundUp(std::max<size_t>(bytes, 1), kHugePage);
  std::unique_ptr<HostArena> arena(new HostArena());
  for (int attempt = 0; attempt < 2; ++attempt) {
    int fd = ::shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    const bool created = fd >= 0;
    if (!created) {
      if (errno != EEXIST) {
        return absl::ResourceExhaustedError(absl::StrCat("shared memory ", path, ": ", std::strerror(errno)));
      }
      fd = ::shm_open(path.c_str(), O_RDONLY, 0);
      if (fd < 0) return absl::UnavailableError(absl::StrCat("shared memory ", path, ": ", std::strerror(errno)));
    } else if (::ftruncate(fd, static_cast<off_t>(total)) != 0) {
      const int err = errno;
      ::close(fd);
      ::shm_unlink(path.c_str());
      return absl::ResourceExhaustedError(
          absl::StrCat("shared memory ", path, ": cannot size to ", total >> 20, " MiB: ", std::strerror(err)));
    }
    struct stat st;
    if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < kHugePage) {
      ::close(fd);
      if (created) ::shm_unlink(path.c_str());
      return absl::UnavailableError(absl::StrCat("shared memory ", path, " is being created; try again"));
    }
    const size_t map_size = static_cast<size_t>(st.st_size);
    uint8_t* aligned = ReserveAligned(map_size);
    void* p = aligned == nullptr ? MAP_FAILED
                                 : ::mmap(aligned, map_size, created ? PROT_READ | PROT_WRITE : PROT_READ,
                                          MAP_SHARED | MAP_FIXED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) {
      if (created) ::shm_unlink(path.c_str());
      return absl::ResourceExhaustedError(absl::StrCat("shared memory ", path, ": mmap failed: ", std::strerror(errno)));
    }
    auto* header = static_cast<SegmentHeader*>(p);
    if (created) {
      std::memcpy(header->magic, kMagic, 8);
      header->version = kVersion;
      header->key = key;
      header->bytes = bytes;
      header->creator_pid = ::getpid();
      header->ready.store(0, std::memory_order_release);
      arena->attached_ = false;
    } else {
      const bool ours = std::memcmp(header->magic, kMagic, 8) == 0 && header->version == kVersion;
      if (!ours || header->key != key || header->bytes != bytes) {
        ::munmap(p, map_size);
        return absl::FailedPreconditionError(absl::StrCat(
            "shared memory ", path, " holds other expert weights (another model, format or layout); remove it ",
            "with `rm /dev/shm", path, "` or choose another name"));
      }
      if (header->ready.load(std::memory_order_acquire) == 0) {
        const bool creator_alive = ::kill(static_cast<pid_t>(header->creator_pid), 0) == 0 || errno == EPERM;
        ::munmap(p, map_size);
        if (creator_alive) {
          return absl::UnavailableError(absl::StrCat("shared memory ", path, " is still being filled by process ",
                                                     header->creator_pid, "; try again when it is done"));
        }
        ::shm_unlink(path.c_str());  // its creator died mid-load: start over
        continue;
      }
      arena->attached_ = true;
    }
    arena->mapping_ = static_cast<uint8_t*>(p);
    arena->mapping_size_ = map_size;
    arena->header_ = header;
    arena->data_ = arena->mapping_ + kHugePage;
    arena->size_ = bytes;
    arena->page_kind_ = absl::StrCat("shared memory ", path, arena->attached_ ? " (attached)" : " (created)");
    return arena;
  }
  return absl::UnavailableError(absl::StrCat("shared memory ", path, ": could not replace a stale segment"));
}

absl::Status HostArena::Unlink(const std::string& name) {
  const std::string path = SegmentPath(name);
  if (::shm_unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::InternalError(absl::StrCat("shared memory ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

void HostArena::Publish() {
  if (header_ != nullptr && !attached_) header_->ready.store(1, std::memory_order_release);
}

HostArena::~HostArena() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
}

}  // namespace moe::experts
