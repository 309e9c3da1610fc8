#include "moe/runtime/routing_profile.h"

#include <algorithm>
#include <fstream>
#include <numeric>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace moe::runtime {

constexpr char kFormat[] = "moeserve routing profile";

RoutingProfile RoutingProfile::For(const ModelSpec& spec) {
  RoutingProfile p;
  p.model_type = std::string(ArchitectureName(spec.arch));
  p.num_layers = spec.num_layers;
  p.num_experts = spec.routing.num_experts;
  p.top_k = spec.routing.top_k;
  for (int l = 0; l < spec.num_layers; ++l) {
    if (spec.IsMoeLayer(l)) p.counts[l].assign(p.num_experts, 0);
  }
  return p;
}

absl::StatusOr<RoutingProfile> LoadRoutingProfile(const std::string& path, const ModelSpec& spec) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("routing profile ", path, ": cannot open it"));
  std::stringstream text;
  text << in.rdbuf();
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("routing profile ", path, ": ", what));
  };
  const nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  if (j.value("format", std::string()) != kFormat) return bad(absl::StrCat("no \"format\": \"", kFormat, "\""));
  RoutingProfile p;
  try {
    p.model_type = j.at("model_type").get<std::string>();
    p.num_layers = j.at("num_layers").get<int>();
    p.num_experts = j.at("num_experts").get<int>();
    p.top_k = j.at("top_k").get<int>();
    p.tokens = j.at("tokens").get<int64_t>();
    for (const auto& layer : j.at("layers")) {
      p.counts[layer.at("layer").get<int>()] = layer.at("counts").get<std::vector<int64_t>>();
    }
  } catch (const nlohmann::json::exception& e) {
    return bad(absl::StrCat("malformed: ", e.what()));
  }
  const std::string model(ArchitectureName(spec.arch));
  if (p.model_type != model || p.num_layers != spec.num_layers || p.num_experts != spec.routing.num_experts) {
    return bad(absl::StrCat("made for a ", p.model_type, " of ", p.num_layers, " layers and ", p.num_experts,
                            " experts; this model is a ", model, " of ", spec.num_layers, " layers and ",
                            spec.routing.num_experts, " experts"));
  }
  for (int l = 0; l < spec.num_layers; ++l) {
    if (!spec.IsMoeLayer(l)) continue;
    auto it = p.counts.find(l);
    if (it == p.counts.end()) return bad(absl::StrCat("no counts for MoE layer ", l));
    if (static_cast<int>(it->second.size()) != spec.routing.num_experts) {
      return bad(
          absl::StrCat("layer ", l, " has ", it->second.size(), " counts for ", spec.routing.num_experts, " experts"));
    }
    for (int64_t c : it->second) {
      if (c < 0) return bad(absl::StrCat("layer ", l, " has a negative count"));
    }
  }
  return p;
}

absl::Status SaveRoutingProfile(const std::string& path, const RoutingProfile& p) {
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["model_type"] = p.model_type;
  j["num_layers"] = p.num_layers;
  j["num_experts"] = p.num_experts;
  j["top_k"] = p.top_k;
  j["tokens"] = p.tokens;
  j["layers"] = nlohmann::ordered_json::array();
  for (const auto& [layer, counts] : p.counts) j["layers"].push_back({{"layer", layer}, {"counts", counts}});
  std::ofstream out(path);
  out << j.dump() << "\n";
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("routing profile ", path, ": cannot write it"));
  return absl::OkStatus();
}

std::vector<int> MostUsedExperts(const RoutingProfile& profile, int layer, int n) {
  auto it = profile.counts.find(layer);
  if (it == profile.counts.end()) return {};
  const std::vector<int64_t>& c = it->second;
  std::vector<int> ids(c.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return c[a] > c[b]; });
  ids.resize(std::min<size_t>(ids.size(), std::max(n, 0)));
  return ids;
}

double ShareOfPicks(const RoutingProfile& profile, int layer, const std::vector<int>& experts) {
  auto it = profile.counts.find(layer);
  if (it == profile.counts.end()) return 0;
  const int64_t total = std::accumulate(it->second.begin(), it->second.end(), int64_t{0});
  int64_t picked = 0;
  for (int e : experts) picked += it->second[e];
  return total > 0 ? static_cast<double>(picked) / total : 0;
}

double MeanShareOfMostUsed(const RoutingProfile& profile, const std::vector<int>& layers, int n) {
  std::vector<int> all = layers;
  if (all.empty()) {
    for (const auto& [layer, counts] : profile.counts) all.push_back(layer);
  }
  double share = 0;
  for (int layer : all) share += ShareOfPicks(profile, layer, MostUsedExperts(profile, layer, n));
  return all.empty() ? 0 : share / static_cast<double>(all.size());
}

std::vector<std::pair<int, int>> PlanHeldExpertSwaps(const std::vector<double>& scores, const std::vector<int>& held,
                                                     double margin) {
  const int n = static_cast<int>(held.size());
  std::vector<int> ranked(scores.size());
  std::iota(ranked.begin(), ranked.end(), 0);
  std::stable_sort(ranked.begin(), ranked.end(), [&](int a, int b) { return scores[a] > scores[b]; });
  std::vector<bool> is_held(scores.size(), false), is_top(scores.size(), false);
  for (int e : held) is_held[e] = true;
  for (int i = 0; i < std::min<int>(n, static_cast<int>(ranked.size())); ++i) is_top[ranked[i]] = true;
  std::vector<int> incoming, outgoing;  // best first; weakest first
  for (int e : ranked) {
    if (is_top[e] && !is_held[e]) incoming.push_back(e);
  }
  for (auto it = ranked.rbegin(); it != ranked.rend(); ++it) {
    if (is_held[*it] && !is_top[*it]) outgoing.push_back(*it);
  }
  std::vector<std::pair<int, int>> swaps;
  for (size_t i = 0; i < std::min(incoming.size(), outgoing.size()); ++i) {
    // Counts are noisy: the gap must also be two standard deviations of a count (Poisson: the
    // square root of the sum), so that a few picks never move an expert.
    const double in = scores[incoming[i]], out = scores[outgoing[i]];
    if (!(in > margin * out) || !((in - out) * (in - out) > 4 * (in + out))) break;
    swaps.emplace_back(outgoing[i], incoming[i]);
  }
  return swaps;
}

}  // namespace moe::runtime
