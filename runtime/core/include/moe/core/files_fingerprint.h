// What identifies the content of a model folder's weight files without reading them: each file's
// name, size and modification time. Caches built from the files (a shared expert arena) carry it,
// so that a folder whose files were replaced is never served from a copy of the old ones.
#pragma once

#include <string>

namespace moe::core {

// A hex fingerprint of the regular files directly in `dir` whose names end in ".safetensors" or
// ".json" (config.json, the shard index): their names, sizes and modification times in
// nanoseconds, in name order, symbolic links followed. Rewriting, replacing or adding such a file
// changes it. A folder that cannot be read gives the fingerprint of no files (what depends on it
// then fails on its own when it reads the folder).
std::string WeightFilesFingerprint(const std::string& dir);

}  // namespace moe::core
