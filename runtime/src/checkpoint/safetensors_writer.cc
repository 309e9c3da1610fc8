#include "moe/runtime/safetensors_writer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace moe::runtime {

absl::StatusOr<SafetensorsWriter> SafetensorsWriter::Create(const std::string& path, std::vector<TensorEntry> tensors) {
  SafetensorsWriter w;
  w.path_ = path;
  w.tensors_ = std::move(tensors);
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["__metadata__"] = {{"format", "pt"}};
  int64_t offset = 0;
  for (const TensorEntry& t : w.tensors_) {
    w.offsets_.push_back(offset);
    header[t.name] = {
        {"dtype", core::DTypeName(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes()}}};
    offset += t.bytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data section 8-byte aligned
  const uint64_t header_len = text.size();
  w.data_start_ = 8 + header_len;
  w.size_ = w.data_start_ + offset;

  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot create: ", std::strerror(errno)));
  // Reserve the blocks now, so a full disk is an error here rather than a fault mid-write.
  int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(w.size_));
  if (rc == EOPNOTSUPP || rc == EINVAL) rc = ::ftruncate(fd, static_cast<off_t>(w.size_)) == 0 ? 0 : errno;
  if (rc != 0) {
    int err = rc;
    ::close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat(path, ": cannot size to ", w.size_, " bytes: ", std::strerror(err)));
  }
  void* map = ::mmap(nullptr, w.size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED)
    return absl::ResourceExhaustedError(absl::StrCat(path, ": mmap failed: ", std::strerror(errno)));
  w.map_ = map;
  std::memcpy(map, &header_len, 8);
  std::memcpy(static_cast<char*>(map) + 8, text.data(), text.size());
  return w;
}

SafetensorsWriter::SafetensorsWriter(SafetensorsWriter&& other) noexcept
    : path_(std::move(other.path_)),
      tensors_(std::move(other.tensors_)),
      offsets_(std::move(other.offsets_)),
      map_(std::exchange(other.map_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      data_start_(other.data_start_) {}

SafetensorsWriter::~SafetensorsWriter() {
  if (map_ != nullptr) ::munmap(map_, size_);
}

void* SafetensorsWriter::data(size_t i) const { return static_cast<char*>(map_) + data_start_ + offsets_[i]; }

absl::Status SafetensorsWriter::Finish() {
  if (map_ == nullptr) return absl::OkStatus();
  // The blocks were reserved up front; the page cache writes them back in its own time.
  int rc = ::munmap(map_, size_);
  map_ = nullptr;
  if (rc != 0) return absl::InternalError(absl::StrCat(path_, ": unmapping failed: ", std::strerror(errno)));
  return absl::OkStatus();
}

}  // namespace moe::runtime
