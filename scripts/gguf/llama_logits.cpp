// Loads a GGUF with llama.cpp's libllama (CPU) and writes, as JSON, the logits at every position of
// each given prompt (token ids, evaluated as one batch per prompt in a fresh context), and
// optionally llama.cpp's tokenization of given texts with the GGUF's own vocabulary.
//
//   llama-logits --model M.gguf --prompts P.txt --out OUT.json [--tokenize T.hex] [--threads N]
//                [--kv f32|f16] [--fa 0|1]      (default: --kv f32 (f32 K, f16 V cache) --fa 0)
//
// P.txt: one prompt per line, token ids separated by spaces.
// T.hex: one text per line, its UTF-8 bytes in hex (an empty line is the empty text); tokenized
//        with add_special=false, parse_special=true (special tokens written in the text are
//        matched, as Hugging Face tokenizers do for added tokens).
// OUT.json: {"model", "n_vocab", "settings", "meta": {key: value}, "cases": [{"prompt_ids",
//           "logits": [[n_vocab floats] per position]}], "tokenize": [{"ids": [...]}]}
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::string json_escape(const std::string& s) {
  std::string o;
  for (unsigned char c : s) {
    if (c == '"') o += "\\\"";
    else if (c == '\\') o += "\\\\";
    else if (c < 0x20) { char b[8]; std::snprintf(b, sizeof(b), "\\u%04x", c); o += b; }
    else o += (char)c;
  }
  return o;
}

std::string from_hex(const std::string& h) {
  std::string o;
  for (size_t i = 0; i + 1 < h.size(); i += 2) o += (char)std::strtol(h.substr(i, 2).c_str(), nullptr, 16);
  return o;
}

bool read_lines(const std::string& path, std::vector<std::string>& lines) {
  std::ifstream f(path);
  if (!f) return false;
  std::string l;
  while (std::getline(f, l)) {
    if (!l.empty() && l.back() == '\r') l.pop_back();
    lines.push_back(l);
  }
  return true;
}

void usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s --model M.gguf --prompts P.txt --out OUT.json [--tokenize T.hex] [--threads N] "
               "[--kv f32|f16] [--fa 0|1]\n",
               argv0);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_path, prompts_path, out_path, tok_path, kv = "f32";
  int threads = 1, fa = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&]() -> std::string { if (i + 1 >= argc) usage(argv[0]); return argv[++i]; };
    if (a == "--model") model_path = val();
    else if (a == "--prompts") prompts_path = val();
    else if (a == "--out") out_path = val();
    else if (a == "--tokenize") tok_path = val();
    else if (a == "--threads") threads = std::atoi(val().c_str());
    else if (a == "--kv") kv = val();
    else if (a == "--fa") fa = std::atoi(val().c_str());
    else usage(argv[0]);
  }
  if (model_path.empty() || prompts_path.empty() || out_path.empty()) usage(argv[0]);

  std::vector<std::vector<llama_token>> prompts;
  {
    std::vector<std::string> lines;
    if (!read_lines(prompts_path, lines)) { std::fprintf(stderr, "cannot read %s\n", prompts_path.c_str()); return 1; }
    for (const std::string& l : lines) {
      std::istringstream ss(l);
      std::vector<llama_token> p;
      long t;
      while (ss >> t) p.push_back((llama_token)t);
      if (!p.empty()) prompts.push_back(p);
    }
  }
  std::vector<std::string> texts;
  if (!tok_path.empty()) {
    std::vector<std::string> lines;
    if (!read_lines(tok_path, lines)) { std::fprintf(stderr, "cannot read %s\n", tok_path.c_str()); return 1; }
    for (const std::string& l : lines) texts.push_back(from_hex(l));
  }

  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(model_path.c_str(), mp);
  if (!model) { std::fprintf(stderr, "cannot load %s\n", model_path.c_str()); return 1; }
  const int n_vocab = llama_n_vocab(model);

  size_t max_len = 1;
  for (const auto& p : prompts) max_len = std::max(max_len, p.size());
  const uint32_t n_ctx = (uint32_t)((max_len + 63) / 64 * 64);

  std::string out = "{\n\"model\": \"" + json_escape(model_path) + "\",\n\"n_vocab\": " + std::to_string(n_vocab);
  {
    char b[256];
    llama_model_desc(model, b, sizeof(b));
    out += ",\n\"desc\": \"" + json_escape(b) + "\"";
  }
  out += ",\n\"meta\": {";
  const char* keys[] = {"general.architecture", "general.file_type", "tokenizer.ggml.model", "tokenizer.ggml.pre"};
  for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); ++k) {
    char b[512] = {0};
    const int n = llama_model_meta_val_str(model, keys[k], b, sizeof(b));
    out += std::string(k ? ", " : "") + "\"" + keys[k] + "\": " + (n >= 0 ? "\"" + json_escape(b) + "\"" : "null");
  }
  out += "}";

  std::string settings;
  std::string cases = ",\n\"cases\": [";
  for (size_t pi = 0; pi < prompts.size(); ++pi) {
    const auto& p = prompts[pi];
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = n_ctx;
    cp.n_ubatch = n_ctx;
    cp.n_seq_max = 1;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.seed = 0;
    // Most exact first: an f32 K cache with an f16 V cache and no flash attention (ik_llama.cpp
    // needs flash attention for a non-f16 V cache, and its CPU flash attention aborts on f32);
    // then f16/f16. The settings used are written to the output.
    struct Try { ggml_type k, v; bool fa; };
    std::vector<Try> tries;
    if (kv == "f32") tries.push_back({GGML_TYPE_F32, GGML_TYPE_F16, fa != 0});
    tries.push_back({GGML_TYPE_F16, GGML_TYPE_F16, fa != 0});
    llama_context* ctx = nullptr;
    for (const Try& t : tries) {
      cp.type_k = t.k;
      cp.type_v = t.v;
      cp.flash_attn = t.fa;
      ctx = llama_init_from_model(model, cp);
      if (ctx) break;
      std::fprintf(stderr, "context with k=%s v=%s fa=%d failed; trying the next setting\n", ggml_type_name(t.k),
                   ggml_type_name(t.v), (int)t.fa);
    }
    if (!ctx) { std::fprintf(stderr, "cannot make a context\n"); return 1; }
    if (settings.empty()) {
      settings = ",\n\"settings\": {\"n_threads\": " + std::to_string(threads) + ", \"n_ctx\": " + std::to_string(n_ctx) +
                 ", \"k_cache\": \"" + ggml_type_name(cp.type_k) + "\", \"v_cache\": \"" + ggml_type_name(cp.type_v) +
                 "\", \"flash_attn\": " + (cp.flash_attn ? "true" : "false") + ", \"system\": \"" +
                 json_escape(llama_print_system_info()) + "\"}";
    }
    llama_batch batch = llama_batch_init((int32_t)p.size(), 0, 1);
    batch.n_tokens = (int32_t)p.size();
    for (size_t i = 0; i < p.size(); ++i) {
      batch.token[i] = p[i];
      batch.pos[i] = (llama_pos)i;
      batch.n_seq_id[i] = 1;
      batch.seq_id[i][0] = 0;
      batch.logits[i] = 1;
    }
    if (llama_decode(ctx, batch) != 0) { std::fprintf(stderr, "llama_decode failed on prompt %zu\n", pi); return 1; }
    cases += std::string(pi ? "," : "") + "\n{\"prompt_ids\": [";
    for (size_t i = 0; i < p.size(); ++i) cases += (i ? "," : "") + std::to_string(p[i]);
    cases += "], \"logits\": [";
    for (size_t i = 0; i < p.size(); ++i) {
      const float* lg = llama_get_logits_ith(ctx, (int32_t)i);
      if (!lg) { std::fprintf(stderr, "no logits at %zu\n", i); return 1; }
      cases += i ? ",\n[" : "\n[";
      for (int v = 0; v < n_vocab; ++v) {
        char b[32];
        if (std::isfinite(lg[v])) std::snprintf(b, sizeof(b), "%s%.9g", v ? "," : "", lg[v]);
        else std::snprintf(b, sizeof(b), "%snull", v ? "," : "");
        cases += b;
      }
      cases += "]";
    }
    cases += "]}";
    llama_batch_free(batch);
    llama_free(ctx);
  }
  cases += "\n]";
  out += settings + cases;

  out += ",\n\"tokenize\": [";
  for (size_t ti = 0; ti < texts.size(); ++ti) {
    const std::string& t = texts[ti];
    std::vector<llama_token> ids(t.size() + 16);
    int n = llama_tokenize(model, t.c_str(), (int32_t)t.size(), ids.data(), (int32_t)ids.size(), false, true);
    if (n < 0) {
      ids.resize(-n);
      n = llama_tokenize(model, t.c_str(), (int32_t)t.size(), ids.data(), (int32_t)ids.size(), false, true);
    }
    out += std::string(ti ? "," : "") + "\n{\"ids\": [";
    for (int i = 0; i < n; ++i) out += (i ? "," : "") + std::to_string(ids[i]);
    out += "]}";
  }
  out += "\n]\n}\n";

  FILE* f = std::fopen(out_path.c_str(), "w");
  if (!f || std::fwrite(out.data(), 1, out.size(), f) != out.size() || std::fclose(f) != 0) {
    std::fprintf(stderr, "cannot write %s\n", out_path.c_str());
    return 1;
  }
  llama_free_model(model);
  llama_backend_free();
  return 0;
}
