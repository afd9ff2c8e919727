// The router's proxy of one request (Router::Impl::Proxy): the vLLM P/D protocol.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/router_impl.h"
#include "src/control/hmac.h"
#include "src/util/json_fields.h"

namespace dsv4::serve {

using kvwire::JsonFields;
using kvwire::Kv;
using nlohmann::json;

namespace {

// An error the client gets: HTTP status and message.
struct Failure {
  Failure(int s, std::string m, std::string r = "")
      : status(s), message(std::move(m)), retry_after(std::move(r)) {}
  int status = 502;
  std::string message;
  std::string retry_after;  // an overloaded upstream's Retry-After, passed on
};

// An upstream's error answer as the client's: an overloaded server (503 with Retry-After:
// its admission queue is full or the request waited too long for KV blocks) stays a 503 with
// the same Retry-After, so the client backs off; any other server error is a bad gateway.
Failure UpstreamFailure(const HttpResponse& r, std::string message) {
  if (r.status == 503 && !r.retry_after.empty()) return {503, std::move(message), r.retry_after};
  return {r.status >= 500 ? 502 : r.status, std::move(message), ""};
}

// What the router keeps queued for a streaming client before it stops reading from decode.
constexpr uint64_t kMaxRelayBacklog = 1 << 20;

// What the router takes from prefill's answer: the kv_transfer_params object (read mode) and
// the kvwire statistics (decode recomputes the first token: none travels). A prefill server
// that answers anything but a completion is a 502, not a crash.
struct PrefillAnswer {
  json kv_transfer_params;  // null when absent
  json stats;               // null when absent
};

absl::StatusOr<PrefillAnswer> ParsePrefillAnswer(const std::string& body) {
  absl::StatusOr<json> j = kvwire::ParseJsonObject(body, "prefill's answer", kHttpJsonLimits);
  if (!j.ok()) return j.status();
  const json& root = *j;
  const auto choices = root.find("choices");
  if (choices == root.end() || !choices->is_array() || choices->empty() ||
      !(*choices)[0].is_object()) {
    return absl::InvalidArgumentError("prefill's answer has no choices[0]");
  }
  PrefillAnswer a;
  JsonFields f(root, "prefill's answer");
  const json* kvp = f.Object("kv_transfer_params", /*required=*/false);
  const json* stats = f.Object("kvwire", /*required=*/false);
  if (!f.ok()) return f.status();
  if (kvp != nullptr) a.kv_transfer_params = *kvp;
  if (stats != nullptr) a.stats = *stats;
  return a;
}

}  // namespace

// The vLLM P/D protocol: the prompt to prefill (do_remote_decode, max_tokens 1, not
// streamed), then the original request with prefill's kv_transfer_params to decode.
void Router::Impl::Proxy(json body, bool stream, Endpoint endpoint,
                         const std::shared_ptr<Responder>& resp) {
  const std::string api = EndpointPath(endpoint);
  const absl::Time deadline = absl::Now() + options_.timeout;
  const bool write = options_.mode == "write";
  // In write mode the id is a bearer capability between authenticated engines (whoever
  // presents it to prefill first claims the request's KV): 128 bits from the CSPRNG, never a
  // counter or a clock.
  absl::StatusOr<std::string> random = kvwire::control::RandomNonce(16);
  if (!random.ok()) {
    resp->Error(500, absl::StrCat("cannot make a transfer id: ", random.status().message()));
    return;
  }
  const std::string tid = absl::StrCat("rt-", absl::BytesToHexString(*random));
  std::optional<Failure> failure;
  std::string prefill_server, decode_server;
  // Write mode: the decode's blocks are taken from prepare on, so it counts as loaded from
  // then until the request ends.
  InstanceSet::Ticket decode_ticket;
  json decode_params;
  PrefillAnswer prefill_answer;

  // --- write mode: decode prepares first (allocates and sends its block ids to prefill
  // through the connector), so prefill can push each layer as soon as it is computed ---
  auto prefill_body = [&](bool write_mode) {
    json pb = body;
    pb["max_tokens"] = 1;
    if (pb.contains("max_completion_tokens")) pb["max_completion_tokens"] = 1;
    pb["stream"] = false;
    pb.erase("stream_options");
    pb["kv_transfer_params"] =
        write_mode ? json{{"do_remote_decode", true}, {"mode", "write"}, {"transfer_id", tid}}
                   : json{{"do_remote_decode", true}, {"mode", "read"}};
    return pb.dump();
  };
  // Checks prefill's answer: the first token and (read) the kv_transfer_params.
  auto take_prefill = [&](const absl::StatusOr<HttpResponse>& r) {
    if (!r.ok()) {
      if (absl::IsResourceExhausted(r.status())) ++too_large_;
      failure = Failure{StatusFor(r.status()),
                        prefill_server.empty() ? absl::StrCat("prefill: ", r.status().message())
                                               : absl::StrCat("prefill server ", prefill_server,
                                                              " failed: ", r.status().message())};
      return;
    }
    if (r->status != 200) {
      failure =
          UpstreamFailure(*r, absl::StrCat("prefill ", prefill_server, ": ", UpstreamMessage(*r)));
      return;
    }
    absl::StatusOr<PrefillAnswer> answer = ParsePrefillAnswer(r->body);
    if (!answer.ok()) {
      failure =
          Failure{502, absl::StrCat("prefill ", prefill_server, ": ", answer.status().message())};
      return;
    }
    prefill_answer = *std::move(answer);
    if (!write) {
      const json& kvp = prefill_answer.kv_transfer_params;
      if (!kvp.is_object()) {
        failure = Failure{
            502, absl::StrCat("prefill ", prefill_server, " answered without kv_transfer_params")};
      } else if (!kvp.contains("do_remote_prefill") || kvp["do_remote_prefill"] != true) {
        // Decode would run the whole prompt again: a prefill that is not one is an error.
        failure = Failure{502, absl::StrCat("prefill ", prefill_server,
                                            " answered kv_transfer_params without "
                                            "do_remote_prefill: true")};
      } else {
        decode_params = prefill_answer.kv_transfer_params;
      }
    }
  };
  // The client that leaves ends the upstream calls too (their servers notice the closed
  // connection: decode stops generating and frees its blocks).
  auto client_gone = [this, resp] { return Stopping() || resp->closed(); };
  HttpCallOptions call_options;
  call_options.deadline = deadline;
  call_options.body_limit = options_.max_upstream_body;
  call_options.cancelled = client_gone;
  if (write) {
    // Each prefill server at most once: one that cannot be reached is skipped.
    const std::vector<std::string> prefills = instances_->Order(InstanceKind::kPrefill);
    failure = Failure{503, prefills.empty() ? instances_->NoneReason(InstanceKind::kPrefill)
                                            : "no prefill server reachable"};
    for (const std::string& p : prefills) {
      prefill_server = p;
      // Discovered: decode's connector resolves the prefill by its engine id through etcd.
      // With etcd unreachable a decode could not resolve a prefill it has not met yet, so
      // the prefill is named by the kv address it reports, as for a static list.
      const std::string engine_id =
          instances_->directory_reachable() ? instances_->EngineId(prefill_server) : "";
      absl::StatusOr<std::string> kv =
          engine_id.empty() ? KvAddress(prefill_server, deadline) : absl::StatusOr<std::string>("");
      if (!kv.ok()) {
        failure = Failure{StatusFor(kv.status()), absl::StrCat("prefill server ", prefill_server,
                                                               ": ", kv.status().message())};
        if (absl::IsUnavailable(kv.status())) continue;
        break;
      }
      std::string host;
      int port = 0;
      if (engine_id.empty() && !SplitHostPort(*kv, &host, &port)) {
        ForgetKvAddress(prefill_server);
        failure = Failure{502, absl::StrCat("prefill server ", prefill_server,
                                            " has a malformed kv_address '", *kv, "'")};
        break;
      }
      decode_params = {{"do_remote_prefill", true}, {"mode", "write"}, {"transfer_id", tid}};
      if (engine_id.empty()) {
        decode_params["remote_host"] = host;
        decode_params["remote_port"] = port;
      } else {
        decode_params["remote_engine_id"] = engine_id;  // resolved by decode through etcd
      }
      // The whole request (prompt or messages, max_tokens: decode reserves the blocks of the
      // whole generation when it prepares), so decode prepares for the same tokens.
      json prep_json = body;
      prep_json["kv_transfer_params"] = decode_params;
      prep_json["stream"] = false;
      prep_json.erase("stream_options");
      prep_json.erase("kvwire_prefill");
      const std::string prep_body = prep_json.dump();
      absl::StatusOr<HttpResponse> prep = TryEach(
          InstanceKind::kDecode,
          [&](const std::string& d) {
            return HttpCall(d, "POST", "/v1/kv/prepare", prep_body, call_options);
          },
          &decode_server);
      if (!prep.ok()) {
        if (absl::IsResourceExhausted(prep.status())) ++too_large_;
        failure = Failure{StatusFor(prep.status()),
                          absl::StrCat("decode prepare failed: ", prep.status().message())};
        break;
      }
      if (prep->status != 200) {
        failure = UpstreamFailure(
            *prep, absl::StrCat("decode ", decode_server, ": ", UpstreamMessage(*prep)));
        break;
      }
      failure.reset();
      decode_ticket = instances_->Acquire(InstanceKind::kDecode, decode_server,
                                          /*count_route=*/false);
      InstanceSet::Ticket prefill_ticket =
          instances_->Acquire(InstanceKind::kPrefill, prefill_server);
      absl::StatusOr<HttpResponse> r =
          HttpCall(prefill_server, "POST", api, prefill_body(true), call_options);
      prefill_ticket.Release();
      take_prefill(r);
      if (failure) {
        // Let decode give its blocks back now rather than at its deadline.
        HttpCallOptions o;
        o.deadline = absl::Now() + absl::Seconds(5);
        (void)HttpCall(decode_server, "POST", "/v1/kv/abort", json{{"transfer_id", tid}}.dump(), o);
        if (!r.ok()) ForgetKvAddress(prefill_server);
        if (!r.ok() && absl::IsUnavailable(r.status())) continue;  // gone: try the next
      }
      break;
    }
  } else {
    const std::string pb = prefill_body(false);
    take_prefill(TryEach(
        InstanceKind::kPrefill,
        [&](const std::string& p) { return HttpCall(p, "POST", api, pb, call_options); },
        &prefill_server));
  }

  // --- decode: the original request with prefill's kv_transfer_params, streamed back ---
  bool started = false;
  if (!failure) {
    json db = body;
    db["kv_transfer_params"] = decode_params;
    db.erase("kvwire_prefill");  // prefill's, never the client's
    if (!prefill_answer.stats.is_null()) db["kvwire_prefill"] = prefill_answer.stats;
    std::string collected;
    int status = 0;
    std::string retry_after;
    bool too_large = false;
    auto call = [&](const std::string& d) {
      HttpCallOptions o;
      o.deadline = deadline;
      o.cancelled = client_gone;
      // A stream is relayed, never held, however long; a non-streamed answer is bounded
      // by on_body (max_upstream_body).
      o.body_limit = std::numeric_limits<uint64_t>::max();
      o.on_headers = [&](const HttpResponse& head) {
        status = head.status;
        retry_after = head.retry_after;
        if (stream && head.status == 200) {
          resp->StartEvents();
          started = true;
        }
      };
      o.on_body = [&](std::string_view piece) {
        if (client_gone()) return false;
        if (started) {
          resp->Raw(std::string(piece));
          // Relayed, not held: while the client has not taken what is queued, stop reading
          // from decode (its socket buffers fill and it waits on its writes).
          while (resp->pending_bytes() > kMaxRelayBacklog) {
            if (client_gone() || absl::Now() > deadline) return false;
            absl::SleepFor(absl::Milliseconds(2));
          }
        } else if (collected.size() + piece.size() > options_.max_upstream_body) {
          too_large = true;
          return false;
        } else {
          collected.append(piece);
        }
        return true;
      };
      return HttpCall(d, "POST", api, db.dump(), o);
    };
    absl::StatusOr<HttpResponse> r =
        write ? call(decode_server) : TryEach(InstanceKind::kDecode, call, &decode_server);
    if (too_large) {
      failure = Failure{
          502, absl::StrCat("decode server ", decode_server,
                            ": its answer is larger than the router's limit of ",
                            options_.max_upstream_body, " bytes (--max-upstream-body-mib)")};
      ++too_large_;
    } else if (!r.ok()) {
      failure = Failure{StatusFor(r.status()),
                        decode_server.empty() ? absl::StrCat("decode: ", r.status().message())
                                              : absl::StrCat("decode server ", decode_server,
                                                             " failed: ", r.status().message())};
    } else if (!started) {
      if (status == 200) {
        resp->Respond(200, collected);
      } else {
        HttpResponse head;
        head.status = status;
        head.retry_after = retry_after;
        head.body = collected;
        failure = UpstreamFailure(
            head, absl::StrCat("decode ", decode_server, ": ", UpstreamMessage(head)));
      }
    }
  }

  if (!failure) {
    ++ok_;
    if (started) resp->EndEvents(/*done=*/false);  // decode's own [DONE] went through
    return;
  }
  if (resp->closed()) {
    // Nobody to answer: the upstream calls were cut when the client left.
    ++client_gone_;
    KVW_LOG(kInfo, kLog) << "client went away; upstream request cancelled"
                         << Kv("error", failure->message);
    return;
  }
  ++errors_;
  KVW_LOG(kWarning, kLog) << "request failed" << Kv("status", failure->status)
                          << Kv("error", failure->message);
  if (started) {
    // Headers are out: the error travels as an event, and the stream ends without [DONE].
    resp->Event(ErrorJson(failure->status, failure->message));
    resp->EndEvents(/*done=*/false);
  } else if (!failure->retry_after.empty()) {
    int64_t seconds = 1;
    if (!absl::SimpleAtoi(failure->retry_after, &seconds)) seconds = 1;
    resp->ErrorRetryAfter(failure->status, failure->message,
                          absl::Seconds(std::clamp<int64_t>(seconds, 1, 3600)));
  } else {
    resp->Error(failure->status, failure->message);
  }
}

}  // namespace dsv4::serve
