// The text pipeline of a build without moe::text: every model serves token ids only.
#include "absl/strings/str_cat.h"
#include "moe/scheduler/text_pipeline.h"

namespace moe::scheduler {

void TextChunk::Append(TextChunk more) {
  content += more.content;
  reasoning += more.reasoning;
  for (ToolCallChunk& c : more.tool_calls) tool_calls.push_back(std::move(c));
}

struct TextModel::Impl {
  std::string reason;
  std::string no_parser;
};

TextModel::TextModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TextModel::~TextModel() = default;

absl::StatusOr<std::unique_ptr<TextModel>> TextModel::Load(const TextModelOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->reason = "this moeserve was built without the tokenizer (moe::text)";
  return std::unique_ptr<TextModel>(new TextModel(std::move(impl)));
}

bool TextModel::has_tokenizer() const { return false; }
bool TextModel::has_chat_template() const { return false; }
const std::string& TextModel::tool_call_parser() const { return impl_->no_parser; }
std::string TextModel::Describe() const { return absl::StrCat("token ids only: ", impl_->reason); }

absl::StatusOr<std::vector<int32_t>> TextModel::EncodeText(std::string_view) const {
  return absl::InvalidArgumentError(absl::StrCat(impl_->reason, ", so it takes prompts as token ids only"));
}
absl::StatusOr<std::vector<int32_t>> TextModel::EncodeChat(const ChatPrompt&) const {
  return absl::InvalidArgumentError(absl::StrCat(impl_->reason, ", so it cannot take chat messages"));
}
std::string TextModel::TokenText(int32_t id) const { return absl::StrCat("token_id:", id); }

struct OutputText::Impl {
  int tokens = 0;
};
OutputText::OutputText(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OutputText::~OutputText() = default;

absl::StatusOr<std::unique_ptr<OutputText>> TextModel::NewOutput(OutputTextOptions) const {
  return std::make_unique<OutputText>(std::make_unique<OutputText::Impl>());
}
TextChunk OutputText::Add(const std::vector<int32_t>& ids) {
  impl_->tokens += static_cast<int>(ids.size());
  return {};
}
TextChunk OutputText::Finish() { return {}; }
bool OutputText::stopped() const { return false; }
int OutputText::tokens() const { return impl_->tokens; }
bool OutputText::has_tool_calls() const { return false; }

}  // namespace moe::scheduler
