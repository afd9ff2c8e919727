#include "src/discovery/etcd_client.h"

#include <cstdlib>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "boost/asio/ssl/context.hpp"

#include "src/util/json_fields.h"
#include "src/util/log.h"

namespace kvwire::discovery {

using nlohmann::json;

namespace {

constexpr char kLog[] = "etcd";

std::string B64(const std::string& s) { return absl::Base64Escape(s); }

// Errors after which another member may do better: it could not be reached, did not answer
// in time, dropped the connection, or is itself cut off from the cluster's leader.
bool TryNextMember(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsAborted(s);
}

}  // namespace

void WatchCancel::Cancel() {
  MutexLock lock(&mu_);
  cancelled_ = true;
  if (current_ != nullptr) current_->Cancel();
}

bool WatchCancel::cancelled() {
  MutexLock lock(&mu_);
  return cancelled_;
}

absl::StatusOr<std::string> ReadPasswordFile(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    return absl::InvalidArgumentError(absl::StrCat("cannot read password file '", path, "'"));
  std::string line;
  std::getline(in, line);
  if (!line.empty() && line.back() == '\r') line.pop_back();
  return line;
}

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(EtcdOptions options) {
  std::vector<HttpEndpoint> endpoints;
  bool tls = false;
  for (absl::string_view e : absl::StrSplit(options.endpoints, ',', absl::SkipWhitespace())) {
    HttpEndpoint ep;
    if (absl::Status s = ParseEndpoint(std::string(absl::StripAsciiWhitespace(e)), &ep); !s.ok()) {
      return s;
    }
    tls = tls || ep.tls;
    endpoints.push_back(std::move(ep));
  }
  if (endpoints.empty()) return absl::InvalidArgumentError("no etcd endpoint given");
  if (endpoints.size() > 64) return absl::InvalidArgumentError("over 64 etcd endpoints");
  if (options.call_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("etcd call timeout must be positive");
  }
  const bool tls_files =
      !options.ca_file.empty() || !options.cert_file.empty() || !options.key_file.empty();
  if (tls_files && !tls) {
    // Certificates given for a cluster spoken to in plain HTTP: the deployment meant TLS.
    return absl::InvalidArgumentError(absl::StrCat(
        "etcd TLS files are set but no endpoint is https:// (", options.endpoints, ")"));
  }
  std::shared_ptr<boost::asio::ssl::context> context;
  if (tls) {
    absl::StatusOr<std::shared_ptr<boost::asio::ssl::context>> c =
        MakeTlsContext(options.ca_file, options.cert_file, options.key_file);
    if (!c.ok()) return c.status();
    context = *std::move(c);
  }
  if (options.user.empty() && !options.password.empty()) {
    return absl::InvalidArgumentError("an etcd password without a user");
  }
  return std::unique_ptr<EtcdClient>(
      new EtcdClient(std::move(options), std::move(endpoints), std::move(context)));
}

EtcdClient::EtcdClient(EtcdOptions options, std::vector<HttpEndpoint> endpoints,
                       std::shared_ptr<boost::asio::ssl::context> tls)
    : options_(std::move(options)), endpoints_(std::move(endpoints)), tls_(std::move(tls)) {}

HttpExchangeOptions EtcdClient::ExchangeOptions(const std::string& token) const {
  HttpExchangeOptions o;
  o.tls = tls_.get();
  o.authorization = token;
  return o;
}

absl::StatusOr<std::string> EtcdClient::Token() {
  if (options_.user.empty()) return std::string();
  {
    MutexLock lock(&token_mu_);
    if (!token_.empty()) return token_;
  }
  absl::StatusOr<std::string> r =
      CallOnce("/v3/auth/authenticate",
               json{{"name", options_.user}, {"password", options_.password}}.dump(), "");
  if (!r.ok()) {
    return absl::Status(r.status().code(), absl::StrCat("etcd authentication as '", options_.user,
                                                        "' failed: ", r.status().message()));
  }
  absl::StatusOr<std::string> token = ParseAuthenticateResponse(*r);
  if (!token.ok()) return token.status();
  MutexLock lock(&token_mu_);
  token_ = *token;
  return token_;
}

void EtcdClient::DropToken(const std::string& token) {
  MutexLock lock(&token_mu_);
  if (token_ == token) token_.clear();
}

namespace {

// etcd refused the token (expired, or the auth store changed since it was issued): a new
// one may do.
bool TokenRefused(const absl::Status& s) {
  return absl::IsUnauthenticated(s) || absl::StrContains(s.message(), "invalid auth token") ||
         absl::StrContains(s.message(), "revision of auth store is old");
}

}  // namespace

absl::StatusOr<std::string> EtcdClient::Call(const std::string& target, const std::string& body) {
  absl::StatusOr<std::string> token = Token();
  if (!token.ok()) return token.status();
  absl::StatusOr<std::string> r = CallOnce(target, body, *token);
  if (r.ok() || token->empty() || !TokenRefused(r.status())) return r;
  DropToken(*token);
  token = Token();
  if (!token.ok()) return token.status();
  return CallOnce(target, body, *token);
}

absl::StatusOr<std::string> EtcdClient::CallOnce(const std::string& target, const std::string& body,
                                                 const std::string& token) {
  const absl::Time deadline = absl::Now() + options_.call_timeout;
  const size_t n = endpoints_.size();
  // A member that hangs gets its share of the deadline, so that the others are still tried.
  const absl::Duration share =
      std::max(options_.call_timeout / static_cast<int64_t>(n), absl::Milliseconds(500));
  const size_t first = preferred_.load();
  const HttpExchangeOptions exchange_options = ExchangeOptions(token);
  absl::Status last;
  // Rounds over the members until the deadline: a member that lost its leader (an election
  // after a member died) answers Unavailable at once, and the next round may find a leader.
  for (size_t i = 0;; ++i) {
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    if (i > 0 && i % n == 0) {
      absl::SleepFor(std::min(absl::Milliseconds(100), deadline - now));
      if (absl::Now() >= deadline) break;
    }
    const size_t at = (first + i) % n;
    const HttpEndpoint& ep = endpoints_[at];
    HttpExchange exchange;
    absl::StatusOr<HttpReply> r =
        exchange.Post(ep, target, body, std::min(deadline, absl::Now() + share), nullptr,
                      kEtcdMaxBodyBytes, exchange_options);
    absl::Status s = r.status();
    if (r.ok()) s = EtcdError(r->status, r->body);
    if (s.ok()) {
      preferred_.store(at);
      return std::move(r->body);
    }
    if (!TryNextMember(s)) return s;
    KVW_LOG(kDebug, kLog) << "member failed, trying the next" << Kv("target", target)
                          << Kv("member", absl::StrCat(ep.host, ":", ep.port))
                          << Kv("error", s.message());
    last = s;
  }
  if (last.ok()) last = absl::DeadlineExceededError("no etcd member tried before the deadline");
  return absl::Status(
      last.code(), absl::StrCat("etcd (", options_.endpoints, ") ", target, ": ", last.message()));
}

absl::StatusOr<int64_t> EtcdClient::Put(const std::string& key, const std::string& value,
                                        int64_t lease) {
  json body = {{"key", B64(key)}, {"value", B64(value)}};
  if (lease != 0) body["lease"] = std::to_string(lease);
  absl::StatusOr<std::string> r = Call("/v3/kv/put", body.dump());
  if (!r.ok()) return r.status();
  return ParseHeaderRevision(*r);
}

absl::StatusOr<EtcdRange> EtcdClient::Get(const std::string& key) {
  absl::StatusOr<std::string> r = Call("/v3/kv/range", json{{"key", B64(key)}}.dump());
  if (!r.ok()) return r.status();
  return ParseRangeResponse(*r);
}

absl::StatusOr<EtcdRange> EtcdClient::GetPrefix(const std::string& prefix) {
  absl::StatusOr<std::string> r =
      Call("/v3/kv/range", json{{"key", B64(prefix)},
                                {"range_end", B64(PrefixRangeEnd(prefix))},
                                {"limit", std::to_string(kEtcdMaxKvs)}}
                               .dump());
  if (!r.ok()) return r.status();
  absl::StatusOr<EtcdRange> range = ParseRangeResponse(*r);
  if (range.ok() && range->more) {
    return absl::ResourceExhaustedError(
        absl::StrCat("etcd: over ", kEtcdMaxKvs, " keys under '", prefix, "'"));
  }
  return range;
}

absl::StatusOr<int64_t> EtcdClient::Delete(const std::string& key) {
  absl::StatusOr<std::string> r = Call("/v3/kv/deleterange", json{{"key", B64(key)}}.dump());
  if (!r.ok()) return r.status();
  int64_t deleted = 0;
  absl::StatusOr<int64_t> rev = ParseHeaderRevision(*r, &deleted);
  if (!rev.ok()) return rev.status();
  return deleted;
}

absl::StatusOr<EtcdLease> EtcdClient::GrantLease(int64_t ttl_seconds) {
  absl::StatusOr<std::string> r =
      Call("/v3/lease/grant", json{{"TTL", std::to_string(ttl_seconds)}}.dump());
  if (!r.ok()) return r.status();
  return ParseLeaseGrantResponse(*r);
}

absl::StatusOr<EtcdLease> EtcdClient::KeepAlive(int64_t lease) {
  absl::StatusOr<std::string> r =
      Call("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}.dump());
  if (!r.ok()) return r.status();
  absl::StatusOr<EtcdLease> l = ParseKeepAliveResponse(*r);
  if (l.ok() && l->ttl <= 0) {
    return absl::NotFoundError(absl::StrCat("etcd lease ", lease, " has expired"));
  }
  return l;
}

absl::Status EtcdClient::Revoke(int64_t lease) {
  absl::StatusOr<std::string> r =
      Call("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump());
  if (!r.ok()) return r.status();
  return ParseHeaderRevision(*r).status();
}

absl::Status EtcdClient::Watch(const std::string& prefix, int64_t start_revision,
                               absl::Time deadline,
                               const std::function<bool(const EtcdWatchMessage&)>& on_message,
                               WatchCancel* cancel) {
  const std::string body = json{{"create_request",
                                 {{"key", B64(prefix)},
                                  {"range_end", B64(PrefixRangeEnd(prefix))},
                                  {"start_revision", std::to_string(start_revision)}}}}
                               .dump();
  absl::StatusOr<std::string> token = Token();
  if (!token.ok()) return token.status();
  const size_t n = endpoints_.size();
  const size_t first = preferred_.load();
  absl::Status last;
  for (size_t i = 0; i < n; ++i) {
    const size_t at = (first + i) % n;
    const HttpEndpoint& ep = endpoints_[at];
    HttpExchange exchange;
    {
      MutexLock lock(&cancel->mu_);
      if (cancel->cancelled_) return absl::CancelledError("watch cancelled");
      cancel->current_ = &exchange;
    }
    // Messages are newline-separated JSON objects; a piece may end inside one.
    std::string pending;
    absl::Status bad;
    bool token_refused = false;
    auto on_body = [&](std::string_view piece) {
      pending.append(piece);
      size_t start = 0;
      while (true) {
        const size_t nl = pending.find('\n', start);
        if (nl == std::string::npos) break;
        const absl::string_view line(pending.data() + start, nl - start);
        start = nl + 1;
        if (absl::StripAsciiWhitespace(line).empty()) continue;
        absl::StatusOr<EtcdWatchMessage> m = ParseWatchMessage(line);
        if (!m.ok()) {
          bad = m.status();
          return false;
        }
        // A watch etcd refused for its token: the caller's next watch authenticates again.
        if (m->canceled && TokenRefused(absl::UnknownError(m->cancel_reason))) token_refused = true;
        if (!on_message(*m)) return false;
      }
      pending.erase(0, start);
      if (pending.size() > kEtcdMaxBodyBytes) {
        bad = absl::ResourceExhaustedError("etcd watch message over the size limit");
        return false;
      }
      return true;
    };
    absl::StatusOr<HttpReply> r =
        exchange.Post(ep, "/v3/watch", body, deadline, on_body,
                      std::numeric_limits<size_t>::max() / 2, ExchangeOptions(*token));
    {
      MutexLock lock(&cancel->mu_);
      cancel->current_ = nullptr;
    }
    if (token_refused) DropToken(*token);
    if (!bad.ok()) {
      if (TokenRefused(bad)) DropToken(*token);  // the caller's next watch authenticates
      return bad;
    }
    if (r.ok()) {
      if (absl::Status e = EtcdError(r->status, r->body); !e.ok()) {
        if (TokenRefused(e)) DropToken(*token);
        return e;
      }
      // A trailing message without its newline.
      if (!absl::StripAsciiWhitespace(pending).empty()) {
        absl::StatusOr<EtcdWatchMessage> m = ParseWatchMessage(pending);
        if (!m.ok()) return m.status();
        (void)on_message(*m);
      }
      preferred_.store(at);
      return absl::AbortedError("etcd closed the watch stream");
    }
    if (absl::IsDeadlineExceeded(r.status())) return absl::OkStatus();  // the session's end
    if (absl::IsCancelled(r.status())) {
      return cancel->cancelled() ? r.status() : absl::OkStatus();  // on_message stopped it
    }
    last = r.status();
    if (!absl::IsUnavailable(last)) break;  // connected, then lost: the caller re-lists
  }
  return last;
}

}  // namespace kvwire::discovery
