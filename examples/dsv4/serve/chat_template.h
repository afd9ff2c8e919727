// The chat template of the dsv4 reference model: its byte tokenizer has no special tokens for
// roles, so a conversation becomes plain text, one turn per block, ending where the assistant's
// reply starts:
//
//   <|system|>\nYou are terse.\n<|user|>\nHello\n<|assistant|>\n
//
// The same messages always give the same text, so prefill and decode (and an aggregated
// server) run the same tokens.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_CHAT_TEMPLATE_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_CHAT_TEMPLATE_H_

#include <string>

#include <nlohmann/json.hpp>

#include "src/util/json_fields.h"

namespace dsv4::serve {

// Most messages in one request, and most content parts in one message.
inline constexpr size_t kMaxChatMessages = 1024;
inline constexpr size_t kMaxContentParts = 64;

// Renders the `messages` field of the request body `f` reads (`f`, which records the first error,
// naming the message and field: roles system, developer, user, assistant; content a string or
// an array of {"type": "text", "text": ...} parts). Returns "" after an error.
std::string ApplyChatTemplate(kvwire::JsonFields& f);

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_CHAT_TEMPLATE_H_
