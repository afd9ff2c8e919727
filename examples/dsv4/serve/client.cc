#include "examples/dsv4/serve/client.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/http_client.h"
#include "examples/dsv4/serve/sse.h"

namespace dsv4::serve {

using nlohmann::json;

namespace {

// Takes the tokens, text and statistics of one completion object (or stream chunk).
void Absorb(const json& j, CompletionResult* r) {
  if (j.contains("error") && j["error"].is_object()) {
    r->error = j["error"].value("message", j.dump());
    return;
  }
  if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
    const json& c = j["choices"][0];
    if (c.contains("token_ids") && c["token_ids"].is_array()) {
      for (const json& t : c["token_ids"]) r->tokens.push_back(t.get<int32_t>());
    }
    if (c.contains("text") && c["text"].is_string()) r->text += c["text"].get<std::string>();
    if (c.contains("finish_reason") && c["finish_reason"].is_string()) {
      r->finish_reason = c["finish_reason"].get<std::string>();
    }
  }
  if (j.contains("kvwire")) r->kvwire = j["kvwire"];
}

}  // namespace

absl::StatusOr<CompletionResult> Complete(const std::string& address, const json& request,
                                          absl::Duration timeout) {
  CompletionResult r;
  const absl::Time start = absl::Now();
  SseParser sse;
  bool streamed = false;
  HttpCallOptions o;
  o.deadline = start + timeout;
  o.on_headers = [&](const HttpResponse& head) {
    r.status = head.status;
    streamed = head.content_type.rfind("text/event-stream", 0) == 0;
  };
  std::string body;
  o.on_body = [&](std::string_view piece) {
    if (!streamed) {
      body.append(piece);
      return true;
    }
    for (const std::string& e : sse.Feed(piece)) {
      if (e == "[DONE]") {
        r.done = true;
        continue;
      }
      json j = json::parse(e, nullptr, false);
      if (j.is_discarded()) {
        r.error = absl::StrCat("unparsable event: ", e);
        continue;
      }
      const size_t before = r.tokens.size();
      Absorb(j, &r);
      if (before == 0 && !r.tokens.empty())
        r.ttft_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
    }
    return true;
  };
  absl::StatusOr<HttpResponse> resp =
      HttpCall(address, "POST", "/v1/completions", request.dump(), o);
  if (!resp.ok()) return resp.status();
  r.total_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  if (!streamed) {
    r.ttft_ms = r.total_ms;
    json j = json::parse(body, nullptr, false);
    if (j.is_discarded()) {
      r.error = absl::StrCat("response is not JSON: ", body.substr(0, 200));
    } else {
      Absorb(j, &r);
    }
  }
  if (r.status != 200 && r.error.empty()) r.error = absl::StrCat("HTTP ", r.status);
  return r;
}

absl::StatusOr<json> GetJson(const std::string& address, const std::string& path,
                             absl::Duration timeout) {
  HttpCallOptions o;
  o.deadline = absl::Now() + timeout;
  // /health and /v1/models are small: an instance that answers more (the router polls
  // discovered ones) is refused, not held.
  o.body_limit = 1 << 20;
  absl::StatusOr<HttpResponse> r = HttpCall(address, "GET", path, "", o);
  if (!r.ok()) return r.status();
  json j = json::parse(r->body, nullptr, false);
  if (r->status != 200 || j.is_discarded()) {
    return absl::InternalError(absl::StrCat("GET ", path, ": HTTP ", r->status, " ", r->body));
  }
  return j;
}

}  // namespace dsv4::serve
