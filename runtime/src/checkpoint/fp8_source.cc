#include "checkpoint/fp8_source.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "moe/core/json.h"
#include "moe/core/status.h"
#include "nlohmann/json.hpp"

namespace moe::runtime::internal {
namespace {

using Json = nlohmann::json;

constexpr std::string_view kScaleSuffix = "_scale_inv";
constexpr int kMaxScaleBlock = 4096;

std::string ScaleName(const std::string& weight) { return weight + std::string(kScaleSuffix); }

class Fp8Source final : public WeightSource {
 public:
  Fp8Source(std::unique_ptr<WeightSource> base, WeightQuantization q) : base_(std::move(base)), q_(q) {}

  // Pairs every fp8 tensor with its scales; the first problem found, naming both.
  absl::Status Check() {
    for (const std::string& name : base_->Names()) {
      MOE_ASSIGN_OR_RETURN(const core::TensorView t, base_->Get(name));
      if (t.dtype != core::DType::kF8E4M3) continue;
      MOE_ASSIGN_OR_RETURN(const WeightView v, Scaled(name, t));
      (void)v;
      scales_.insert(ScaleName(name));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<core::TensorView> Get(const std::string& name) const override { return base_->Get(name); }
  bool Has(const std::string& name) const override { return base_->Has(name); }
  std::string FileOf(const std::string& name) const override { return base_->FileOf(name); }
  std::vector<std::string> Names() const override {
    std::vector<std::string> names;
    for (std::string& n : base_->Names()) {
      if (scales_.count(n) == 0) names.push_back(std::move(n));
    }
    return names;
  }
  absl::StatusOr<WeightView> GetStored(const std::string& name) const override {
    MOE_ASSIGN_OR_RETURN(const core::TensorView t, base_->Get(name));
    if (t.dtype != core::DType::kF8E4M3) return WeightView::Of(t);
    return Scaled(name, t);
  }

 private:
  absl::StatusOr<WeightView> Scaled(const std::string& name, const core::TensorView& t) const {
    const std::string where = absl::StrCat(name, " in ", base_->FileOf(name));
    if (t.shape.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": an F8_E4M3 tensor of shape ", core::ShapeString(t.shape),
                                                     "; fp8 weights are matrices [rows x cols]"));
    }
    const std::string scale_name = ScaleName(name);
    if (!base_->Has(scale_name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": an F8_E4M3 weight without its scales (", scale_name, " is missing)"));
    }
    MOE_ASSIGN_OR_RETURN(const core::TensorView s, base_->Get(scale_name));
    if (s.dtype != core::DType::kF32 && s.dtype != core::DType::kBF16) {
      return absl::InvalidArgumentError(absl::StrCat(scale_name, " in ", base_->FileOf(scale_name), ": scales of dtype ",
                                                     core::DTypeName(s.dtype), " (F32 or BF16 are read)"));
    }
    const int64_t rows = t.shape[0], cols = t.shape[1];
    const int64_t br = q_.block_rows > 0 ? q_.block_rows : std::max<int64_t>(rows, 1);
    const int64_t bc = q_.block_cols > 0 ? q_.block_cols : std::max<int64_t>(cols, 1);
    const core::Shape want = {(rows + br - 1) / br, (cols + bc - 1) / bc};
    const bool one_scale = q_.block_rows == 0 && core::NumElements(s.shape) == 1;
    if (s.shape != want && !one_scale) {
      return absl::InvalidArgumentError(absl::StrCat(
          scale_name, " in ", base_->FileOf(scale_name), ": shape ", core::ShapeString(s.shape), " for ", name, " of ",
          core::ShapeString(t.shape), "; the scale block ", q_.Describe(), " needs ", core::ShapeString(want)));
    }
    WeightView v;
    v.data = t.data;
    v.shape = t.shape;
    v.format = WeightFormat::BlockScaled(core::DType::kF8E4M3, static_cast<int>(br), static_cast<int>(bc), s.dtype);
    v.scales = s.data;
    v.scale_shape = want;
    return v;
  }

  std::unique_ptr<WeightSource> base_;
  WeightQuantization q_;
  std::set<std::string> scales_;
};

}  // namespace

std::string WeightQuantization::Describe() const {
  if (method == Method::kNone) return "";
  if (block_rows == 0) return "fp8 e4m3, one scale per tensor";
  return absl::StrCat("fp8 e4m3, scale per ", block_rows, "x", block_cols, " block");
}

absl::StatusOr<WeightQuantization> ReadQuantizationConfig(std::string_view config_json, const std::string& source) {
  MOE_ASSIGN_OR_RETURN(const Json j, core::ParseJsonObject(config_json, source));
  WeightQuantization q;
  auto it = j.find("quantization_config");
  if (it == j.end() || it->is_null()) return q;
  const Json& c = *it;
  auto bad = [&](const std::string& key, const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": quantization_config.", key, " ", what));
  };
  if (!c.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": quantization_config must be an object, found ", core::DescribeJson(c)));
  }
  auto method = c.find("quant_method");
  if (method == c.end() || !method->is_string()) {
    return bad("quant_method", absl::StrCat("is ", method == c.end() ? "missing" : core::DescribeJson(*method),
                                            "; moeserve reads \"fp8\" (block-scaled e4m3)"));
  }
  const std::string m = method->get<std::string>();
  if (m != "fp8") {
    return bad("quant_method", absl::StrCat("\"", m,
                                            "\" is a quantization moeserve does not read (it reads \"fp8\", block-scaled "
                                            "e4m3, and GGUF files); use the model's bf16 release or a GGUF of it"));
  }
  q.method = WeightQuantization::Method::kFp8;
  if (auto fmt = c.find("fmt"); fmt != c.end() && !fmt->is_null()) {
    if (!fmt->is_string() || fmt->get<std::string>() != "e4m3") {
      return bad("fmt", absl::StrCat("is ", core::DescribeJson(*fmt), "; moeserve reads fp8 e4m3"));
    }
  }
  if (auto act = c.find("activation_scheme"); act != c.end() && !act->is_null()) {
    if (!act->is_string() || act->get<std::string>() != "dynamic") {
      return bad("activation_scheme", absl::StrCat("is ", core::DescribeJson(*act),
                                                   "; moeserve reads fp8 weights with dynamic activations (static "
                                                   "activation scales are not read)"));
    }
  }
  if (auto block = c.find("weight_block_size"); block != c.end() && !block->is_null()) {
    const bool ok = block->is_array() && block->size() == 2 && (*block)[0].is_number_integer() &&
                    (*block)[1].is_number_integer() && (*block)[0].get<int64_t>() >= 1 &&
                    (*block)[0].get<int64_t>() <= kMaxScaleBlock && (*block)[1].get<int64_t>() >= 1 &&
                    (*block)[1].get<int64_t>() <= kMaxScaleBlock;
    if (!ok) {
      return bad("weight_block_size", absl::StrCat("is ", core::DescribeJson(*block), "; want two integers in [1, ",
                                                   kMaxScaleBlock, "], rows then columns ([128, 128])"));
    }
    q.block_rows = (*block)[0].get<int>();
    q.block_cols = (*block)[1].get<int>();
  }
  return q;
}

absl::StatusOr<std::unique_ptr<WeightSource>> WrapFp8Source(std::unique_ptr<WeightSource> base,
                                                            const WeightQuantization& q) {
  auto source = std::make_unique<Fp8Source>(std::move(base), q);
  MOE_RETURN_IF_ERROR(source->Check());
  return std::unique_ptr<WeightSource>(std::move(source));
}

}  // namespace moe::runtime::internal
