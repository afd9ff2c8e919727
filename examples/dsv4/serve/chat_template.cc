#include "examples/dsv4/serve/chat_template.h"

#include "absl/strings/str_cat.h"

namespace dsv4::serve {

using nlohmann::json;

namespace {

// The text of one message's content; "" after an error.
std::string Content(kvwire::JsonFields& m, const json& message) {
  const auto it = message.find("content");
  if (it == message.end() || it->is_null()) {
    m.Fail("content", "is required");
    return "";
  }
  if (it->is_string()) return m.String("content");
  const json* parts = m.Array("content", /*required=*/true, kMaxContentParts);
  if (parts == nullptr) {
    m.Fail("content", "must be a string or an array of text parts", *it);
    return "";
  }
  std::string text;
  for (size_t i = 0; i < parts->size() && m.ok(); ++i) {
    kvwire::JsonFields p = m.Item((*parts)[i], absl::StrCat("content[", i, "]"));
    const std::string type = p.String("type", 16);
    if (p.ok() && type != "text") {
      p.Fail("type", "must be \"text\" (the model reads text only)", json(type));
    }
    text += p.String("text");
  }
  return text;
}

}  // namespace

std::string ApplyChatTemplate(kvwire::JsonFields& f) {
  const json* messages = f.Array("messages", /*required=*/true, kMaxChatMessages);
  if (messages == nullptr) return "";
  if (messages->empty()) {
    f.Fail("messages", "must hold at least one message");
    return "";
  }
  std::string out;
  for (size_t i = 0; i < messages->size() && f.ok(); ++i) {
    const json& message = (*messages)[i];
    kvwire::JsonFields m = f.Item(message, absl::StrCat("messages[", i, "]"));
    if (!m.ok()) break;
    std::string role = m.String("role", 16);
    if (!m.ok()) break;
    if (role == "developer") role = "system";  // OpenAI's newer name for the system turn
    if (role != "system" && role != "user" && role != "assistant") {
      m.Fail("role", "must be system, developer, user or assistant", json(role));
      break;
    }
    for (const auto& [key, value] : message.items()) {
      if (key != "role" && key != "content" && !value.is_null()) {
        m.Fail(key, "is not supported in a message (role and content only)");
      }
    }
    const std::string text = Content(m, message);
    if (!m.ok()) break;
    absl::StrAppend(&out, "<|", role, "|>\n", text, "\n");
  }
  if (!f.ok()) return "";
  out += "<|assistant|>\n";
  return out;
}

}  // namespace dsv4::serve
