// Safetensors: an 8-byte little-endian header length N, N bytes of JSON mapping tensor names to
// {dtype, shape, data_offsets: [begin, end)} relative to the data section that follows.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "moe/core/memory.h"
#include "moe/core/status.h"
#include "moe/runtime/weight_source.h"
#include "nlohmann/json.hpp"

namespace moe::runtime {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

struct Entry {
  core::TensorView view;
  int file = 0;  // index into files_
};

class SafetensorsSource : public WeightSource {
 public:
  absl::Status AddFile(const std::string& path, const std::vector<std::string>* only_names);

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

absl::Status SafetensorsSource::AddFile(const std::string& path, const std::vector<std::string>* only_names) {
  MOE_ASSIGN_OR_RETURN(core::MappedFile file, core::MappedFile::Open(path));
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
  };
  if (file.size() < 8) return bad(absl::StrCat("file of ", file.size(), " bytes is too short for a safetensors header (truncated?)"));
  uint64_t header_len;
  std::memcpy(&header_len, file.data(), 8);
  if (header_len > kMaxHeaderBytes) return bad(absl::StrCat("bad header: claims ", header_len, " bytes of JSON"));
  if (8 + header_len > file.size()) {
    return bad(absl::StrCat("header of ", header_len, " bytes runs past the end of the ", file.size(),
                            "-byte file (truncated?)"));
  }
  const char* header_begin = reinterpret_cast<const char*>(file.data() + 8);
  Json header = Json::parse(header_begin, header_begin + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) return bad("bad header: not a JSON object");

  const uint8_t* data = file.data() + 8 + header_len;
  const uint64_t data_bytes = file.size() - 8 - header_len;
  const int file_index = static_cast<int>(files_.size());
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    if (only_names != nullptr && std::find(only_names->begin(), only_names->end(), name) == only_names->end()) {
      continue;  // the index assigns this tensor to another shard
    }
    // An init-capture: clang 14 (scripts/fuzz.sh) cannot capture a structured binding itself.
    auto where = [&, &name = name](const std::string& what) { return bad(absl::StrCat("tensor ", name, ": ", what)); };
    if (!info.is_object() || !info.contains("dtype") || !info.contains("shape") || !info.contains("data_offsets")) {
      return where("bad header entry (needs dtype, shape, data_offsets)");
    }
    const Json& dtype = info["dtype"];
    const Json& shape = info["shape"];
    const Json& offsets = info["data_offsets"];
    if (!dtype.is_string()) return where("dtype is not a string");
    auto type = core::DTypeFromName(dtype.get<std::string>());
    if (!type) return where(absl::StrCat("dtype ", dtype.get<std::string>(), " is not supported (BF16, F16, F32, I8, I32, I64)"));
    core::Shape dims;
    if (!shape.is_array()) return where("shape is not a list");
    for (const Json& d : shape) {
      if (!d.is_number_unsigned()) return where(absl::StrCat("bad shape ", shape.dump()));
      dims.push_back(d.get<int64_t>());
    }
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      return where(absl::StrCat("bad data_offsets ", offsets.dump()));
    }
    const uint64_t begin = offsets[0].get<uint64_t>();
    const uint64_t end = offsets[1].get<uint64_t>();
    const uint64_t want = static_cast<uint64_t>(core::NumElements(dims) * core::DTypeSize(*type));
    if (end < begin || end - begin != want) {
      return where(absl::StrCat("data_offsets [", begin, ", ", end, ") hold ", end - begin, " bytes but ",
                                core::ShapeString(dims), " ", dtype.get<std::string>(), " needs ", want));
    }
    if (end > data_bytes) {
      return where(absl::StrCat("data ends at byte ", end, " of the data section, but the file holds only ",
                                data_bytes, " bytes of data (truncated file?)"));
    }
    entries_[name] = Entry{core::TensorView{data + begin, *type, std::move(dims)}, file_index};
  }
  files_.push_back(std::move(file));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<WeightSource>> OpenIndexed(const std::string& model_dir, const std::string& index_path) {
  std::ifstream in(index_path);
  std::stringstream text;
  text << in.rdbuf();
  Json index = Json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": not a safetensors index (needs a weight_map object)"));
  }
  std::map<std::string, std::vector<std::string>> by_file;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map entry for ", name, " is not a file name"));
    }
    by_file[file.get<std::string>()].push_back(name);
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
  const std::string index = model_dir + "/model.safetensors.index.json";
  if (fs::exists(index)) return OpenIndexed(model_dir, index);
  const std::string single = model_dir + "/model.safetensors";
  if (fs::exists(single)) return OpenSafetensorsFile(single);
  return absl::NotFoundError(absl::StrCat(model_dir, ": no model.safetensors or model.safetensors.index.json"));
}

}  // namespace moe::runtime
