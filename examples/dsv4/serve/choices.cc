#include "examples/dsv4/serve/choices.h"

#include <optional>
#include <system_error>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#include "examples/dsv4/serve/http_client.h"
#include "examples/dsv4/serve/sse.h"
#include "src/util/json_fields.h"

namespace dsv4::serve {

using nlohmann::json;

namespace {

// What one choice's request ended with.
struct ChoiceCall {
  absl::StatusOr<HttpResponse> result = absl::UnknownError("not run");
  int status = 0;
  std::string raw;  // a non-200 answer's body (streams)
  json usage;       // the usage of its stream (null: none came)
  bool error_event = false;
};

const json* FirstChoice(const json& j) {
  if (!j.is_object()) return nullptr;
  const auto it = j.find("choices");
  if (it == j.end() || !it->is_array() || it->empty() || !(*it)[0].is_object()) return nullptr;
  return &(*it)[0];
}

uint64_t UsageField(const json& usage, const char* field) {
  if (!usage.is_object()) return 0;
  const auto it = usage.find(field);
  return it != usage.end() && it->is_number_unsigned() ? it->get<uint64_t>() : 0;
}

// prompt_tokens of the first, completion_tokens of all.
json SumUsage(const std::vector<json>& usages) {
  uint64_t prompt = usages.empty() ? 0 : UsageField(usages[0], "prompt_tokens"), completion = 0;
  for (const json& u : usages) completion += UsageField(u, "completion_tokens");
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion}};
}

// The message of a failed choice (an upstream error body's message when it has one).
std::string FailureMessage(const ChoiceCall& c, int index) {
  if (!c.result.ok()) return absl::StrCat("choice ", index, ": ", c.result.status().message());
  const std::string& body = c.raw.empty() ? c.result->body : c.raw;
  const json j = json::parse(body, nullptr, false);
  if (j.is_object() && j.contains("error") && j["error"].is_object() &&
      j["error"].contains("message") && j["error"]["message"].is_string()) {
    return absl::StrCat("choice ", index, ": ", j["error"]["message"].get<std::string>());
  }
  return absl::StrCat("choice ", index, ": HTTP ", c.status);
}

}  // namespace

json ChoiceRequest(const json& body, int index) {
  json b = body;
  b.erase("n");
  const auto seed = b.find("seed");
  if (seed != b.end() && seed->is_number_integer()) {
    // vLLM's parallel sampling: child i samples with seed + i (wrapping as int64).
    const uint64_t s = seed->is_number_unsigned() ? seed->get<uint64_t>()
                                                  : static_cast<uint64_t>(seed->get<int64_t>());
    *seed = static_cast<int64_t>(s + static_cast<uint64_t>(index));
  }
  return b;
}

void RunChoices(const std::string& address, const std::string& path, const json& body, int n,
                bool stream, Responder& resp, absl::Time deadline,
                const std::function<bool()>& cancelled) {
  std::vector<ChoiceCall> calls(static_cast<size_t>(n));
  kvwire::Mutex mu;       // one event at a time
  std::string stream_id;  // the first chunk's id, given to every chunk (one completion)
  bool include_usage = false;
  if (stream) {
    const auto so = body.find("stream_options");
    if (so != body.end() && so->is_object()) {
      kvwire::JsonFields f(*so, "stream_options");
      include_usage = f.OptBool("include_usage", false);
    }
    resp.StartEvents();
  }
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      ChoiceCall& c = calls[static_cast<size_t>(i)];
      json b = ChoiceRequest(body, i);
      HttpCallOptions o;
      o.deadline = deadline;
      o.cancelled = cancelled;
      SseParser parser;
      if (stream) {
        b["stream_options"] = {{"include_usage", true}};  // summed for the client
        o.on_headers = [&](const HttpResponse& head) { c.status = head.status; };
        o.on_body = [&](std::string_view piece) {
          if (c.status != 200) {
            c.raw.append(piece.substr(0, 65536 - std::min<size_t>(c.raw.size(), 65536)));
            return true;
          }
          for (const std::string& event : parser.Feed(piece)) {
            if (event == "[DONE]") continue;
            json j = json::parse(event, nullptr, false);
            if (!j.is_object()) continue;
            kvwire::MutexLock lock(&mu);
            if (j.contains("error")) {
              c.error_event = true;
              resp.Event(event);
            } else if (FirstChoice(j) == nullptr) {
              if (j.contains("usage")) c.usage = j;
            } else {
              for (json& choice : j["choices"]) {
                if (choice.is_object()) choice["index"] = i;
              }
              if (stream_id.empty() && j.contains("id") && j["id"].is_string()) {
                stream_id = j["id"].get<std::string>();
              }
              if (!stream_id.empty()) j["id"] = stream_id;
              resp.Event(kvwire::DumpJson(j));
            }
          }
          return true;
        };
      }
      c.result = HttpCall(address, "POST", path, b.dump(), o);
      if (c.result.ok() && !stream) c.status = c.result->status;
    });
  }
  for (std::thread& t : threads) t.join();
  std::optional<size_t> failed;
  for (size_t i = 0; i < calls.size() && !failed; ++i) {
    if (!calls[i].result.ok() || calls[i].status != 200 || calls[i].error_event) failed = i;
  }
  if (stream) {
    if (failed && !calls[*failed].error_event) {
      const ChoiceCall& c = calls[*failed];
      resp.Event(ErrorJson(c.status >= 400 ? c.status : 502,
                           FailureMessage(c, static_cast<int>(*failed))));
    }
    if (!failed && include_usage && calls[0].usage.is_object()) {
      std::vector<json> usages;
      for (const ChoiceCall& c : calls) usages.push_back(c.usage.value("usage", json()));
      json last = calls[0].usage;
      last["usage"] = SumUsage(usages);
      if (!stream_id.empty()) last["id"] = stream_id;
      resp.Event(kvwire::DumpJson(last));
    }
    resp.EndEvents(/*done=*/!failed);
    return;
  }
  if (failed) {
    const ChoiceCall& c = calls[*failed];
    if (c.result.ok()) return resp.Respond(c.status, c.result->body);
    return resp.Error(502, FailureMessage(c, static_cast<int>(*failed)));
  }
  json merged = json::parse(calls[0].result->body, nullptr, false);
  json choices = json::array();
  std::vector<json> usages;
  for (size_t i = 0; i < calls.size(); ++i) {
    const json j = json::parse(calls[i].result->body, nullptr, false);
    const json* choice = FirstChoice(j);
    if (choice == nullptr || !merged.is_object()) {
      return resp.Error(502, absl::StrCat("choice ", i, ": an answer without a choice"));
    }
    json c = *choice;
    c["index"] = i;
    choices.push_back(std::move(c));
    usages.push_back(j.value("usage", json()));
  }
  merged["choices"] = std::move(choices);
  merged["usage"] = SumUsage(usages);
  resp.Respond(200, kvwire::DumpJson(merged));
}

ChoicesRunner::~ChoicesRunner() {
  std::vector<Worker> workers;
  {
    kvwire::MutexLock lock(&mu_);
    workers.swap(workers_);
  }
  for (Worker& w : workers) w.thread.join();
}

bool ChoicesRunner::Start(std::function<void()> work) {
  kvwire::MutexLock lock(&mu_);
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (it->done->load()) {
      it->thread.join();
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
  auto done = std::make_shared<std::atomic<bool>>(false);
  try {
    workers_.push_back({std::thread([work = std::move(work), done] {
                          work();
                          done->store(true);
                        }),
                        done});
  } catch (const std::system_error&) {
    return false;
  }
  return true;
}

}  // namespace dsv4::serve
