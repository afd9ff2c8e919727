// Connector peer messages (src/connector/peer_messages.cc OnMessage, write_mode.cc): what a
// handshaken engine peer sends on the connector's message topic. Sent for real: an attacker
// engine connected to a live connector (connector_fixture.h) sends each message with
// Engine::SendMessage, so the bytes take the path a hostile peer's would, and the connector's
// progress thread handles them. An exception or crash there kills this process, which is the
// failure the fuzzer reports.
//
// Input: messages separated by a 0x1e byte (ASCII record separator). "$TID" in a message is
// replaced by the transfer id of a read-mode request the connector holds for this input (so
// that release / fail / read_start / write_req reach a live request). After the messages, a
// bare {"t":"hello"} is sent; the connector answers every hello in order, so once the answer
// to it arrived every message before it has been handled.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

#include "kvwire/engine.h"
#include "src/connector/peer_message.h"
#include "tests/fuzz/connector_fixture.h"
#include "tests/fuzz/fuzz_util.h"

namespace kvwire::fuzz {
namespace {

constexpr char kTopic[] = "kvwire.connector";

struct Attacker {
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Inbox> inbox;
  PeerId peer = 0;
};

Attacker& Peer() {
  static Attacker* attacker = [] {
    ConnectorFixture& victim = Victim();
    auto* a = new Attacker;
    EngineOptions o;
    o.name = "attacker";
    o.listen_address = "127.0.0.1:0";
    o.transport = "tcp";
    o.tcp().connections = 1;
    absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(o);
    KVWIRE_FUZZ_CHECK(engine.ok());
    a->engine = *std::move(engine);
    absl::StatusOr<std::unique_ptr<Inbox>> inbox = a->engine->OpenInbox(kTopic);
    KVWIRE_FUZZ_CHECK(inbox.ok());
    a->inbox = *std::move(inbox);
    absl::StatusOr<PeerId> peer = a->engine->Connect(victim.connector->engine().address());
    KVWIRE_FUZZ_CHECK(peer.ok());
    a->peer = *peer;
    return a;
  }();
  return *attacker;
}

// True when the connector answers `message` with a hello_ack or hello_err: a JSON object
// whose "t" is the string "hello".
bool IsHello(std::string_view message) {
  const nlohmann::json j = nlohmann::json::parse(message, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return false;
  auto t = j.find("t");
  return t != j.end() && t->is_string() && t->get_ref<const std::string&>() == "hello";
}

bool IsHelloAnswer(std::string_view message) {
  const nlohmann::json j = nlohmann::json::parse(message, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return false;
  auto t = j.find("t");
  return t != j.end() && t->is_string() &&
         (t->get_ref<const std::string&>() == "hello_ack" ||
          t->get_ref<const std::string&>() == "hello_err");
}

}  // namespace
}  // namespace kvwire::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvwire::fuzz;
  ConnectorFixture& victim = Victim();
  Attacker& attacker = Peer();
  static uint64_t input = 0;
  ++input;

  // A read-mode request held for a reader, whose transfer id the messages may name.
  const std::string req = absl::StrCat("fuzz-", input);
  kvwire::BlockTable blocks;
  for (const kvwire::CacheGroup& g : victim.layout.groups) blocks[g.name] = {0, 1};
  absl::StatusOr<kvwire::RequestFinishedResult> held = victim.connector->RequestFinished(
      req, blocks, 32, R"({"do_remote_decode":true})", /*aborted=*/false);
  KVWIRE_FUZZ_CHECK(held.ok() && !held->kv_transfer_params.empty());
  absl::StatusOr<kvwire::KvTransferParams> params =
      kvwire::KvTransferParams::FromJson(held->kv_transfer_params);
  KVWIRE_FUZZ_CHECK(params.ok());

  const std::string_view text(reinterpret_cast<const char*>(data), size);
  int answers = 1;  // the closing hello's
  for (std::string_view part : SplitInput(text, "\x1e")) {
    const std::string message = absl::StrReplaceAll(absl::string_view(part.data(), part.size()),
                                                    {{"$TID", params->transfer_id}});
    // The connector reads a layer message in its written form without a JSON document: that
    // reader must say what the JSON reader says, or leave the message to it.
    if (std::optional<kvwire::connector_internal::PeerMessage> fast =
            kvwire::connector_internal::ParseLayerMessageAsWritten(message)) {
      absl::StatusOr<kvwire::connector_internal::PeerMessage> json =
          kvwire::connector_internal::ParsePeerMessageAsJson(message);
      KVWIRE_FUZZ_CHECK(json.ok() && json->type == fast->type && json->name == fast->name &&
                        json->transfer_id == fast->transfer_id && json->layer == fast->layer);
    }
    // A message over the engine's size limit is refused locally: it never reaches the victim.
    const bool hello = IsHello(message);
    if (attacker.engine->SendMessage(attacker.peer, kTopic, message).ok() && hello) ++answers;
  }
  if (!attacker.engine->SendMessage(attacker.peer, kTopic, R"({"t":"hello"})").ok()) {
    // The victim already closed this peer for a malformed message (what it should do), before
    // the closing hello could go: dial again for the next input.
    absl::StatusOr<kvwire::PeerId> peer =
        attacker.engine->Connect(victim.connector->engine().address());
    KVWIRE_FUZZ_CHECK(peer.ok());
    attacker.peer = *peer;
    answers = 0;
  }

  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (answers > 0) {
    KVWIRE_FUZZ_CHECK(absl::Now() < deadline);  // the connector stopped answering: a hang
    for (const kvwire::InboxEvent& e : attacker.inbox->Wait(absl::Milliseconds(100))) {
      if (e.peer != attacker.peer) continue;  // from before a reconnect
      if (e.kind == kvwire::InboxEvent::Kind::kPeerClosed) {
        // The victim refused a malformed message by closing this peer (what it should do):
        // the rest of the input is moot. Dial again for the next input.
        absl::StatusOr<kvwire::PeerId> peer =
            attacker.engine->Connect(victim.connector->engine().address());
        KVWIRE_FUZZ_CHECK(peer.ok());
        attacker.peer = *peer;
        answers = 0;
        break;
      }
      if (IsHelloAnswer(e.payload)) --answers;
    }
  }
  (void)victim.connector->GetFinished();
  return 0;
}
