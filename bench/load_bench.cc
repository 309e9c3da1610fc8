#include "load_bench.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "moe/core/status.h"
#include "moe/experts/arena.h"
#include "moe/experts/expert_pool.h"
#include "nlohmann/json.hpp"

namespace moe::bench {
namespace {

constexpr int64_t kPiece = 8 << 20;    // bytes per direct read; a multiple of any O_DIRECT alignment
constexpr int64_t kChunk = 256 << 10;  // bytes per read from the page cache: they stay in L2

// Open file descriptors, closed on the way out.
struct Fds {
  std::vector<int> fds;
  ~Fds() {
    for (int fd : fds) ::close(fd);
  }
};

// Copies n bytes to dst with streaming stores (they bypass the caches, as the packer's do).
void StreamCopy(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__SSE2__)
  const size_t head = std::min(n, static_cast<size_t>(-reinterpret_cast<uintptr_t>(dst) & 15));
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 16 <= n; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
  }
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();
#else
  std::memcpy(dst, src, n);
#endif
}

// Reads the files whole with `threads` threads: the 8 MiB pieces of all files, in order, are cut
// into one run of pieces per thread (as the load's parallel loop gives each thread a run of
// experts: with a shared arena in parts, the threads then fill different parts), and each thread
// reads its run into its own buffer, `chunk` bytes per pread, calling sink(offset across the
// files, bytes, n) after each (if given). Returns GB/s of file bytes.
using Sink = std::function<void(int64_t, const uint8_t*, int64_t)>;
absl::StatusOr<double> ReadPieces(const std::vector<std::string>& files, int threads, bool direct, int64_t chunk,
                                  const Sink& sink) {
  struct Piece {
    int file;
    int64_t offset, global;  // in the file, and across the files
  };
  std::vector<Piece> pieces;
  Fds fds;
  int64_t total = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    const int fd = ::open(files[i].c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    if (fd < 0) {
      if (direct && errno == EINVAL) {
        return absl::UnimplementedError(absl::StrCat(files[i], ": the filesystem refuses O_DIRECT"));
      }
      return absl::NotFoundError(absl::StrCat(files[i], ": cannot open: ", std::strerror(errno)));
    }
    fds.fds.push_back(fd);
    struct stat st;
    if (::fstat(fd, &st) != 0) return absl::InternalError(absl::StrCat(files[i], ": cannot stat"));
    for (int64_t o = 0; o < st.st_size; o += kPiece) pieces.push_back({static_cast<int>(i), o, total + o});
    total += st.st_size;
  }
  threads = std::max(1, threads);
  std::atomic<int> failure{0};  // errno of the first failed read
  auto reader = [&](size_t first, size_t end) {
    // O_DIRECT needs an aligned buffer; 2 MiB also suits huge pages.
    std::unique_ptr<void, decltype(&std::free)> buffer(std::aligned_alloc(2 << 20, kPiece), &std::free);
    if (buffer == nullptr) {
      failure = ENOMEM;
      return;
    }
    auto* data = static_cast<uint8_t*>(buffer.get());
    for (size_t p = first; p < end && failure.load() == 0; ++p) {
      const int fd = fds.fds[pieces[p].file];
      for (int64_t c0 = 0; c0 < kPiece;) {  // chunk after chunk
        int64_t done = 0;
        while (done < chunk) {
          const ssize_t n = ::pread(fd, data + done, chunk - done, pieces[p].offset + c0 + done);
          if (n < 0 && errno == EINTR) continue;
          if (n < 0) {
            int expected = 0;
            failure.compare_exchange_strong(expected, errno);
            return;
          }
          if (n == 0) break;  // end of file
          done += n;
          if (direct && done % 4096 != 0) break;  // a short direct read ends at end of file
        }
        if (sink && done > 0) sink(pieces[p].global + c0, data, done);
        if (done < chunk) break;
        c0 += done;
      }
    }
  };
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back(reader, t * pieces.size() / threads, (t + 1) * pieces.size() / threads);
  }
  for (std::thread& t : pool) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (const int err = failure.load(); err != 0) {
    if (direct && err == EINVAL) return absl::UnimplementedError("the filesystem refuses O_DIRECT reads");
    return absl::InternalError(absl::StrCat("reading the checkpoint files: ", std::strerror(err)));
  }
  return static_cast<double>(total) / std::max(secs, 1e-9) / 1e9;
}

// Bytes the files hold in all.
absl::StatusOr<int64_t> TotalBytes(const std::vector<std::string>& files) {
  int64_t total = 0;
  for (const std::string& f : files) {
    std::error_code ec;
    const uintmax_t size = std::filesystem::file_size(f, ec);
    if (ec) return absl::NotFoundError(absl::StrCat(f, ": cannot stat: ", ec.message()));
    total += static_cast<int64_t>(size);
  }
  return total;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> CheckpointFiles(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> files;
  // increment(ec), not a range-for: its operator++ throws on an error, which would abort the bench.
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() == ".safetensors") files.push_back(it->path().string());
  }
  if (ec) return absl::NotFoundError(absl::StrCat(dir, ": cannot list: ", ec.message()));
  if (files.empty()) return absl::NotFoundError(absl::StrCat(dir, ": no .safetensors files"));
  std::sort(files.begin(), files.end());
  return files;
}

absl::StatusOr<double> CachedShare(const std::vector<std::string>& files) {
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  int64_t total = 0, cached = 0;
  for (const std::string& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return absl::NotFoundError(absl::StrCat(f, ": cannot open: ", std::strerror(errno)));
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      return absl::InternalError(absl::StrCat(f, ": cannot stat: ", std::strerror(errno)));
    }
    const int64_t size = st.st_size;
    total += size;
    if (size == 0) {
      ::close(fd);
      continue;
    }
    // Mapping the file reads nothing; mincore says which of its pages are resident.
    void* addr = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (addr == MAP_FAILED) return absl::InternalError(absl::StrCat(f, ": cannot map: ", std::strerror(errno)));
    std::vector<unsigned char> resident(static_cast<size_t>((size + page - 1) / page));
    const int rc = ::mincore(addr, static_cast<size_t>(size), resident.data());
    const int err = errno;
    ::munmap(addr, static_cast<size_t>(size));
    if (rc != 0) return absl::InternalError(absl::StrCat(f, ": mincore: ", std::strerror(err)));
    for (size_t p = 0; p < resident.size(); ++p) {
      if (resident[p] & 1) cached += std::min<int64_t>(page, size - static_cast<int64_t>(p) * page);
    }
  }
  return total == 0 ? 1.0 : static_cast<double>(cached) / static_cast<double>(total);
}

absl::StatusOr<double> ReadFilesGbps(const std::vector<std::string>& files, int threads, bool direct) {
  // From the page cache in chunks that stay in the thread's L2 (a whole piece per read would
  // write the buffer out to memory as well); past it, whole pieces: the disk wants large reads.
  return ReadPieces(files, threads, direct, direct ? kPiece : kChunk, nullptr);
}

absl::StatusOr<double> CopyFilesGbps(const std::vector<std::string>& files, int threads, uint8_t* dst,
                                     size_t dst_bytes) {
  // Read and written from the thread's L2, in chunks.
  auto total = TotalBytes(files);
  if (!total.ok()) return total.status();
  if (*total == 0) return 0.0;
  const auto share = [&](int64_t g) {
    return static_cast<size_t>(static_cast<unsigned __int128>(g) * dst_bytes / static_cast<uint64_t>(*total));
  };
  return ReadPieces(files, threads, /*direct=*/false, kChunk, [&](int64_t g, const uint8_t* data, int64_t n) {
    const size_t d0 = share(g), d1 = share(g + n);
    StreamCopy(dst + d0, data, std::min<size_t>(d1 - d0, static_cast<size_t>(n)));
  });
}

namespace {

constexpr int kDiskReadsInFlight = 16;

// Fresh memory of the arena's kind and size: a private arena, or a shared one of the same cut
// under NAME-bound (removed when the returned arena goes).
struct FreshArena {
  std::unique_ptr<experts::HostArena> arena;
  std::string shm_name;
  ~FreshArena() {
    arena.reset();
    if (!shm_name.empty()) experts::HostArena::Unlink(shm_name).IgnoreError();
  }
};

absl::Status MakeFreshArena(const experts::HostArena& like, const std::string& shm_name, FreshArena* fresh) {
  if (shm_name.empty()) {
    MOE_ASSIGN_OR_RETURN(fresh->arena, experts::HostArena::CreatePrivate(like.size()));
    return absl::OkStatus();
  }
  fresh->shm_name = shm_name + "-bound";
  MOE_RETURN_IF_ERROR(experts::HostArena::Unlink(fresh->shm_name));  // one a killed run left
  MOE_ASSIGN_OR_RETURN(fresh->arena, experts::HostArena::OpenShared(fresh->shm_name, /*key=*/0, like.size()));
  return absl::OkStatus();
}

absl::Status MeasureLoadBound(const std::vector<std::string>& files, double cached_before, int threads,
                              const experts::HostArena& arena, const std::string& shm_name, LoadBound* bound) {
  // Past the page cache first, which leaves it as it is; then a read that brings every page in
  // (the load read only the experts' parts of the files), and the timed ones.
  // Disk reads with at least kDiskReadsInFlight in flight: a deep queue is what the disk needs to
  // reach its speed (the load's mapped reads get the kernel's readahead).
  absl::StatusOr<double> disk = 0.0;
  if (cached_before < 1.0) disk = ReadFilesGbps(files, std::max(threads, kDiskReadsInFlight), /*direct=*/true);
  MOE_RETURN_IF_ERROR(ReadFilesGbps(files, threads, /*direct=*/false).status());
  for (int repeat = 0; repeat < 3; ++repeat) {  // the best of three
    MOE_ASSIGN_OR_RETURN(const double gbps, ReadFilesGbps(files, threads, /*direct=*/false));
    bound->page_cache_gbps = std::max(bound->page_cache_gbps, gbps);
  }
  double seconds_per_gb = cached_before / bound->page_cache_gbps;
  if (cached_before < 1.0) {
    if (disk.ok()) {
      bound->disk_gbps = *disk;
      seconds_per_gb += (1.0 - cached_before) / *disk;
    } else if (disk.status().code() == absl::StatusCode::kUnimplemented) {
      // Without the disk's speed the page cache's is the bound: stricter than the truth.
      bound->disk_note = "disk speed not measured: " + std::string(disk.status().message());
      seconds_per_gb += (1.0 - cached_before) / bound->page_cache_gbps;
    } else {
      return disk.status();
    }
  }
  bound->gbps = 1.0 / seconds_per_gb;
  // A load also fills the arena: each new page is zeroed by the kernel, then written. Copying the
  // files into fresh memory of the arena's kind and size, with the same threads, is the least any
  // load from the page cache can do (best of three, each into memory never touched).
  for (int repeat = 0; repeat < 3; ++repeat) {
    FreshArena fresh;
    MOE_RETURN_IF_ERROR(MakeFreshArena(arena, shm_name, &fresh));
    MOE_ASSIGN_OR_RETURN(const double gbps, CopyFilesGbps(files, threads, fresh.arena->data(), fresh.arena->size()));
    bound->copy_gbps = std::max(bound->copy_gbps, gbps);
  }
  bound->copy_bound_gbps =
      1.0 / (seconds_per_gb - cached_before / bound->page_cache_gbps + cached_before / bound->copy_gbps);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LoadBenchResult> RunLoadBench(const std::string& model_dir, const std::string& shm_name,
                                             const ExpertPoolLoader& load) {
  // What the page cache holds before the load decides its bound: page-cache or disk speed. (A
  // directory the load cannot use gets the load's own error below.)
  auto files = CheckpointFiles(model_dir);
  absl::StatusOr<double> cached_before = files.ok() ? CachedShare(*files) : files.status();
  const auto start = std::chrono::steady_clock::now();
  MOE_ASSIGN_OR_RETURN(const experts::ExpertPool* pool, load());
  LoadBenchResult r;
  r.model_load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.pool = pool->Describe();
  r.attached = pool->arena().attached();
  r.threads = pool->threads();
  r.arena_bytes = static_cast<int64_t>(pool->arena().size());
  r.pages = pool->arena().page_kind();
  r.checkpoint_bytes = pool->loaded_bytes();
  r.expert_seconds = pool->load_seconds();
  r.load_gbps = r.attached ? 0.0 : pool->loaded_bytes() / 1e9 / std::max(pool->load_seconds(), 1e-9);
  // The bound: the files read whole by as many threads as the pool has. Read again after the
  // load they come from the page cache; the share that was not cached before is timed at the
  // disk's speed, read past the page cache.
  if (!r.attached) {
    if (!cached_before.ok()) return cached_before.status();
    r.cached_before = *cached_before;
    MOE_RETURN_IF_ERROR(MeasureLoadBound(*files, *cached_before, pool->threads(), pool->arena(), shm_name, &r.bound));
  }
  r.ratio = r.bound.gbps > 0 ? r.load_gbps / r.bound.gbps : 0.0;
  r.copy_ratio = r.bound.copy_bound_gbps > 0 ? r.load_gbps / r.bound.copy_bound_gbps : 0.0;
  return r;
}

void PrintLoadBench(const LoadBenchResult& r, bool json, std::ostream& out) {
  const LoadBound& bound = r.bound;
  if (json) {
    nlohmann::ordered_json j = {{"attached", r.attached},
                                {"arena_bytes", r.arena_bytes},
                                {"checkpoint_bytes", r.checkpoint_bytes},
                                {"expert_seconds", r.expert_seconds},
                                {"load_gbps", r.load_gbps},
                                {"model_load_seconds", r.model_load_seconds},
                                {"pages", r.pages},
                                {"cached_before", r.cached_before},
                                {"page_cache_gbps", bound.page_cache_gbps},
                                {"disk_gbps", bound.disk_gbps},
                                {"read_gbps", bound.gbps},
                                {"ratio", r.ratio},
                                {"copy_gbps", bound.copy_gbps},
                                {"copy_bound_gbps", bound.copy_bound_gbps},
                                {"copy_ratio", r.copy_ratio}};
    out << j.dump() << std::endl;
    return;
  }
  out << r.pool << "\n";
  if (r.attached) {
    out << absl::StrFormat("attached to the published arena in %.3f s (model load %.3f s)\n", r.expert_seconds,
                           r.model_load_seconds);
    return;
  }
  out << absl::StrFormat("loaded %.2f GB of checkpoint experts in %.2f s: %.2f GB/s (model load %.2f s)\n",
                         r.checkpoint_bytes / 1e9, r.expert_seconds, r.load_gbps, r.model_load_seconds);
  out << absl::StrFormat(
      "the checkpoint files (%.0f%% in the page cache before the load) read at %.2f GB/s "
      "from the page cache",
      100 * r.cached_before, bound.page_cache_gbps);
  if (bound.disk_gbps > 0) {
    out << absl::StrFormat(" and %.2f GB/s from disk (%d reads at a time)", bound.disk_gbps,
                           std::max(r.threads, kDiskReadsInFlight));
  }
  if (!bound.disk_note.empty()) out << " (" << bound.disk_note << ")";
  out << absl::StrFormat(" with %d threads: the load ran at %.0f%% of the %.2f GB/s they allow\n", r.threads,
                         100 * r.ratio, bound.gbps);
  out << absl::StrFormat(
      "copied from the page cache into fresh memory of the arena's kind and size (%.2f GB), "
      "the files went at %.2f GB/s: the load ran at %.0f%% of the %.2f GB/s that allows\n",
      r.arena_bytes / 1e9, bound.copy_gbps, 100 * r.copy_ratio, bound.copy_bound_gbps);
}

}  // namespace moe::bench
