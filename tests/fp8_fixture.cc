#include "fp8_fixture.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "moe/runtime/weight_source.h"
#include "test_util.h"

namespace moe::testing {
namespace {

// The tensors an FP8 release quantizes: the projections and the experts (not the embedding, the
// norms, the router or its correction bias).
bool Quantized(const std::string& name, const core::Shape& shape) {
  if (shape.size() != 2) return false;
  for (const char* kept : {"embed_tokens", "norm", "mlp.gate.weight", "shared_expert_gate", "lm_head"}) {
    if (name.find(kept) != std::string::npos) return false;
  }
  return true;
}

struct Fp8Tensor {
  std::vector<uint8_t> codes;
  std::vector<float> scales;  // as stored (bf16-rounded when the layout's scales are bf16)
  core::Shape scale_shape;
  std::vector<float> values;  // what the codes stand for: code * scale, in fp32
};

// Quantizes [rows x cols] values as the FP8 releases do: per block, scale = amax / 448, codes
// rounded to nearest.
Fp8Tensor Quantize(const std::vector<float>& x, int64_t rows, int64_t cols, const Fp8Layout& l) {
  Fp8Tensor t;
  const int64_t br = (rows + l.block_rows - 1) / l.block_rows, bc = (cols + l.block_cols - 1) / l.block_cols;
  t.scale_shape = {br, bc};
  t.scales.assign(br * bc, 1.0f);
  t.codes.resize(rows * cols);
  t.values.resize(rows * cols);
  for (int64_t i = 0; i < br; ++i) {
    for (int64_t j = 0; j < bc; ++j) {
      float amax = 0;
      for (int64_t r = i * l.block_rows; r < std::min(rows, (i + 1) * l.block_rows); ++r) {
        for (int64_t c = j * l.block_cols; c < std::min(cols, (j + 1) * l.block_cols); ++c) {
          amax = std::max(amax, std::fabs(x[r * cols + c]));
        }
      }
      float s = amax > 0 ? amax / core::kF8E4M3Max : 1.0f;
      if (l.scale_dtype == core::DType::kBF16) s = core::Bf16ToFloat(core::FloatToBf16(s));
      t.scales[i * bc + j] = s;
      for (int64_t r = i * l.block_rows; r < std::min(rows, (i + 1) * l.block_rows); ++r) {
        for (int64_t c = j * l.block_cols; c < std::min(cols, (j + 1) * l.block_cols); ++c) {
          const uint8_t code = core::FloatToF8E4M3(x[r * cols + c] / s);
          t.codes[r * cols + c] = code;
          t.values[r * cols + c] = core::F8E4M3ToFloat(code) * s;
        }
      }
    }
  }
  return t;
}

std::string Raw(const void* p, size_t n) { return std::string(static_cast<const char*>(p), n); }

}  // namespace

void WriteFp8Fixture(const std::string& arch, const Fp8Layout& layout, const std::string& fp8_dir,
                     const std::string& f32_dir, const std::function<bool(runtime::TensorEntry&)>& edit) {
  auto source = runtime::OpenSafetensorsFile(FixtureDir(arch) + "/model.safetensors");
  ASSERT_TRUE(source.ok()) << source.status();
  std::vector<runtime::TensorEntry> fp8_entries, f32_entries;
  std::vector<std::string> fp8_bytes, f32_bytes;
  for (const std::string& name : (*source)->Names()) {
    auto view = source->get()->Get(name);
    ASSERT_TRUE(view.ok());
    const std::string stored = Raw(view->data, view->bytes());
    if (!Quantized(name, view->shape)) {
      fp8_entries.push_back({name, view->dtype, view->shape});
      fp8_bytes.push_back(stored);
      f32_entries.push_back({name, view->dtype, view->shape});
      f32_bytes.push_back(stored);
      continue;
    }
    std::vector<float> x(view->numel());
    core::ConvertToFloat(view->data, view->dtype, x.data(), view->numel());
    const Fp8Tensor q = Quantize(x, view->shape[0], view->shape[1], layout);
    fp8_entries.push_back({name, core::DType::kF8E4M3, view->shape});
    fp8_bytes.push_back(Raw(q.codes.data(), q.codes.size()));
    fp8_entries.push_back({name + "_scale_inv", layout.scale_dtype, q.scale_shape});
    if (layout.scale_dtype == core::DType::kBF16) {
      std::vector<uint16_t> s(q.scales.size());
      for (size_t i = 0; i < s.size(); ++i) s[i] = core::FloatToBf16(q.scales[i]);
      fp8_bytes.push_back(Raw(s.data(), s.size() * 2));
    } else {
      fp8_bytes.push_back(Raw(q.scales.data(), q.scales.size() * 4));
    }
    f32_entries.push_back({name, core::DType::kF32, view->shape});
    f32_bytes.push_back(Raw(q.values.data(), q.values.size() * 4));
  }
  const auto write = [](const std::string& dir, const std::vector<runtime::TensorEntry>& entries,
                        const std::vector<std::string>& bytes) {
    std::vector<runtime::TensorEntry> kept;
    std::vector<const std::string*> data;
    for (size_t i = 0; i < entries.size(); ++i) {
      kept.push_back(entries[i]);
      data.push_back(&bytes[i]);
    }
    auto writer = runtime::SafetensorsWriter::Create(dir + "/model.safetensors", kept);
    ASSERT_TRUE(writer.ok()) << writer.status();
    for (size_t i = 0; i < kept.size(); ++i) {
      std::memcpy(writer->data(i), data[i]->data(), std::min<size_t>(data[i]->size(), kept[i].bytes()));
    }
    ASSERT_TRUE(writer->Finish().ok());
  };
  CopyFixture(arch, fp8_dir);
  if (edit) {
    std::vector<runtime::TensorEntry> entries;
    std::vector<std::string> bytes;
    for (size_t i = 0; i < fp8_entries.size(); ++i) {
      runtime::TensorEntry e = fp8_entries[i];
      if (!edit(e)) continue;
      entries.push_back(e);
      bytes.push_back(fp8_bytes[i]);
      bytes.back().resize(e.bytes(), '\0');
    }
    fp8_entries = entries;
    fp8_bytes = bytes;
  }
  write(fp8_dir, fp8_entries, fp8_bytes);
  EditConfig(fp8_dir, [&](nlohmann::json& c) {
    c["quantization_config"] = {{"activation_scheme", "dynamic"},
                                {"fmt", "e4m3"},
                                {"quant_method", "fp8"},
                                {"weight_block_size", {layout.block_rows, layout.block_cols}}};
  });
  if (!f32_dir.empty()) {
    CopyFixture(arch, f32_dir);
    write(f32_dir, f32_entries, f32_bytes);
  }
}


}  // namespace moe::testing
