// Safetensors: an 8-byte little-endian header length N, N bytes of JSON mapping tensor names to
// {dtype, shape, data_offsets: [begin, end)} relative to the data section that follows.
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "moe/core/file.h"
#include "moe/core/json.h"
#include "moe/core/memory.h"
#include "moe/core/status.h"
#include "moe/runtime/weight_source.h"
#include "nlohmann/json.hpp"

namespace moe::runtime {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

// The reference implementation refuses headers above 100 MB; a length above that, or above what
// the file holds, is refused before anything is allocated for it.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// DeepSeek-V3's index, ~91,000 tensors, is under 9 MiB.
constexpr size_t kMaxIndexBytes = size_t{64} << 20;

struct Entry {
  core::TensorView view;
  int file = 0;  // index into files_
};

class SafetensorsSource : public WeightSource {
 public:
  // Maps `path` and checks its header; with `only_names`, keeps only those tensors.
  absl::Status AddFile(const std::string& path, const std::set<std::string>* only_names);

  absl::StatusOr<core::TensorView> Get(const std::string& name) const override {
    auto it = entries_.find(name);
    if (it == entries_.end()) {
      return absl::NotFoundError(absl::StrCat("tensor ", name, " is missing from ", Where()));
    }
    return it->second.view;
  }
  bool Has(const std::string& name) const override { return entries_.count(name) > 0; }
  std::string FileOf(const std::string& name) const override {
    auto it = entries_.find(name);
    return it == entries_.end() ? "" : fs::path(files_[it->second.file].path()).filename().string();
  }
  std::vector<std::string> Names() const override {
    std::vector<std::string> names;
    names.reserve(entries_.size());
    for (const auto& [name, e] : entries_) names.push_back(name);
    return names;
  }

 private:
  std::string Where() const {
    if (files_.size() == 1) return files_[0].path();
    return absl::StrCat(files_.size(), " files in ", fs::path(files_[0].path()).parent_path().string());
  }

  std::vector<core::MappedFile> files_;
  std::map<std::string, Entry> entries_;
};

// The bytes a tensor of `dims` x `dtype_size` takes, or nullopt when that count does not fit in
// 63 bits (a header can claim any shape; the product must not wrap).
std::optional<uint64_t> TensorBytes(const std::vector<uint64_t>& dims, uint64_t dtype_size) {
  uint64_t bytes = dtype_size;
  for (uint64_t d : dims) {
    if (__builtin_mul_overflow(bytes, d, &bytes)) return std::nullopt;
  }
  if (bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return bytes;
}

std::string DimsString(const std::vector<uint64_t>& dims) { return absl::StrCat("[", absl::StrJoin(dims, ", "), "]"); }

absl::Status SafetensorsSource::AddFile(const std::string& path, const std::set<std::string>* only_names) {
  MOE_ASSIGN_OR_RETURN(core::MappedFile file, core::MappedFile::Open(path));
  auto bad = [&](const std::string& what) { return absl::InvalidArgumentError(absl::StrCat(path, ": ", what)); };
  if (file.size() < 8) {
    return bad(absl::StrCat("file of ", file.size(), " bytes is too short for a safetensors header (truncated?)"));
  }
  uint64_t header_len;
  std::memcpy(&header_len, file.data(), 8);
  if (header_len > kMaxHeaderBytes) {
    return bad(absl::StrCat("bad header: its length field says ", header_len, " bytes, more than the ",
                            kMaxHeaderBytes >> 20, " MiB the safetensors format allows (not a safetensors file?)"));
  }
  if (header_len > file.size() - 8) {
    return bad(absl::StrCat("header of ", header_len, " bytes runs past the end of the ", file.size(),
                            "-byte file (truncated?)"));
  }
  const std::string_view header_text(reinterpret_cast<const char*>(file.data() + 8), header_len);
  MOE_ASSIGN_OR_RETURN(const Json header, core::ParseJsonObject(header_text, absl::StrCat(path, " header")));

  const uint8_t* data = file.data() + 8 + header_len;
  const uint64_t data_bytes = file.size() - 8 - header_len;
  const int file_index = static_cast<int>(files_.size());
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    if (only_names != nullptr && only_names->count(name) == 0) continue;  // the index puts it in another shard
    // An init-capture: clang 14 (scripts/fuzz.sh) cannot capture a structured binding itself.
    auto where = [&, &name = name](const std::string& what) { return bad(absl::StrCat("tensor ", name, ": ", what)); };
    if (!info.is_object() || !info.contains("dtype") || !info.contains("shape") || !info.contains("data_offsets")) {
      return where("bad header entry (needs dtype, shape, data_offsets)");
    }
    const Json& dtype = info["dtype"];
    const Json& shape = info["shape"];
    const Json& offsets = info["data_offsets"];
    if (!dtype.is_string()) return where(absl::StrCat("dtype must be a string, found ", core::DescribeJson(dtype)));
    auto type = core::DTypeFromName(dtype.get<std::string>());
    if (!type) {
      const std::string& shown = dtype.get_ref<const std::string&>();
      return where(absl::StrCat("dtype ", shown.size() > 16 ? absl::StrCat(shown.substr(0, 16), "...") : shown,
                                " is not supported (BF16, F16, F32, F8_E4M3, I8, I32, I64)"));
    }
    const std::string type_name = core::DTypeName(*type);
    if (!shape.is_array()) return where(absl::StrCat("shape must be a list, found ", core::DescribeJson(shape)));
    std::vector<uint64_t> dims;
    for (const Json& d : shape) {
      if (!d.is_number_unsigned()) {
        return where(absl::StrCat("bad shape: dimension ", dims.size(), " is ", core::DescribeJson(d),
                                  ", not a non-negative integer"));
      }
      dims.push_back(d.get<uint64_t>());
    }
    const std::optional<uint64_t> want = TensorBytes(dims, core::DTypeSize(*type));
    if (!want) {
      return where(absl::StrCat("shape ", DimsString(dims), " ", type_name,
                                " is too large: its byte count does not fit in 63 bits"));
    }
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      return where(absl::StrCat("data_offsets must be two non-negative integers [begin, end], found ",
                                core::DescribeJson(offsets)));
    }
    const uint64_t begin = offsets[0].get<uint64_t>();
    const uint64_t end = offsets[1].get<uint64_t>();
    if (end < begin) return where(absl::StrCat("data_offsets [", begin, ", ", end, ") end before they begin"));
    if (end - begin != *want) {
      return where(absl::StrCat("data_offsets [", begin, ", ", end, ") hold ", end - begin, " bytes but ",
                                DimsString(dims), " ", type_name, " needs ", *want));
    }
    if (end > data_bytes) {
      return where(absl::StrCat("data ends at byte ", end, " of the data section, but the file holds only ", data_bytes,
                                " bytes of data (truncated file?)"));
    }
    // Every dimension fits in int64 here: the product does, and a zero-size tensor has no bytes
    // to reach, but its other dimensions may still be huge.
    core::Shape view_dims;
    for (uint64_t d : dims) {
      if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return where(absl::StrCat("bad shape ", DimsString(dims), ": dimension ", d, " does not fit in 63 bits"));
      }
      view_dims.push_back(static_cast<int64_t>(d));
    }
    entries_[name] = Entry{core::TensorView{data + begin, *type, std::move(view_dims)}, file_index};
  }
  files_.push_back(std::move(file));
  return absl::OkStatus();
}

// Why `file`, a weight_map value, is not a plain relative name inside the model folder, or ""
// when it is. Shards are opened as `<model_dir>/<file>`; the file itself may be a symbolic link
// leading anywhere (the Hugging Face cache links snapshots to ../../blobs/), but the name in the
// index may not leave the folder.
std::string ShardNameProblem(const std::string& file) {
  if (file.empty()) return "is empty";
  if (file.find('\0') != std::string::npos) return "holds a NUL byte";
  if (file.front() == '/') return "is an absolute path";
  for (const absl::string_view part : absl::StrSplit(file, '/')) {
    if (part == "..") return "has a '..' component";
  }
  return "";
}

absl::StatusOr<std::unique_ptr<WeightSource>> OpenIndexed(const std::string& model_dir, const std::string& index_path) {
  MOE_ASSIGN_OR_RETURN(const std::string text,
                       core::ReadBoundedFile(index_path, kMaxIndexBytes, "model.safetensors.index.json"));
  MOE_ASSIGN_OR_RETURN(const Json index, core::ParseJsonObject(text, index_path));
  auto map = index.find("weight_map");
  if (map == index.end() || !map->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path, ": not a safetensors index (needs a weight_map object, found ",
                     map == index.end() ? std::string("none") : core::DescribeJson(*map), ")"));
  }
  if (map->empty()) return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map lists no tensors"));
  std::map<std::string, std::set<std::string>> by_file;
  for (const auto& [name, file] : map->items()) {
    if (!file.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map entry for tensor ", name,
                                                     " must be a file name, found ", core::DescribeJson(file)));
    }
    const std::string shard = file.get<std::string>();
    if (const std::string problem = ShardNameProblem(shard); !problem.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map entry for tensor ", name, " is ",
                                                     core::DescribeJson(file), ", which ", problem,
                                                     "; shards must be named by a relative path inside ", model_dir));
    }
    by_file[shard].insert(name);
  }
  auto source = std::make_unique<SafetensorsSource>();
  for (const auto& [file, names] : by_file) {
    const std::string path = model_dir + "/" + file;
    MOE_RETURN_IF_ERROR(core::Annotate(source->AddFile(path, &names), "loading a shard listed in " + index_path));
    for (const std::string& name : names) {
      if (!source->Has(name)) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, " lists tensor ", name, " in ", file, ", but that file does not hold it"));
      }
    }
  }
  return source;
}

}  // namespace

absl::StatusOr<std::unique_ptr<WeightSource>> OpenSafetensorsFile(const std::string& path) {
  auto source = std::make_unique<SafetensorsSource>();
  MOE_RETURN_IF_ERROR(source->AddFile(path, nullptr));
  return source;
}

absl::StatusOr<std::unique_ptr<WeightSource>> OpenSafetensors(const std::string& model_dir) {
  // StatPath rather than std::filesystem::exists, which throws on a symbolic link loop. Anything
  // present that is not a regular file is opened anyway, for the error that names what it is.
  const std::string index = model_dir + "/model.safetensors.index.json";
  MOE_ASSIGN_OR_RETURN(const core::PathKind index_kind, core::StatPath(index));
  if (index_kind != core::PathKind::kMissing) return OpenIndexed(model_dir, index);
  const std::string single = model_dir + "/model.safetensors";
  MOE_ASSIGN_OR_RETURN(const core::PathKind single_kind, core::StatPath(single));
  if (single_kind != core::PathKind::kMissing) return OpenSafetensorsFile(single);
  return absl::NotFoundError(absl::StrCat(model_dir, ": no model.safetensors or model.safetensors.index.json"));
}

}  // namespace moe::runtime
