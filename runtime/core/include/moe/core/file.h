// Reading the small files of a model folder (config.json, the shard index) with a size limit, and
// asking what a path is, without std::filesystem (whose throwing calls abort a process on a
// symbolic link loop) and without blocking on a fifo.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe::core {

enum class PathKind { kMissing, kRegular, kDirectory, kOther };

// What `path` is once symbolic links are followed; a dangling link is kMissing. A symbolic link
// loop or a path that cannot be examined (no permission) is kInvalidArgument naming the path.
absl::StatusOr<PathKind> StatPath(const std::string& path);

// The whole content of the regular file `path`. `what` names the kind of file for the limit's
// message ("config.json"). kNotFound if it does not exist; kInvalidArgument if it is a symbolic
// link loop, not a regular file (a device, fifo or directory), or longer than `max_bytes`. A fifo
// is refused without waiting for a writer; at most max_bytes + 1 bytes are ever read, so a file
// that grows while it is read (or reports no size, as /proc files do) cannot exhaust memory.
absl::StatusOr<std::string> ReadBoundedFile(const std::string& path, size_t max_bytes, const std::string& what);

// The error for `err` (an errno) from opening `path`: kNotFound for ENOENT, otherwise
// kInvalidArgument; ELOOP reads "<path> is a symbolic link loop".
absl::Status OpenError(const std::string& path, int err);

// "a directory", "a fifo", "a character device", ... for a stat mode that is not a regular file.
const char* FileTypeName(unsigned int st_mode);

}  // namespace moe::core
