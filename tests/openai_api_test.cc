// The OpenAI-compatible HTTP API as clients see it: a real Frontend on loopback over the fixture
// model, real HTTP requests.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "../scheduler/src/test_socket.h"
#include "moe/runtime/model_executor.h"
#include "moe/scheduler/frontend.h"
#include "moe/scheduler/http_server.h"
#include "moeserve/v1/generation.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "test_util.h"

namespace moe {
namespace {

using ::nlohmann::json;
using ::testing::HasSubstr;

struct HttpResult {
  int status = 0;
  std::string body;
  std::string content_type;
};

// The SSE events of a streamed body: each `data:` JSON, and whether `data: [DONE]` ended it.
struct Events {
  std::vector<json> chunks;
  bool done = false;
};

Events ParseEvents(const std::string& body) {
  Events events;
  for (const std::string& block : std::vector<std::string>(absl::StrSplit(body, "\n\n", absl::SkipEmpty()))) {
    if (block.substr(0, 1) == ":") continue;  // a keep-alive comment
    EXPECT_EQ(block.substr(0, 6), "data: ") << block;
    const std::string data = block.substr(6);
    if (data == "[DONE]") {
      events.done = true;
      continue;
    }
    EXPECT_FALSE(events.done) << "an event after [DONE]";
    events.chunks.push_back(json::parse(data));
  }
  return events;
}

int Connect(int port) { return moe::test_socket::ConnectLoopback(port); }

class OpenAiApiTest : public ::testing::Test {
 protected:
  void StartServer(int max_seqs = 8, int max_queue = 16, std::shared_ptr<const scheduler::ApiKeys> keys = nullptr,
                   int64_t max_request_bytes = 1 << 20, bool request_log = false) {
    runtime::ModelOptions mo;
    mo.pool.progress = false;
    mo.threads = 2;
    mo.pool.threads = 2;
    auto model = runtime::Model::Load(testing::FixtureDir("qwen3_moe"), mo);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
    scheduler::FrontendOptions options = Options(max_seqs, max_queue);
    options.api_keys = std::move(keys);
    options.max_request_bytes = max_request_bytes;
    options.request_log = request_log;
    auto executor = runtime::ModelExecutor::Create(*model_, /*num_blocks=*/512);
    ASSERT_TRUE(executor.ok()) << executor.status();
    auto frontend = scheduler::Frontend::Start(*std::move(executor), options);
    ASSERT_TRUE(frontend.ok()) << frontend.status();
    frontend_ = std::move(*frontend);
    client_ = std::make_unique<httplib::Client>("127.0.0.1", frontend_->http_port());
    client_->set_read_timeout(std::chrono::seconds(60));
  }

  static scheduler::FrontendOptions Options(int max_seqs, int max_queue) {
    scheduler::FrontendOptions options;
    options.listen = "127.0.0.1:0";
    options.http_listen = "127.0.0.1:0";
    options.scheduler.max_seqs = max_seqs;
    options.scheduler.max_queue = max_queue;
    options.scheduler.max_batch_tokens = 64;
    options.scheduler.context = 1024;
    options.placement = "test";
    options.model_dir = testing::FixtureDir("qwen3_moe");
    return options;
  }

  void TearDown() override {
    client_.reset();
    if (frontend_) frontend_->Shutdown();
  }

  HttpResult Post(const std::string& path, const std::string& body, const httplib::Headers& headers = {}) {
    auto response = client_->Post(path.c_str(), headers, body, "application/json");
    if (!response) return {-1, httplib::to_string(response.error()), ""};
    return {response->status, response->body, response->get_header_value("Content-Type")};
  }
  HttpResult Post(const std::string& path, const json& body) { return Post(path, body.dump()); }
  HttpResult Get(const std::string& path) {
    auto response = client_->Get(path.c_str());
    if (!response) return {-1, httplib::to_string(response.error()), ""};
    return {response->status, response->body, response->get_header_value("Content-Type")};
  }

  // Whether this build's server reads text (it has the tokenizer library).
  bool ServesText() {
    const HttpResult r = Post("/v1/completions", json{{"prompt", "hello"}, {"max_tokens", 1}});
    return r.status == 200;
  }

  // Expects OpenAI's error shape with this status, and returns the error object.
  static json ExpectError(const HttpResult& r, int status, const std::string& message_part) {
    EXPECT_EQ(r.status, status) << r.body;
    const json body = json::parse(r.body, nullptr, false);
    EXPECT_TRUE(body.is_object() && body.contains("error")) << r.body;
    if (!body.is_object() || !body.contains("error")) return json();
    const json& e = body["error"];
    EXPECT_TRUE(e["message"].is_string()) << r.body;
    EXPECT_TRUE(e["type"].is_string()) << r.body;
    EXPECT_TRUE(e.contains("param")) << r.body;
    EXPECT_EQ(e["code"], status) << r.body;
    EXPECT_THAT(e["message"].get<std::string>(), HasSubstr(message_part));
    return e;
  }

  std::vector<int32_t> Prompt() const { return {1, 17, 42, 99, 7}; }

  std::unique_ptr<runtime::Model> model_;
  std::unique_ptr<scheduler::Frontend> frontend_;
  std::unique_ptr<httplib::Client> client_;
};

// Every HTTP request, served or refused, whole or streamed, writes one JSON line to the request
// log, as gRPC requests do.
TEST_F(OpenAiApiTest, EachRequestWritesOneLogLine) {
  ::testing::internal::CaptureStderr();
  StartServer(8, 16, nullptr, 1 << 20, /*request_log=*/true);
  const HttpResult whole = Post("/v1/completions", json{{"model", "qwen3_moe"}, {"prompt", {5, 6, 7}}, {"max_tokens", 3}});
  EXPECT_EQ(whole.status, 200) << whole.body;
  const HttpResult streamed =
      Post("/v1/completions", json{{"model", "qwen3_moe"}, {"prompt", {5, 6, 7}}, {"max_tokens", 2}, {"stream", true}});
  EXPECT_EQ(streamed.status, 200) << streamed.body;
  const HttpResult refused = Post("/v1/completions", json{{"model", "qwen3_moe"}, {"prompt", {5}}, {"n", 2}});
  EXPECT_EQ(refused.status, 400) << refused.body;
  client_.reset();
  frontend_->Shutdown();
  frontend_.reset();
  const std::string err = ::testing::internal::GetCapturedStderr();
  std::vector<json> lines;
  for (const std::string& text : std::vector<std::string>(absl::StrSplit(err, '\n'))) {
    if (text.find("\"api\":\"openai\"") == std::string::npos) continue;
    lines.push_back(json::parse(text));
  }
  ASSERT_EQ(lines.size(), 3u) << err;
  int ok = 0, bad = 0;
  for (const json& line : lines) {
    EXPECT_EQ(line["event"], "request");
    EXPECT_EQ(line["path"], "/v1/completions");
    if (line["http_status"] == 200) {
      ++ok;
      EXPECT_EQ(line["finish_reason"], "length") << line.dump();
      EXPECT_EQ(line["prompt_tokens"], 3);
      EXPECT_GT(line["output_tokens"].get<int>(), 0);
      EXPECT_GE(line["ttft_ms"].get<double>(), 0);
    } else {
      ++bad;
      EXPECT_EQ(line["http_status"], 400);
      EXPECT_FALSE(line["error"].get<std::string>().empty());
    }
  }
  EXPECT_EQ(ok, 2);
  EXPECT_EQ(bad, 1);
}

TEST_F(OpenAiApiTest, ModelsListTheServedModel) {
  StartServer();
  const HttpResult r = Get("/v1/models");
  ASSERT_EQ(r.status, 200) << r.body;
  const json body = json::parse(r.body);
  EXPECT_EQ(body["object"], "list");
  ASSERT_EQ(body["data"].size(), 1u);
  const json& card = body["data"][0];
  EXPECT_EQ(card["id"], "qwen3_moe");
  EXPECT_EQ(card["object"], "model");
  EXPECT_EQ(card["owned_by"], "moeserve");
  EXPECT_EQ(card["max_model_len"], 1024);
  EXPECT_TRUE(card["has_chat_template"].is_boolean());
  EXPECT_TRUE(card["supports_tools"].is_boolean());
  EXPECT_EQ(Get("/v1/models/qwen3_moe").status, 200);
  ExpectError(Get("/v1/models/gpt-4"), 404, "does not exist");
}

TEST_F(OpenAiApiTest, CompletionOfTokenIdsWithUsage) {
  StartServer();
  const json request = {{"model", "qwen3_moe"}, {"prompt", Prompt()}, {"max_tokens", 6}, {"temperature", 0},
                        {"ignore_eos", true},   {"return_token_ids", true}};
  const HttpResult r = Post("/v1/completions", request);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_THAT(r.content_type, HasSubstr("application/json"));
  const json body = json::parse(r.body);
  EXPECT_EQ(body["object"], "text_completion");
  EXPECT_THAT(body["id"].get<std::string>(), ::testing::StartsWith("cmpl-"));
  EXPECT_EQ(body["model"], "qwen3_moe");
  ASSERT_EQ(body["choices"].size(), 1u);
  EXPECT_EQ(body["choices"][0]["index"], 0);
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(body["choices"][0]["token_ids"].size(), 6u);
  EXPECT_TRUE(body["choices"][0]["text"].is_string());
  EXPECT_EQ(body["usage"]["prompt_tokens"], 5);
  EXPECT_EQ(body["usage"]["completion_tokens"], 6);
  EXPECT_EQ(body["usage"]["total_tokens"], 11);

  // The same request streamed gives the same tokens, chunk by chunk, then the usage and [DONE].
  json streamed = request;
  streamed["stream"] = true;
  streamed["stream_options"] = {{"include_usage", true}};
  const HttpResult s = Post("/v1/completions", streamed);
  ASSERT_EQ(s.status, 200) << s.body;
  EXPECT_THAT(s.content_type, HasSubstr("text/event-stream"));
  const Events events = ParseEvents(s.body);
  EXPECT_TRUE(events.done);
  ASSERT_GE(events.chunks.size(), 2u);
  std::vector<int32_t> tokens;
  for (size_t i = 0; i + 1 < events.chunks.size(); ++i) {
    const json& chunk = events.chunks[i];
    EXPECT_EQ(chunk["object"], "text_completion");
    EXPECT_EQ(chunk["id"], events.chunks[0]["id"]);
    EXPECT_TRUE(chunk["usage"].is_null());
    ASSERT_EQ(chunk["choices"].size(), 1u);
    for (int32_t t : chunk["choices"][0]["token_ids"]) tokens.push_back(t);
    const bool last = i + 2 == events.chunks.size();
    EXPECT_EQ(chunk["choices"][0]["finish_reason"].is_null(), !last) << chunk;
  }
  EXPECT_EQ(tokens, body["choices"][0]["token_ids"].get<std::vector<int32_t>>());
  const json& usage = events.chunks.back();
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 6);
  EXPECT_EQ(usage["usage"]["prompt_tokens"], 5);
}

TEST_F(OpenAiApiTest, CompletionLogprobs) {
  StartServer();
  const HttpResult r = Post("/v1/completions", json{{"prompt", Prompt()}, {"max_tokens", 3}, {"logprobs", 2},
                                                    {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  const json lp = json::parse(r.body)["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 3u);
  ASSERT_EQ(lp["token_logprobs"].size(), 3u);
  ASSERT_EQ(lp["top_logprobs"].size(), 3u);
  EXPECT_EQ(lp["top_logprobs"][0].size(), 2u);
  EXPECT_LE(lp["token_logprobs"][0].get<double>(), 0.0);
  EXPECT_EQ(lp["text_offset"].size(), 3u);
}

TEST_F(OpenAiApiTest, SamplingFieldsAreTaken) {
  StartServer();
  const json request = {{"prompt", Prompt()}, {"max_tokens", 4}, {"temperature", 0.8}, {"top_p", 0.9},
                        {"top_k", 20},        {"min_p", 0.05},   {"seed", 7},           {"presence_penalty", 0.5},
                        {"frequency_penalty", 0.5}, {"repetition_penalty", 1.1}, {"ignore_eos", true},
                        {"return_token_ids", true}};
  const HttpResult a = Post("/v1/completions", request);
  const HttpResult b = Post("/v1/completions", request);
  ASSERT_EQ(a.status, 200) << a.body;
  ASSERT_EQ(b.status, 200) << b.body;
  // Same seed, same tokens.
  EXPECT_EQ(json::parse(a.body)["choices"][0]["token_ids"], json::parse(b.body)["choices"][0]["token_ids"]);
  json bad = request;
  bad["top_p"] = 0;
  const json e = ExpectError(Post("/v1/completions", bad), 400, "top_p must be in (0, 1]");
  EXPECT_EQ(e["param"], "top_p");
}

TEST_F(OpenAiApiTest, TextCompletionChatToolsAndStopStrings) {
  StartServer();
  if (!ServesText()) GTEST_SKIP() << "this build has no tokenizer library (moe::text)";
  const json request = {{"prompt", "The capital of France is"}, {"max_tokens", 12}, {"temperature", 0},
                        {"ignore_eos", true}};
  const HttpResult r = Post("/v1/completions", request);
  ASSERT_EQ(r.status, 200) << r.body;
  const json body = json::parse(r.body);
  const std::string text = body["choices"][0]["text"];
  EXPECT_EQ(body["usage"]["completion_tokens"], 12);
  // A stop string taken from the greedy output itself ends the text before it, with "stop".
  // The stop string: the character whose first occurrence comes last (a random-weight model
  // writes any characters), so that the cut text is as long as it can be.
  size_t at = std::string::npos;
  std::string stop;
  for (size_t i = 0; i < text.size();) {
    size_t len = 1;
    while (i + len < text.size() && (static_cast<unsigned char>(text[i + len]) & 0xC0) == 0x80) ++len;
    const std::string c = text.substr(i, len);
    if (text.find(c) == i && i > 0) at = i, stop = c;
    i += len;
  }
  ASSERT_NE(at, std::string::npos) << "no character to stop at in " << text;
  {
    json stopped = request;
    stopped["stop"] = {stop};
    const HttpResult s = Post("/v1/completions", stopped);
    ASSERT_EQ(s.status, 200) << s.body;
    const json sb = json::parse(s.body);
    EXPECT_EQ(sb["choices"][0]["finish_reason"], "stop");
    EXPECT_EQ(sb["choices"][0]["text"], text.substr(0, text.find(stop)));
    EXPECT_LE(sb["usage"]["completion_tokens"].get<int>(), 12);
    stopped["include_stop_str_in_output"] = true;
    const json with = json::parse(Post("/v1/completions", stopped).body);
    EXPECT_EQ(with["choices"][0]["text"], text.substr(0, text.find(stop) + stop.size()));
  }
  const json chat = {{"model", "qwen3_moe"},
                     {"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                     {"max_tokens", 5},
                     {"temperature", 0}};
  const HttpResult c = Post("/v1/chat/completions", chat);
  ASSERT_EQ(c.status, 200) << c.body;
  const json cb = json::parse(c.body);
  EXPECT_EQ(cb["object"], "chat.completion");
  EXPECT_EQ(cb["choices"][0]["message"]["role"], "assistant");
  EXPECT_GT(cb["usage"]["prompt_tokens"].get<int>(), 3);
  json streamed = chat;
  streamed["stream"] = true;
  const Events events = ParseEvents(Post("/v1/chat/completions", streamed).body);
  EXPECT_TRUE(events.done);
  ASSERT_GE(events.chunks.size(), 2u);
  EXPECT_EQ(events.chunks[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(events.chunks[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_FALSE(events.chunks.back()["choices"][0]["finish_reason"].is_null());
  // Tools are taken (not refused), whatever the model makes of them.
  json tools = chat;
  tools["tools"] = {{{"type", "function"},
                     {"function", {{"name", "get_weather"}, {"parameters", {{"type", "object"}}}}}}};
  tools["tool_choice"] = "auto";
  EXPECT_EQ(Post("/v1/chat/completions", tools).status, 200);
  tools["tool_choice"] = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
  EXPECT_EQ(Post("/v1/chat/completions", tools).status, 200);
  tools["tool_choice"] = {{"type", "function"}, {"function", {{"name", "other"}}}};
  ExpectError(Post("/v1/chat/completions", tools), 400, "not in tools");
  json kwargs = chat;
  kwargs["chat_template_kwargs"] = {{"enable_thinking", false}};
  EXPECT_EQ(Post("/v1/chat/completions", kwargs).status, 200);
}

// response_format with a schema and json_object, tool_choice "required" and a named function,
// whole and streamed, sampled at temperature 1: the content parses and follows the schema, the tool
// calls name the tools with arguments that follow theirs; a second turn reports its cached prompt.
TEST_F(OpenAiApiTest, StructuredOutputsEnforcedToolCallsAndCachedTokens) {
  StartServer();
  if (!ServesText()) GTEST_SKIP() << "this build has no tokenizer library (moe::text)";
  const json schema = {{"type", "object"},
                       {"properties",
                        {{"city", {{"type", "string"}, {"maxLength", 6}}},
                         {"days", {{"type", "integer"}}},
                         {"unit", {{"enum", {"c", "f"}}}}}},
                       {"required", {"city", "unit"}}};
  for (int seed = 0; seed < 3; ++seed) {
    const json request = {{"messages", {{{"role", "user"}, {"content", "weather?"}}}},
                          {"temperature", 1.0},
                          {"seed", seed},
                          {"max_tokens", 300},
                          {"response_format",
                           {{"type", "json_schema"}, {"json_schema", {{"name", "w"}, {"strict", true}, {"schema", schema}}}}}};
    const HttpResult r = Post("/v1/chat/completions", request);
    ASSERT_EQ(r.status, 200) << r.body;
    const json body = json::parse(r.body);
    const json content = json::parse(body["choices"][0]["message"]["content"].get<std::string>());
    EXPECT_TRUE(content["city"].is_string() && content["city"].get<std::string>().size() <= 6 * 4) << content;
    EXPECT_TRUE(content["unit"] == "c" || content["unit"] == "f") << content;
    EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  }
  const json object = json::parse(
      json::parse(Post("/v1/completions", json{{"prompt", Prompt()},
                                              {"max_tokens", 400},
                                              {"temperature", 0},
                                              {"response_format", {{"type", "json_object"}}}})
                      .body)["choices"][0]["text"]
          .get<std::string>(),
      nullptr, false);
  EXPECT_TRUE(object.is_object() || object.is_discarded()) << object;  // whole, or cut by max_tokens

  const json tools = {{{"type", "function"},
                       {"function",
                        {{"name", "get_weather"},
                         {"parameters",
                          {{"type", "object"},
                           {"properties", {{"city", {{"type", "string"}, {"maxLength", 5}}}}},
                           {"required", {"city"}}}}}}},
                      {{"type", "function"},
                       {"function",
                        {{"name", "get_time"},
                         {"parameters", {{"type", "object"}, {"properties", {{"utc", {{"type", "boolean"}}}}}}}}}}};
  for (const json& choice : {json("required"), json{{"type", "function"}, {"function", {{"name", "get_time"}}}}}) {
    for (bool stream : {false, true}) {
      const json request = {{"messages", {{{"role", "user"}, {"content", "weather in Oslo?"}}}},
                            {"temperature", 1.0},
                            {"seed", 5},
                            {"max_tokens", 300},
                            {"tools", tools},
                            {"tool_choice", choice},
                            {"stream", stream}};
      const HttpResult r = Post("/v1/chat/completions", request);
      ASSERT_EQ(r.status, 200) << r.body;
      json calls, finish;
      if (stream) {
        for (const json& chunk : ParseEvents(r.body).chunks) {
          const json& c = chunk["choices"][0];
          if (c["delta"].contains("tool_calls")) calls = c["delta"]["tool_calls"];
          if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
        }
      } else {
        const json body = json::parse(r.body);
        calls = body["choices"][0]["message"]["tool_calls"];
        finish = body["choices"][0]["finish_reason"];
        EXPECT_TRUE(body["choices"][0]["message"]["content"].is_null()) << r.body;
      }
      ASSERT_TRUE(calls.is_array() && !calls.empty()) << r.body;
      EXPECT_EQ(finish, "tool_calls") << r.body;
      for (const json& call : calls) {
        const std::string name = call["function"]["name"];
        if (choice.is_object()) EXPECT_EQ(name, "get_time");
        EXPECT_TRUE(name == "get_weather" || name == "get_time") << call;
        const json args = json::parse(call["function"]["arguments"].get<std::string>());
        EXPECT_TRUE(args.is_object()) << call;
        if (name == "get_weather") EXPECT_TRUE(args["city"].is_string()) << call;
        if (name == "get_time" && args.contains("utc")) EXPECT_TRUE(args["utc"].is_boolean()) << call;
      }
    }
  }
  ExpectError(Post("/v1/chat/completions",
                   json{{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                        {"tools", {{{"type", "function"},
                                    {"function", {{"name", "f"},
                                                  {"parameters", {{"type", "object"},
                                                                  {"properties", {{"n", {{"type", "number"},
                                                                                         {"multipleOf", 2}}}}}}}}}}}},
                        {"tool_choice", "required"}}),
              400, "tools[0].function.parameters at /properties/n: the keyword 'multipleOf'");

  // A conversation's second turn finds its first turn's prompt in the prefix cache.
  json turn = {{"messages", {{{"role", "system"}, {"content", std::string(300, 'x')}}, {{"role", "user"}, {"content", "one"}}}},
               {"max_tokens", 2}};
  const json first = json::parse(Post("/v1/chat/completions", turn).body);
  EXPECT_EQ(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0) << first;
  turn["messages"].push_back({{"role", "assistant"}, {"content", "ok"}});
  turn["messages"].push_back({{"role", "user"}, {"content", "two"}});
  const json second = json::parse(Post("/v1/chat/completions", turn).body);
  EXPECT_GT(second["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 16) << second;
  EXPECT_THAT(frontend_->engine().RenderMetrics(), HasSubstr("moeserve_prefix_cache_hits_total "));
}

TEST_F(OpenAiApiTest, BadRequestsGetOpenAisErrorShape) {
  StartServer();
  const json e = ExpectError(Post("/v1/completions", std::string("{\"prompt\": [1, 2,\n  }")), 400, "request body:2:");
  EXPECT_EQ(e["type"], "invalid_request_error");
  ExpectError(Post("/v1/completions", std::string("[1, 2]")), 400, "expected a JSON object");
  EXPECT_EQ(ExpectError(Post("/v1/completions", json{{"prompt", Prompt()}, {"n", 2}}), 400, "n: only 1")["param"], "n");
  EXPECT_EQ(ExpectError(Post("/v1/completions", json{{"prompt", Prompt()}, {"model", "gpt-4"}}), 404,
                        "The model 'gpt-4' does not exist")["param"],
            "model");
  const json refused_schema = ExpectError(
      Post("/v1/completions",
           json{{"prompt", Prompt()},
                {"response_format",
                 {{"type", "json_schema"},
                  {"json_schema", {{"name", "n"}, {"schema", {{"type", "integer"}, {"minimum", 1}}}}}}}}),
      400, "response_format.json_schema.schema: the keyword 'minimum' cannot be enforced while decoding");
  EXPECT_EQ(refused_schema["param"], "response_format");
  ExpectError(Post("/v1/completions", json{{"prompt", Prompt()}, {"response_format", {{"type", "xml"}}}}), 400,
              "response_format: expected");
  EXPECT_EQ(Post("/v1/completions", json{{"prompt", Prompt()}, {"max_tokens", 1}, {"response_format", {{"type", "text"}}}})
                .status,
            200);
  ExpectError(Post("/v1/completions", json{{"prompt", Prompt()}, {"max_tokens", "many"}}), 400, "max_tokens");
  ExpectError(Post("/v1/completions", json{{"prompt", Prompt()}, {"stop", 5}}), 400, "stop:");
  ExpectError(Post("/v1/completions", json{{"prompt", Prompt()}, {"echo", true}}), 400, "echo");
  ExpectError(Post("/v1/completions", json{{"prompt", {"a", "b"}}}), 400, "one prompt per request");
  ExpectError(Post("/v1/completions", json::object()), 400, "prompt: required");
  ExpectError(Post("/v1/completions", json{{"prompt", std::vector<int>{}}}), 400, "prompt");
  ExpectError(Post("/v1/completions", json{{"prompt", {1, 99999}}}), 400, "prompt");
  // A prompt longer than the context (1024).
  const json too_long = ExpectError(Post("/v1/completions", json{{"prompt", std::vector<int>(1500, 3)}}), 400, "prompt");
  EXPECT_EQ(too_long["param"], "prompt");
  ExpectError(Post("/v1/completions", json{{"prompt", Prompt()}, {"max_tokens", 5000}}), 400, "max_tokens");
  ExpectError(Post("/v1/chat/completions", json{{"messages", json::array()}}), 400, "messages");
  ExpectError(Post("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"n", 3}}), 400,
              "n: only 1");
  ExpectError(Post("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                                                {"tool_choice", "required"}}),
              400, "needs tools");
  ExpectError(Post("/v1/nothing", json::object()), 404, "no route for POST /v1/nothing");
  ExpectError(Get("/v1/completions"), 404, "no route");
}

TEST_F(OpenAiApiTest, BodyOverTheLimitIs413) {
  StartServer(8, 16, nullptr, /*max_request_bytes=*/4096);
  const std::string big = json{{"prompt", std::string(8192, 'x')}}.dump();
  ExpectError(Post("/v1/completions", big), 413, "larger than this server's limit of 4096 bytes");
}

TEST_F(OpenAiApiTest, ApiKeysAreAsked) {
  testing::ScratchDir dir;
  std::ofstream(dir / "keys") << "sk-test-key\n";
  auto keys = scheduler::ApiKeys::Load(dir / "keys");
  ASSERT_TRUE(keys.ok()) << keys.status();
  StartServer(8, 16, std::make_shared<const scheduler::ApiKeys>(*std::move(keys)));
  const json request = {{"prompt", Prompt()}, {"max_tokens", 1}};
  const json e = ExpectError(Post("/v1/completions", request), 401, "missing API key");
  EXPECT_EQ(e["type"], "authentication_error");
  ExpectError(Post("/v1/completions", request.dump(), {{"Authorization", "Bearer wrong"}}), 401, "invalid API key");
  EXPECT_EQ(Post("/v1/completions", request.dump(), {{"Authorization", "Bearer sk-test-key"}}).status, 200);
}

TEST_F(OpenAiApiTest, FullQueueIs429) {
  StartServer(/*max_seqs=*/1, /*max_queue=*/0);
  // One long request holds the only slot.
  std::thread long_request([this] {
    httplib::Client client("127.0.0.1", frontend_->http_port());
    client.set_read_timeout(std::chrono::seconds(60));
    client.Post("/v1/completions", json{{"prompt", Prompt()}, {"max_tokens", 200}, {"ignore_eos", true}}.dump(),
                "application/json");
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (frontend_->engine().stats().running == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const json e = ExpectError(Post("/v1/completions", json{{"prompt", Prompt()}, {"max_tokens", 1}}), 429, "");
  EXPECT_EQ(e["type"], "rate_limit_error");
  long_request.join();
}

TEST_F(OpenAiApiTest, LoadingAndDrainingAre503) {
  scheduler::FrontendOptions options = Options(8, 16);
  auto created = scheduler::Frontend::Create(options);
  ASSERT_TRUE(created.ok()) << created.status();
  frontend_ = std::move(*created);
  client_ = std::make_unique<httplib::Client>("127.0.0.1", frontend_->http_port());
  ExpectError(Post("/v1/completions", json{{"prompt", Prompt()}}), 503, "loading");
  ExpectError(Get("/v1/models"), 503, "loading");
  runtime::ModelOptions mo;
  mo.pool.progress = false;
  mo.threads = 2;
  auto model = runtime::Model::Load(testing::FixtureDir("qwen3_moe"), mo);
  ASSERT_TRUE(model.ok()) << model.status();
  model_ = std::move(*model);
  auto executor = runtime::ModelExecutor::Create(*model_, 512);
  ASSERT_TRUE(executor.ok());
  ASSERT_TRUE(frontend_->Serve(*std::move(executor)).ok());
  EXPECT_EQ(Post("/v1/completions", json{{"prompt", Prompt()}, {"max_tokens", 1}}).status, 200);
  // While a drain waits for a long request, new ones get 503.
  std::thread long_request([this] {
    httplib::Client client("127.0.0.1", frontend_->http_port());
    client.set_read_timeout(std::chrono::seconds(60));
    client.Post("/v1/completions", json{{"prompt", Prompt()}, {"max_tokens", 300}, {"ignore_eos", true}}.dump(),
                "application/json");
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (frontend_->engine().stats().running == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::thread drain([this] { frontend_->Drain(std::chrono::milliseconds(3000)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  httplib::Client during("127.0.0.1", frontend_->http_port());
  auto response = during.Post("/v1/completions", json{{"prompt", Prompt()}}.dump(), "application/json");
  if (response) ExpectError({response->status, response->body, ""}, 503, "shutting down");
  drain.join();
  long_request.join();
}

// A client that goes away mid-stream cancels its request: the engine frees its KV blocks.
TEST_F(OpenAiApiTest, DisconnectMidStreamFreesTheKvBlocks) {
  StartServer();
  const std::string body =
      json{{"prompt", Prompt()}, {"max_tokens", 900}, {"ignore_eos", true}, {"stream", true}}.dump();
  const int fd = Connect(frontend_->http_port());
  ASSERT_GE(fd, 0);
  const std::string request = absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                           "application/json\r\nContent-Length: ",
                                           body.size(), "\r\n\r\n", body);
  ASSERT_EQ(::send(fd, request.data(), request.size(), MSG_NOSIGNAL), static_cast<ssize_t>(request.size()));
  // Read until the first event has come: the request is running.
  std::string got;
  char buf[4096];
  while (got.find("data: ") == std::string::npos) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    ASSERT_GT(n, 0) << got;
    got.append(buf, static_cast<size_t>(n));
  }
  EXPECT_THAT(got, HasSubstr("text/event-stream"));
  // The engine publishes its stats after the step that sent the event.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (frontend_->engine().stats().blocks_used == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_GT(frontend_->engine().stats().blocks_used, 0) << got;
  ::close(fd);
  deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  scheduler::SchedulerStats stats = frontend_->engine().stats();
  while ((stats.running > 0 || stats.blocks_used > 0) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    stats = frontend_->engine().stats();
  }
  EXPECT_EQ(stats.running, 0);
  EXPECT_EQ(stats.blocks_used, 0);
  EXPECT_THAT(frontend_->engine().RenderMetrics(), HasSubstr("moeserve_kv_blocks_used 0"));
}

// A client that closes its connection while it waits for a whole (not streamed) response: the
// request is cancelled, as a stream's is, instead of running to max_tokens.
TEST_F(OpenAiApiTest, DisconnectWhileWaitingForAWholeResponseCancelsIt) {
  StartServer();
  const std::string body = json{{"prompt", Prompt()}, {"max_tokens", 900}, {"ignore_eos", true}}.dump();
  const int fd = Connect(frontend_->http_port());
  ASSERT_GE(fd, 0);
  const std::string request = absl::StrCat(
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
      "application/json\r\nContent-Length: ",
      body.size(), "\r\n\r\n", body);
  ASSERT_EQ(::send(fd, request.data(), request.size(), MSG_NOSIGNAL), static_cast<ssize_t>(request.size()));
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (frontend_->engine().stats().blocks_used == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_GT(frontend_->engine().stats().blocks_used, 0);
  ::close(fd);
  deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  scheduler::SchedulerStats stats = frontend_->engine().stats();
  while ((stats.running > 0 || stats.blocks_used > 0) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    stats = frontend_->engine().stats();
  }
  EXPECT_EQ(stats.blocks_used, 0);
  const std::string metrics = frontend_->engine().RenderMetrics();
  EXPECT_THAT(metrics, HasSubstr("moeserve_requests_aborted_total 1"));
  EXPECT_THAT(metrics, HasSubstr("moeserve_requests_finished_total 0"));
}

// What the API cannot honour is refused with the field named, never ignored or answered 500:
// invalid UTF-8, fields other servers take (logit_bias, ...), an unknown model (404).
TEST_F(OpenAiApiTest, WhatCannotBeHonouredIsRefusedNamingTheField) {
  StartServer();
  const json chat_utf8 = ExpectError(
      Post("/v1/chat/completions",
           std::string("{\"messages\": [{\"role\": \"user\", \"content\": \"ok\"}, {\"role\": \"user\", \"content\": "
                       "\"caf\xc3\"}]}")),
      400, "messages[1].content: not valid UTF-8 (byte 0xc3 at offset ");
  EXPECT_EQ(chat_utf8["param"], "messages");
  EXPECT_EQ(ExpectError(Post("/v1/completions", std::string("{\"prompt\": \"\xff\xfe\", \"max_tokens\": 2}")), 400,
                        "prompt: not valid UTF-8 (byte 0xff")["param"],
            "prompt");
  ExpectError(Post("/v1/completions", std::string("{\"prompt\": [1], \"st\xedop\": 1}")), 400,
              "a key: not valid UTF-8");
  const json chat = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}};
  const std::pair<const char*, json> refused[] = {
      {"logit_bias", {{"5", 10}}},      {"prompt_logprobs", 1}, {"continue_final_message", true},
      {"functions", {{{"name", "f"}}}}, {"echo", true},         {"guided_json", {{"type", "object"}}},
  };
  for (const auto& [field, value] : refused) {
    json body = chat;
    body[field] = value;
    EXPECT_EQ(ExpectError(Post("/v1/chat/completions", body), 400, field)["param"], field) << field;
    json completion = {{"prompt", Prompt()}, {"max_tokens", 2}, {field, value}};
    EXPECT_EQ(ExpectError(Post("/v1/completions", completion), 400, field)["param"], field) << field;
  }
  ExpectError(
      Post("/v1/completions", json{{"prompt", Prompt()},
                                   {"stream", true},
                                   {"stream_options", {{"include_usage", true}, {"continuous_usage_stats", true}}}}),
      400, "continuous_usage_stats");
  // Empty or false values change nothing, and are taken.
  EXPECT_EQ(Post("/v1/completions",
                 json{{"prompt", Prompt()}, {"max_tokens", 1}, {"logit_bias", json::object()}, {"echo", false}})
                .status,
            200);
  const json unknown = ExpectError(Post("/v1/completions", json{{"prompt", Prompt()}, {"model", "gpt-4"}}), 404,
                                   "The model 'gpt-4' does not exist");
  EXPECT_EQ(unknown["param"], "model");
  EXPECT_THAT(frontend_->engine().RenderMetrics(), HasSubstr("moeserve_requests_rejected_total{code=\"NOT_FOUND\"} 1"));
}

// A request ended by a stop string counts as finished, not aborted; queue time ends when the
// first step working on a request starts, before its first token; chat's return_token_ids.
TEST_F(OpenAiApiTest, StopStringsFinishQueueTimeEndsAtTheFirstStepAndChatReturnsTokenIds) {
  ::testing::internal::CaptureStderr();
  StartServer(8, 16, nullptr, 1 << 20, /*request_log=*/true);
  if (!ServesText()) {
    (void)::testing::internal::GetCapturedStderr();
    GTEST_SKIP() << "this build reads no text";
  }
  const json plain = {{"prompt", "hello there"}, {"max_tokens", 12}, {"temperature", 0}, {"ignore_eos", true}};
  const HttpResult first = Post("/v1/completions", plain);
  ASSERT_EQ(first.status, 200) << first.body;
  const std::string text = json::parse(first.body)["choices"][0]["text"];
  size_t at = text.size() / 2;
  while (at < text.size() && !std::isalnum(static_cast<unsigned char>(text[at]))) ++at;
  if (at == text.size()) {
    (void)::testing::internal::GetCapturedStderr();
    GTEST_SKIP() << "no letter or digit in the second half of '" << text << "' to stop at";
  }
  json stopped = plain;
  stopped["stop"] = std::string(1, text[at]);
  const HttpResult second = Post("/v1/completions", stopped);
  ASSERT_EQ(second.status, 200) << second.body;
  EXPECT_EQ(json::parse(second.body)["choices"][0]["finish_reason"], "stop") << second.body;
  std::string metrics = frontend_->engine().RenderMetrics();
  EXPECT_THAT(metrics, HasSubstr("moeserve_requests_aborted_total 0"));

  const HttpResult chat = Post("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                                                            {"max_tokens", 4},
                                                            {"ignore_eos", true},
                                                            {"return_token_ids", true}});
  if (chat.status == 200) {
    const json body = json::parse(chat.body);
    ASSERT_TRUE(body["choices"][0].contains("token_ids")) << chat.body;
    EXPECT_EQ(body["choices"][0]["token_ids"].size(), body["usage"]["completion_tokens"].get<size_t>());
  }
  client_.reset();
  frontend_->Shutdown();
  frontend_.reset();
  const std::string err = ::testing::internal::GetCapturedStderr();
  int lines = 0;
  for (const std::string& line_text : std::vector<std::string>(absl::StrSplit(err, '\n'))) {
    if (line_text.find("\"api\":\"openai\"") == std::string::npos) continue;
    const json line = json::parse(line_text);
    if (line["http_status"] != 200) continue;
    ++lines;
    // Admitted when the step began; its first token came when that step ended.
    EXPECT_LT(line["queue_ms"].get<double>(), line["ttft_ms"].get<double>()) << line.dump();
  }
  EXPECT_GE(lines, 2) << err;
}

// A stop string is refused over HTTP, as over gRPC, when the model has no tokenizer to match it.
TEST_F(OpenAiApiTest, StopStringsWithoutATokenizerAreRefused) {
  runtime::ModelOptions mo;
  mo.pool.progress = false;
  mo.threads = 2;
  mo.pool.threads = 2;
  auto model = runtime::Model::Load(testing::FixtureDir("qwen3_moe"), mo);
  ASSERT_TRUE(model.ok()) << model.status();
  model_ = std::move(*model);
  scheduler::FrontendOptions options = Options(8, 16);
  options.model_dir = "";  // token ids only
  auto executor = runtime::ModelExecutor::Create(*model_, /*num_blocks=*/128);
  ASSERT_TRUE(executor.ok()) << executor.status();
  auto frontend = scheduler::Frontend::Start(*std::move(executor), options);
  ASSERT_TRUE(frontend.ok()) << frontend.status();
  frontend_ = std::move(*frontend);
  client_ = std::make_unique<httplib::Client>("127.0.0.1", frontend_->http_port());
  const json e = ExpectError(Post("/v1/completions", json{{"prompt", Prompt()}, {"max_tokens", 4}, {"stop", "x"}}), 400,
                             "stop: stop strings need the model's tokenizer");
  EXPECT_EQ(e["param"], "stop");
  EXPECT_EQ(Post("/v1/completions", json{{"prompt", Prompt()}, {"max_tokens", 2}}).status, 200);
}

// An HTTP/1.0 client never gets chunked transfer: a stream (which needs it) is refused with 400;
// a whole response comes with its Content-Length.
TEST_F(OpenAiApiTest, AnHttp10ClientNeverGetsChunkedEncoding) {
  StartServer();
  auto exchange = [&](const json& body) {
    const std::string text = body.dump();
    const int fd = Connect(frontend_->http_port());
    const std::string request = absl::StrCat(
        "POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: "
        "application/json\r\nContent-Length: ",
        text.size(), "\r\n\r\n", text);
    ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
    std::string got;
    char buf[4096];
    for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) got.append(buf, static_cast<size_t>(n));
    ::close(fd);
    return got;
  };
  const std::string streamed = exchange(json{{"prompt", Prompt()}, {"max_tokens", 3}, {"stream", true}});
  EXPECT_THAT(streamed, HasSubstr(" 400 "));
  EXPECT_THAT(streamed, HasSubstr("stream: an HTTP/1.0 client cannot take a stream"));
  EXPECT_THAT(streamed, ::testing::Not(HasSubstr("Transfer-Encoding")));
  const std::string whole = exchange(json{{"prompt", Prompt()}, {"max_tokens", 3}});
  EXPECT_THAT(whole, HasSubstr(" 200 "));
  EXPECT_THAT(whole, HasSubstr("Content-Length: "));
  EXPECT_THAT(whole, ::testing::Not(HasSubstr("Transfer-Encoding")));
  EXPECT_THAT(whole, HasSubstr("Connection: close"));  // HTTP/1.0's default
}

// The gRPC API takes text and chat prompts through the same pipeline: its text deltas add up to
// what the HTTP API answers for the same request, and a stop string ends it.
// Chat logprobs' `bytes` are each token's own bytes: a byte-level token that is part of a
// character (its text U+FFFD) gives its one byte, not U+FFFD's three.
TEST_F(OpenAiApiTest, LogprobBytesAreTheTokensOwnBytes) {
  StartServer();
  if (!ServesText()) GTEST_SKIP() << "this build has no tokenizer library";
  const HttpResult r = Post("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", "hello"}}}},
                                                         {"max_tokens", 16},
                                                         {"temperature", 0},
                                                         {"ignore_eos", true},
                                                         {"logprobs", true},
                                                         {"top_logprobs", 20}});
  if (r.status == 400 && r.body.find("jinja2") != std::string::npos) GTEST_SKIP() << "no jinja2";
  ASSERT_EQ(r.status, 200) << r.body;
  int partial = 0, whole = 0;
  const auto check = [&](const json& entry) {
    const std::string token = entry["token"];
    std::string bytes;
    for (const json& b : entry["bytes"]) bytes.push_back(static_cast<char>(b.get<int>()));
    if (token == "\xEF\xBF\xBD") {
      ++partial;
      EXPECT_EQ(bytes.size(), 1u) << entry.dump();
      EXPECT_GE(static_cast<unsigned char>(bytes[0]), 0x80) << entry.dump();
    } else {
      ++whole;
      EXPECT_EQ(bytes, token) << entry.dump();  // a whole token: its bytes are its text
    }
  };
  const json body = json::parse(r.body);
  for (const json& entry : body["choices"][0]["logprobs"]["content"]) {
    check(entry);
    for (const json& alt : entry["top_logprobs"]) check(alt);
  }
  EXPECT_GT(whole, 0) << r.body;
  EXPECT_GT(partial, 0) << "no alternative was part of a character: the case is not shown";
}

// The two APIs check a request's stop strings alike: their number, emptiness and size, with
// the same message.
TEST_F(OpenAiApiTest, BothApisRefuseTheSameStopStrings) {
  StartServer();
  if (!ServesText()) GTEST_SKIP() << "this build has no tokenizer library";
  auto stub = ::moeserve::v1::Generation::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", frontend_->port()), grpc::InsecureChannelCredentials()));
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {std::vector<std::string>(17, "x"), "stop: at most 16 stop strings, got 17"},
      {{"ok", ""}, "stop: a stop string may not be empty"},
      {{std::string(1025, 'z')}, "stop: a stop string has at most 1024 bytes, this one 1025"},
  };
  for (const auto& [stops, message] : cases) {
    ::moeserve::v1::GenerateRequest request;
    request.set_text("Once upon a time");
    request.mutable_stopping()->set_max_new_tokens(2);
    for (const std::string& stop : stops) request.add_stop(stop);
    grpc::ClientContext context;
    auto reader = stub->Generate(&context, request);
    ::moeserve::v1::GenerateResponse response;
    while (reader->Read(&response)) {
    }
    const grpc::Status status = reader->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << message;
    EXPECT_THAT(status.error_message(), HasSubstr(message));
    const json e =
        ExpectError(Post("/v1/completions", json{{"prompt", "Once upon a time"}, {"max_tokens", 2}, {"stop", stops}}),
                    400, message);
    EXPECT_EQ(e["param"], "stop");
  }
}

TEST_F(OpenAiApiTest, GrpcTakesTextAndMessages) {
  StartServer();
  if (!ServesText()) GTEST_SKIP() << "this build has no tokenizer library";
  auto stub = ::moeserve::v1::Generation::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", frontend_->port()), grpc::InsecureChannelCredentials()));
  const auto run = [&](const ::moeserve::v1::GenerateRequest& request, std::string* text,
                       ::moeserve::v1::GenerateResponse* last) {
    grpc::ClientContext context;
    auto reader = stub->Generate(&context, request);
    ::moeserve::v1::GenerateResponse response;
    while (reader->Read(&response)) {
      *text += response.text();
      *last = response;
    }
    return reader->Finish();
  };
  ::moeserve::v1::GenerateRequest request;
  request.set_text("Once upon a time");
  request.mutable_stopping()->set_max_new_tokens(10);
  request.mutable_stopping()->set_ignore_eos(true);
  std::string text;
  ::moeserve::v1::GenerateResponse last;
  grpc::Status status = run(request, &text, &last);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(last.finish_reason(), ::moeserve::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(last.usage().completion_tokens(), 10);
  const json http = json::parse(Post("/v1/completions", json{{"prompt", "Once upon a time"},
                                                              {"max_tokens", 10},
                                                              {"temperature", 0},
                                                              {"ignore_eos", true}})
                                    .body);
  EXPECT_EQ(text, http["choices"][0]["text"]);
  if (!text.empty()) {
    // The last character (a random-weight model writes any characters) as the stop string.
    size_t start = text.size() - 1;
    while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
    const std::string stop = text.substr(start);
    request.add_stop(stop);
    std::string cut;
    ASSERT_TRUE(run(request, &cut, &last).ok());
    EXPECT_EQ(last.finish_reason(), ::moeserve::v1::FINISH_REASON_STOP_STRING);
    EXPECT_EQ(cut, text.substr(0, text.find(stop)));
  }
  ::moeserve::v1::GenerateRequest chat;
  ::moeserve::v1::ChatMessage* message = chat.add_messages();
  message->set_role("user");
  message->set_content("Hi");
  chat.set_tools(R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])");
  chat.set_chat_template_kwargs(R"({"enable_thinking": false})");
  chat.mutable_stopping()->set_max_new_tokens(4);
  std::string reply;
  status = run(chat, &reply, &last);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_GT(last.usage().prompt_tokens(), 3);
  chat.set_chat_template_kwargs("[1]");
  status = run(chat, &reply, &last);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("chat_template_kwargs"));
}

// gRPC's response_format goes through the HTTP API's compiler: sampled outputs parse and follow
// the schema and end as EOS, a greedy one is the HTTP API's to the byte, and what the HTTP API
// refuses gRPC refuses as INVALID_ARGUMENT naming the keyword.
TEST_F(OpenAiApiTest, GrpcResponseFormatIsEnforcedAsOverHttp) {
  StartServer();
  if (!ServesText()) GTEST_SKIP() << "this build has no tokenizer library";
  auto stub = ::moeserve::v1::Generation::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", frontend_->port()), grpc::InsecureChannelCredentials()));
  const auto run = [&](const ::moeserve::v1::GenerateRequest& request, std::string* text,
                       ::moeserve::v1::GenerateResponse* last) {
    grpc::ClientContext context;
    auto reader = stub->Generate(&context, request);
    ::moeserve::v1::GenerateResponse response;
    while (reader->Read(&response)) {
      *text += response.text();
      *last = response;
    }
    return reader->Finish();
  };
  const json schema = {{"type", "object"},
                       {"properties",
                        {{"city", {{"type", "string"}, {"maxLength", 6}}},
                         {"days", {{"type", "integer"}}},
                         {"tags", {{"type", "array"}, {"items", {{"enum", {"sun", "rain"}}}}, {"maxItems", 2}}},
                         {"unit", {{"enum", {"c", "f"}}}}}},
                       {"required", {"city", "unit"}},
                       {"additionalProperties", false}};
  const json format = {{"type", "json_schema"}, {"json_schema", {{"name", "w"}, {"strict", true}, {"schema", schema}}}};
  for (int seed = 0; seed < 4; ++seed) {
    ::moeserve::v1::GenerateRequest request;
    request.set_text("The weather:");
    request.set_response_format(format.dump());
    request.mutable_sampling()->set_temperature(1.0f);
    request.mutable_sampling()->set_seed(seed);
    request.mutable_stopping()->set_max_new_tokens(300);
    std::string text;
    ::moeserve::v1::GenerateResponse last;
    const grpc::Status status = run(request, &text, &last);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(last.finish_reason(), ::moeserve::v1::FINISH_REASON_EOS) << text;
    const json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(value.is_object()) << text;
    for (const auto& [key, v] : value.items()) {
      EXPECT_TRUE(schema["properties"].contains(key)) << text;
    }
    ASSERT_TRUE(value.contains("city") && value["city"].is_string()) << text;
    EXPECT_LE(value["city"].get<std::string>().size(), 6u * 4) << text;  // 6 characters of up to 4 bytes
    EXPECT_TRUE(value["unit"] == "c" || value["unit"] == "f") << text;
    if (value.contains("days")) {
      EXPECT_TRUE(value["days"].is_number_integer()) << text;
    }
    if (value.contains("tags")) {
      ASSERT_TRUE(value["tags"].is_array()) << text;
      EXPECT_LE(value["tags"].size(), 2u) << text;
      for (const json& tag : value["tags"]) EXPECT_TRUE(tag == "sun" || tag == "rain") << text;
    }
  }
  // Greedy, the same request over both APIs writes the same JSON.
  ::moeserve::v1::GenerateRequest greedy;
  greedy.set_text("The weather:");
  greedy.set_response_format(format.dump());
  greedy.mutable_stopping()->set_max_new_tokens(300);
  std::string text;
  ::moeserve::v1::GenerateResponse last;
  ASSERT_TRUE(run(greedy, &text, &last).ok());
  const HttpResult http = Post("/v1/completions", json{{"prompt", "The weather:"},
                                                       {"max_tokens", 300},
                                                       {"temperature", 0},
                                                       {"response_format", format}});
  ASSERT_EQ(http.status, 200) << http.body;
  EXPECT_EQ(text, json::parse(http.body)["choices"][0]["text"]);
  greedy.set_response_format(R"({"type": "json_object"})");
  text.clear();
  ASSERT_TRUE(run(greedy, &text, &last).ok());
  const json object = json::parse(text, nullptr, false);
  EXPECT_TRUE(object.is_object() || last.finish_reason() == ::moeserve::v1::FINISH_REASON_LENGTH) << text;
  greedy.set_response_format(R"({"type": "text"})");
  EXPECT_TRUE(run(greedy, &text, &last).ok());

  const auto refused = [&](const std::string& response_format, const std::string& message) {
    ::moeserve::v1::GenerateRequest request;
    request.add_token_ids(1);
    request.set_response_format(response_format);
    std::string ignored;
    const grpc::Status status = run(request, &ignored, &last);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << response_format;
    EXPECT_THAT(status.error_message(), HasSubstr(message)) << response_format;
  };
  json minimum = schema;
  minimum["properties"]["days"]["minimum"] = 1;
  refused(json{{"type", "json_schema"}, {"json_schema", {{"schema", minimum}}}}.dump(),
          "response_format.json_schema.schema at /properties/days: the keyword 'minimum' cannot be enforced");
  refused(R"({"type": "json_schema", "json_schema": {"schema": {"type": "string", "format": "email"}}})",
          "the keyword 'format'");
  refused(R"({"type": "xml"})", "response_format: expected {\"type\": \"text\"}, \"json_object\" or \"json_schema\"");
  refused(R"({"type": "json_schema"})", "response_format.json_schema: expected an object with a schema");
  refused(R"({"type": "json_schema", "json_schema": {"name": "x"}})", "response_format.json_schema.schema: required");
  refused(R"({"type": "json_object")", "response_format:1:");
}

// gRPC's tool_choice goes through the HTTP API's grammar: "required" and a named function come
// back as whole calls in the final message whose arguments follow the tools' parameters, greedy
// the same calls as over HTTP, and what cannot be enforced is INVALID_ARGUMENT naming it.
TEST_F(OpenAiApiTest, GrpcToolChoiceIsEnforcedAsOverHttp) {
  StartServer();
  if (!ServesText()) GTEST_SKIP() << "this build has no tokenizer library";
  auto stub = ::moeserve::v1::Generation::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", frontend_->port()), grpc::InsecureChannelCredentials()));
  struct Result {
    grpc::Status status;
    std::string text;
    std::vector<::moeserve::v1::ToolCallDelta> calls;
    ::moeserve::v1::GenerateResponse last;
  };
  const auto run = [&](const ::moeserve::v1::GenerateRequest& request) {
    Result r;
    grpc::ClientContext context;
    auto reader = stub->Generate(&context, request);
    ::moeserve::v1::GenerateResponse response;
    while (reader->Read(&response)) {
      r.text += response.text();
      for (const auto& call : response.tool_calls()) r.calls.push_back(call);
      r.last = response;
    }
    r.status = reader->Finish();
    return r;
  };
  const json tools = {{{"type", "function"},
                       {"function",
                        {{"name", "get_weather"},
                         {"parameters",
                          {{"type", "object"},
                           {"properties", {{"city", {{"type", "string"}, {"maxLength", 5}}}, {"days", {{"type", "integer"}}}}},
                           {"required", {"city"}},
                           {"additionalProperties", false}}}}}},
                      {{"type", "function"},
                       {"function",
                        {{"name", "get_time"},
                         {"parameters",
                          {{"type", "object"},
                           {"properties", {{"utc", {{"type", "boolean"}}}}},
                           {"additionalProperties", false}}}}}}};
  // The arguments follow the named tool's parameters.
  const auto expect_valid = [&](const std::string& name, const std::string& arguments) {
    const json args = json::parse(arguments, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(args.is_object()) << name << " " << arguments;
    if (name == "get_weather") {
      ASSERT_TRUE(args.contains("city") && args["city"].is_string()) << arguments;
      EXPECT_LE(args["city"].get<std::string>().size(), 5u * 4) << arguments;
      if (args.contains("days")) EXPECT_TRUE(args["days"].is_number_integer()) << arguments;
      for (const auto& [key, v] : args.items()) EXPECT_TRUE(key == "city" || key == "days") << arguments;
    } else {
      ASSERT_EQ(name, "get_time");
      if (args.contains("utc")) EXPECT_TRUE(args["utc"].is_boolean()) << arguments;
      for (const auto& [key, v] : args.items()) EXPECT_EQ(key, "utc") << arguments;
    }
  };
  const auto request_for = [&](const std::string& tool_choice) {
    ::moeserve::v1::GenerateRequest request;
    ::moeserve::v1::ChatMessage* message = request.add_messages();
    message->set_role("user");
    message->set_content("weather in Oslo?");
    request.set_tools(tools.dump());
    request.set_tool_choice(tool_choice);
    request.mutable_stopping()->set_max_new_tokens(300);
    return request;
  };
  const json named = {{"type", "function"}, {"function", {{"name", "get_time"}}}};
  for (const std::string& choice : {std::string("\"required\""), std::string("required"), named.dump()}) {
    for (int seed = 0; seed < 3; ++seed) {
      ::moeserve::v1::GenerateRequest request = request_for(choice);
      request.mutable_sampling()->set_temperature(1.0f);
      request.mutable_sampling()->set_seed(seed);
      const Result r = run(request);
      ASSERT_TRUE(r.status.ok()) << r.status.error_message();
      EXPECT_EQ(r.last.finish_reason(), ::moeserve::v1::FINISH_REASON_EOS) << r.text;
      EXPECT_EQ(r.text, "") << choice;
      ASSERT_FALSE(r.calls.empty()) << choice;
      EXPECT_EQ(r.last.tool_calls_size(), static_cast<int>(r.calls.size()));  // whole, in the final message
      for (size_t i = 0; i < r.calls.size(); ++i) {
        const auto& call = r.calls[i];
        EXPECT_EQ(call.index(), static_cast<int>(i));
        EXPECT_FALSE(call.id().empty());
        if (choice == named.dump()) EXPECT_EQ(call.name(), "get_time");
        expect_valid(call.name(), call.arguments());
      }
      if (choice == named.dump()) EXPECT_EQ(r.calls.size(), 1u);
    }
  }
  // Greedy, the same calls as the HTTP API's.
  for (const json& choice : {json("required"), named}) {
    const Result r = run(request_for(choice.dump()));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    const HttpResult http = Post("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", "weather in Oslo?"}}}},
                                                            {"temperature", 0},
                                                            {"max_tokens", 300},
                                                            {"tools", tools},
                                                            {"tool_choice", choice}});
    ASSERT_EQ(http.status, 200) << http.body;
    const json calls = json::parse(http.body)["choices"][0]["message"]["tool_calls"];
    ASSERT_TRUE(calls.is_array()) << http.body;
    ASSERT_EQ(calls.size(), r.calls.size()) << http.body;
    for (size_t i = 0; i < r.calls.size(); ++i) {
      EXPECT_EQ(calls[i]["function"]["name"], r.calls[i].name());
      EXPECT_EQ(calls[i]["function"]["arguments"], r.calls[i].arguments());
    }
  }
  // "auto" and "none" leave the output free (no grammar).
  for (const std::string& choice : {std::string("auto"), std::string("\"none\"")}) {
    ::moeserve::v1::GenerateRequest request = request_for(choice);
    request.mutable_stopping()->set_max_new_tokens(4);
    EXPECT_TRUE(run(request).status.ok()) << choice;
  }

  const auto refused = [&](::moeserve::v1::GenerateRequest request, const std::string& message) {
    const Result r = run(request);
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << message;
    EXPECT_THAT(r.status.error_message(), HasSubstr(message));
  };
  refused(request_for("sometimes"), "tool_choice: expected auto, none, required or a named function");
  refused(request_for(R"({"type": "function", "function": {"name": "other"}})"),
          "tool_choice: the function 'other' is not in tools");
  ::moeserve::v1::GenerateRequest no_tools = request_for("required");
  no_tools.clear_tools();
  refused(no_tools, "tool_choice: 'required' needs tools");
  ::moeserve::v1::GenerateRequest with_format = request_for("required");
  with_format.set_response_format(R"({"type": "json_object"})");
  refused(with_format, "cannot go with a response_format");
  ::moeserve::v1::GenerateRequest bad_schema = request_for("required");
  bad_schema.set_tools(
      R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}}}}])");
  refused(bad_schema, "tools[0].function.parameters at /properties/n: the keyword 'multipleOf'");
  ::moeserve::v1::GenerateRequest no_messages;
  no_messages.add_token_ids(1);
  no_messages.set_tool_choice("required");
  refused(no_messages, "tool_choice");
}

}  // namespace
}  // namespace moe
