#include "moe/core/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe::core {
namespace {

// Closes a descriptor on every return path.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

std::string Bytes(size_t n) {
  if (n >= (size_t{1} << 20) && n % (size_t{1} << 20) == 0) return absl::StrCat(n >> 20, " MiB");
  return absl::StrCat(n, " bytes");
}

}  // namespace

const char* FileTypeName(unsigned int st_mode) {
  if (S_ISDIR(st_mode)) return "a directory";
  if (S_ISFIFO(st_mode)) return "a fifo";
  if (S_ISCHR(st_mode)) return "a character device";
  if (S_ISBLK(st_mode)) return "a block device";
  if (S_ISSOCK(st_mode)) return "a socket";
  if (S_ISREG(st_mode)) return "a regular file";
  return "a special file";
}

absl::Status OpenError(const std::string& path, int err) {
  if (err == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
  if (err == ELOOP) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is a symbolic link loop (its links lead back to themselves); point it at the real file"));
  }
  return absl::InvalidArgumentError(absl::StrCat(path, ": cannot open: ", std::strerror(err)));
}

absl::StatusOr<PathKind> StatPath(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    // ENOTDIR: a component of the path is a file, so nothing can be below it.
    if (err == ENOENT || err == ENOTDIR) return PathKind::kMissing;
    if (err == ELOOP) return OpenError(path, err);
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot examine: ", std::strerror(err)));
  }
  if (S_ISREG(st.st_mode)) return PathKind::kRegular;
  if (S_ISDIR(st.st_mode)) return PathKind::kDirectory;
  return PathKind::kOther;
}

absl::StatusOr<std::string> ReadBoundedFile(const std::string& path, size_t max_bytes, const std::string& what) {
  // O_NONBLOCK: opening a fifo for reading would otherwise wait for a writer.
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) return OpenError(path, errno);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot examine: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is ", FileTypeName(st.st_mode), ", not a regular file; ", what, " must be a file"));
  }
  auto too_large = [&](const std::string& size) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is ", size, ", more than the ", Bytes(max_bytes), " allowed for ", what));
  };
  if (static_cast<uint64_t>(st.st_size) > max_bytes) return too_large(Bytes(static_cast<size_t>(st.st_size)));
  std::string text;
  text.resize(static_cast<size_t>(st.st_size) + 1);
  size_t got = 0;
  for (;;) {
    if (got == text.size()) {
      if (text.size() > max_bytes) return too_large("longer than its size said");
      text.resize(std::min(max_bytes + 1, text.size() * 2 + 4096));
    }
    const ssize_t n = ::read(fd.get(), text.data() + got, text.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InvalidArgumentError(absl::StrCat(path, ": cannot read: ", std::strerror(errno)));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  if (got > max_bytes) return too_large("longer than its size said");
  text.resize(got);
  return text;
}

}  // namespace moe::core
