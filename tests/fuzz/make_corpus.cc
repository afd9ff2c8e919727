// Writes the seed corpora of tests/fuzz/corpus/ from real messages: every seed is produced by
// the encoder the real sender uses (EncodeFrame of the handshake's messages, the tcp and shm
// wire encoders, KvTransferParams::ToJson, LayoutToJson of the presets, SerializeSafetensors,
// ...), so that fuzzing starts from inputs that get past the first checks. Run by hand after
// a wire format changes:
//   build/tests/fuzz/fuzz_make_corpus tests/fuzz/corpus
// It (re)writes only the seed-*.bin files; crash reproducers (crash-*) are left alone.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

#include "examples/dsv4/model/safetensors.h"
#include "kvwire/connector.h"
#include "kvwire/layout.h"
#include "proto/kvwire.pb.h"
#include "src/control/control.h"
#include "src/control/frame.h"
#include "src/control/handshake.h"
#include "transport/rdma/rdma.pb.h"
#include "transport/rdma/rdma_plan.h"
#include "transport/shm/fd_protocol.h"
#include "transport/shm/gpu_region_key.h"
#include "transport/shm/host_region_key.h"
#include "transport/shm/served_copy.h"
#include "transport/shm/shm_endpoint.h"
#include "transport/tcp/tcp_wire.h"

namespace kvwire {
namespace {

std::filesystem::path g_root;
int g_written = 0;

void Write(const std::string& target, const std::string& name, const std::string& bytes) {
  const std::filesystem::path dir = g_root / target;
  std::filesystem::create_directories(dir);
  std::ofstream out(dir / absl::StrCat("seed-", name, ".bin"), std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "cannot write %s/%s\n", dir.c_str(), name.c_str());
    std::exit(1);
  }
  ++g_written;
}

// One byte, e.g. a target's selector byte (a literal "\x00" + ... would be empty).
std::string Byte(uint8_t value) { return std::string(1, static_cast<char>(value)); }

std::string Frame(const pb::Envelope& envelope) { return *control::EncodeFrame(envelope, 1 << 16); }

pb::Hello MakeHello(const std::string& name, bool secret) {
  control::HandshakeConfig config;
  config.compat_hash = control::CompatibilityHash(0);
  if (secret) config.shared_secret = "not the fuzz target's secret";
  pb::Hello hello;
  hello.set_engine_name(name);
  hello.set_pid(4242);
  hello.set_session_token(std::string(32, '\x5a'));
  pb::TransportEndpoint* tcp = hello.add_transports();
  tcp->set_kind("tcp");
  tcp->set_endpoint("127.0.0.1:40000");
  pb::TransportEndpoint* shm = hello.add_transports();
  shm->set_kind("shm");
  shm->set_endpoint("kvwire-shm/1 host=host-1 socket=kvwire-4242 pid=4242 probe=7f00 nonce=1234");
  return *control::PrepareHello(hello, config);
}

void Control() {
  pb::Envelope hello;
  *hello.mutable_hello() = MakeHello("dialer", false);
  pb::Envelope hello_secret;
  *hello_secret.mutable_hello() = MakeHello("dialer", true);
  pb::Envelope ack;
  *ack.mutable_hello_ack()->mutable_hello() = MakeHello("listener", false);
  pb::Envelope ack_secret;
  *ack_secret.mutable_hello_ack()->mutable_hello() = MakeHello("listener", true);
  ack_secret.mutable_hello_ack()->set_auth_proof(std::string(32, '\x11'));
  pb::Envelope proof;
  proof.mutable_auth_proof()->set_proof(std::string(32, '\x22'));
  const pb::Envelope reject =
      control::MakeReject(absl::PermissionDeniedError("shared secret mismatch"));
  pb::Envelope heartbeat;
  heartbeat.mutable_heartbeat()->set_seq(7);
  pb::Envelope exports;
  pb::RegionDescriptor* region = exports.mutable_export_regions()->add_regions();
  region->set_id(3);
  region->set_length(1 << 20);
  region->set_access(3);
  region->set_address(0x7f0000000000);
  // shm's key of a memfd-backed host region (was RegionDescriptor.shareable).
  (*region->mutable_transport_keys())["shm"] = transport::shm::EncodeHostRegionKey(true);
  (*region->mutable_transport_keys())["rdma"] = "4660,4661";
  pb::Envelope revoke;
  revoke.mutable_revoke_regions()->add_ids(3);
  pb::Envelope notify;
  notify.mutable_notify()->set_transfer_id(9);
  notify.mutable_notify()->set_expected_arrivals(2);
  notify.mutable_notify()->set_payload("done");
  pb::Envelope goodbye;
  goodbye.mutable_goodbye()->set_code(14);
  goodbye.mutable_goodbye()->set_reason("shutting down");

  // control_frame: byte 0 is the piece size.
  Write("control_frame", "hello", Byte(0x07) + Frame(hello));
  Write("control_frame", "session",
        Byte(0x1f) + Frame(heartbeat) + Frame(exports) + Frame(notify) + Frame(revoke) +
            Frame(goodbye));
  Write("control_frame", "ack-proof", Byte(0x00) + Frame(ack_secret) + Frame(proof));
  // control_handshake: byte 0 = flags (1 dialer, 2 secret, 4 foreign salt).
  Write("control_handshake", "listener-plain", Byte(0x00) + Frame(hello));
  Write("control_handshake", "listener-secret", Byte(0x02) + Frame(hello_secret) + Frame(proof));
  Write("control_handshake", "listener-wrong-order", Byte(0x00) + Frame(proof) + Frame(hello));
  Write("control_handshake", "dialer-plain",
        Byte(0x01) + Frame(ack) + Frame(notify) + Frame(goodbye));
  Write("control_handshake", "dialer-secret", Byte(0x03) + Frame(ack_secret));
  Write("control_handshake", "dialer-reject", Byte(0x01) + Frame(reject));
  Write("control_handshake", "listener-salt", Byte(0x04) + Frame(hello));
}

void Tcp() {
  namespace wire = transport::tcp_wire;
  auto bytes = [](const std::byte* p, size_t n) {
    return std::string(reinterpret_cast<const char*>(p), n);
  };
  const std::string token(32, '\x5a');
  std::byte buf[wire::kRequestBytes];
  wire::Hello hello;
  hello.token_len = static_cast<uint32_t>(token.size());
  wire::EncodeHello(hello, buf);
  std::string target = Byte(0x00) + bytes(buf, wire::kHelloBytes) + token;
  // WRITE 100 bytes at 0, READ 64 at 4096, WRITE with follow=1 then a READ it announced.
  wire::RequestHeader w;
  w.kind = wire::kKindWrite;
  w.flags = wire::kFlagCountArrivals;
  w.sequence = 0;
  w.transfer_id = 5;
  w.region = 1;
  w.offset = 0;
  w.length = 100;
  wire::EncodeRequest(w, buf);
  target += bytes(buf, wire::kRequestBytes) + std::string(100, '\xab');
  wire::RequestHeader r = w;
  r.kind = wire::kKindRead;
  r.flags = 0;
  r.sequence = 1;
  r.offset = 4096;
  r.length = 64;
  wire::EncodeRequest(r, buf);
  target += bytes(buf, wire::kRequestBytes);
  wire::RequestHeader w2 = w;
  w2.sequence = 2;
  w2.length = 16;
  w2.follow = 1;
  wire::EncodeRequest(w2, buf);
  target += bytes(buf, wire::kRequestBytes) + std::string(16, '\xcd');
  r.sequence = 3;
  wire::EncodeRequest(r, buf);
  target += bytes(buf, wire::kRequestBytes);
  Write("tcp_wire", "target-ops", target);
  // READs of the grant-guarded region 3: inside grant 1 (served), then refused ones.
  std::string guarded = Byte(0x00);
  wire::EncodeHello(hello, buf);
  guarded += bytes(buf, wire::kHelloBytes) + token;
  wire::RequestHeader g = r;
  g.sequence = 0;
  g.region = 3;
  g.offset = 4096;
  g.length = 64;
  g.follow = 0;
  g.grant = 1;
  wire::EncodeRequest(g, buf);
  guarded += bytes(buf, wire::kRequestBytes);
  // A malformed header after the READs: the target refuses it, which first sends the READs'
  // queued responses (at the end of the stream alone it would drop them unsent).
  const std::string malformed(wire::kRequestBytes, '\0');
  Write("tcp_wire", "target-granted-read", guarded + malformed);
  std::string outside = guarded;  // then a READ under grant 1 outside its range
  g.sequence = 1;
  g.offset = 0;
  wire::EncodeRequest(g, buf);
  outside += bytes(buf, wire::kRequestBytes);
  Write("tcp_wire", "target-outside-grant-read", outside + malformed);
  g.offset = 4096;  // then a READ inside the range presenting no grant
  g.grant = 0;
  wire::EncodeRequest(g, buf);
  guarded += bytes(buf, wire::kRequestBytes);
  Write("tcp_wire", "target-ungranted-read", guarded);

  wire::HelloReply reply;
  reply.max_op_bytes = 1 << 20;
  wire::EncodeHelloReply(reply, buf);
  std::string initiator = Byte(0x01) + bytes(buf, wire::kHelloReplyBytes);
  // Every response of the initiator's 16-op READ: the request completes.
  for (uint64_t op = 0; op < 16; ++op) {
    wire::ResponseHeader h;
    h.kind = wire::kKindRead;
    h.sequence = op;
    h.payload_len = (op * 1031) % 4096;
    wire::EncodeResponse(h, buf);
    initiator += bytes(buf, wire::kResponseBytes) + std::string(h.payload_len, '\x42');
  }
  Write("tcp_wire", "initiator-reads", initiator);

  const std::string why = "remote region 9 is not exported to this peer";
  wire::ResponseHeader error;
  error.kind = wire::kKindRead;
  error.code = 5;
  error.message_len = static_cast<uint32_t>(why.size());
  wire::EncodeHelloReply(reply, buf);
  std::string refused = Byte(0x01) + bytes(buf, wire::kHelloReplyBytes);
  wire::EncodeResponse(error, buf);
  refused += bytes(buf, wire::kResponseBytes) + why;
  Write("tcp_wire", "initiator-error", refused);

  wire::HelloReply denied;
  denied.code = 16;
  denied.message_len = 13;
  wire::EncodeHelloReply(denied, buf);
  Write("tcp_wire", "initiator-denied",
        Byte(0x01) + bytes(buf, wire::kHelloReplyBytes) + "unknown token");
}

void Shm() {
  namespace shm = transport::shm;
  shm::FdRequest hello;
  hello.kind = shm::FdRequestKind::kHello;
  hello.token = std::string(32, '\x5a');
  Write("shm_fd_protocol", "hello", Byte(0x00) + shm::EncodeRequest(hello));
  shm::FdRequest fetch = hello;
  fetch.kind = shm::FdRequestKind::kFetch;
  fetch.region = 3;
  Write("shm_fd_protocol", "fetch", Byte(0x00) + shm::EncodeRequest(fetch));
  shm::FdRequest staging = hello;
  staging.kind = shm::FdRequestKind::kStaging;
  Write("shm_fd_protocol", "staging", Byte(0x00) + shm::EncodeRequest(staging));
  shm::FdRequest copy = hello;
  copy.kind = shm::FdRequestKind::kCopy;
  copy.region = 9;
  copy.copy_kind = OpKind::kRead;
  copy.grant = 0x1234abcd5678ef00;
  copy.slot = 1;
  copy.ops = {{3, 0, 4096}, {3, 65536, 16384}};
  Write("shm_fd_protocol", "copy", Byte(0x00) + shm::EncodeRequest(copy));
  shm::FdReply staged;
  staged.length = shm::kCopySlotBytes;
  staged.flags = shm::kCopySlots;
  Write("shm_fd_protocol", "reply-staging", Byte(0x01) + shm::EncodeReply(staged));
  shm::FdReply ok;
  ok.region = 3;
  ok.memfd_offset = 4096;
  ok.length = 1 << 20;
  ok.access = 3;
  Write("shm_fd_protocol", "reply-ok", Byte(0x01) + shm::EncodeReply(ok));
  shm::FdReply refused;
  refused.code = absl::StatusCode::kPermissionDenied;
  refused.message = "region 3 is not exported to this peer";
  Write("shm_fd_protocol", "reply-refused", Byte(0x01) + shm::EncodeReply(refused));

  shm::ShmEndpoint endpoint;
  endpoint.host_id = "host-1 (boot 5c1e)";
  endpoint.socket_name = "kvwire-4242-abc";
  endpoint.pid = 4242;
  endpoint.probe_address = 0x7ffd1234;
  endpoint.probe_value = 0x1234567890abcdef;
  Write("shm_endpoint", "endpoint", shm::EncodeEndpoint(endpoint));
  endpoint.host_id = "";
  endpoint.socket_name = "s%\n";
  Write("shm_endpoint", "escaped", shm::EncodeEndpoint(endpoint) + " future=1");

  shm::GpuRegionKey key;
  key.backend = gpu::Backend::kCuda;
  key.device = 0;
  key.pci_bus_id = shm::PackPciBusId("0000:3b:00.0");
  key.process_nonce = 0x1122334455667788;
  key.handle.backend = key.backend;
  for (size_t i = 0; i < key.handle.bytes.size(); ++i)
    key.handle.bytes[i] = static_cast<uint8_t>(i);
  key.offset = 1 << 20;
  key.allocation_size = 64 << 20;
  key.length = 8 << 20;
  Write("gpu_region_key", "cuda", shm::EncodeGpuRegionKey(key));
  key.backend = key.handle.backend = gpu::Backend::kEmulated;
  key.device = 1;
  key.pci_bus_id = shm::kUnknownPciBusId;
  Write("gpu_region_key", "emulated", shm::EncodeGpuRegionKey(key));
  Write("gpu_region_key", "pci-id", "0000:3b:00.0");
}

void Rdma() {
  pb::RdmaDevice roce;
  roce.set_name("rxe0");
  roce.set_port(1);
  roce.set_ethernet(true);
  roce.set_gid(std::string("\0\0\0\0\0\0\0\0\0\0\xff\xff\xc0\xa8\x01\x02", 16));
  roce.set_mtu(3);
  pb::RdmaDevice ib;
  ib.set_name("mlx5_0");
  ib.set_port(1);
  ib.set_gid(std::string("\xfe\x80\0\0\0\0\0\0\0\0\0\0\0\0\0\x09", 16));
  ib.set_lid(9);
  ib.set_mtu(5);
  pb::RdmaEndpoint endpoint;
  *endpoint.add_devices() = roce;
  *endpoint.add_devices() = ib;
  Write("rdma_connect", "endpoint", Byte(0x00) + endpoint.SerializeAsString());

  pb::RdmaConnectRequest request;
  request.set_channel_id(0x1234);
  request.set_call_id(1);
  for (uint32_t i = 0; i < 2; ++i) {
    pb::RdmaQpInfo* qp = request.add_qps();
    qp->set_index(i);
    qp->set_qpn(17 + i);
    qp->set_psn(0x123456);
    qp->set_max_rd_atomic(16);
    request.add_remote_device(i);
    *request.add_local_device() = i == 0 ? roce : ib;
  }
  Write("rdma_connect", "request", Byte(0x01) + request.SerializeAsString());

  pb::RdmaConnectReply reply;
  reply.set_call_id(1);
  for (uint32_t i = 0; i < 2; ++i) {
    pb::RdmaQpInfo* qp = reply.add_qps();
    qp->set_index(i);
    qp->set_qpn(33 + i);
    qp->set_psn(0x654321);
    qp->set_slot_table_addr(0x7f0000001000);
    qp->set_slot_table_rkey(0x4242);
    qp->set_max_rd_atomic(4);
  }
  Write("rdma_connect", "reply", Byte(0x02) + reply.SerializeAsString());
  pb::RdmaConnectReply refused;
  refused.set_code(9);
  refused.set_error("no local device 7");
  Write("rdma_connect", "reply-refused", Byte(0x02) + refused.SerializeAsString());
  std::string imms = Byte(0x03);
  for (uint32_t slot : {0u, 5u, transport::rdma::kSlotsPerQp - 1}) {
    const uint32_t imm = transport::rdma::EncodeImm(slot, 3);
    imms.append(reinterpret_cast<const char*>(&imm), 4);
  }
  Write("rdma_connect", "immediates", imms);
}

KvTransferParams ReadParams() {
  KvTransferParams p;
  p.engine_id = "prefill-0";
  p.host = "127.0.0.1";
  p.port = 40000;
  p.transfer_id = "prefill-0/req-1/1";
  p.mode = KvMode::kRead;
  p.num_tokens = 40;
  p.block_ids = {{"kv", {3, 7, 1}}};
  p.do_remote_prefill = true;
  return p;
}

void ConnectorSeeds() {
  KvTransferParams read = ReadParams();
  Write("kv_params", "read", read.ToJson());
  KvTransferParams tp = read;
  KvTransferParams rank1 = read;
  rank1.host = "10.0.0.2";
  rank1.transfer_id = "prefill-1/req-1/1";
  tp.AddTpSource(rank1);
  Write("kv_params", "tp-sources", tp.ToJson());
  Write("kv_params", "remote-decode", R"({"do_remote_decode":true,"mode":"write"})");
  Write("kv_params", "write",
        R"({"do_remote_prefill":true,"mode":"write","remote_host":"127.0.0.1",)"
        R"("remote_port":40000,"transfer_id":"t-1","num_tokens":16})");
  // vLLM's P/D connectors' names (NIXL, MoRIIO), as their proxies pass them on.
  Write("kv_params", "vllm-proxy-nulls",
        R"({"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remo)"
        R"(te_block_ids":null,"remote_host":null,"remote_port":null,"remote_request_id":nul)"
        R"(l,"tp_size":null})");
  Write("kv_params", "nixl-per-group",
        R"({"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[3,7,1],[)"
        R"(0,0,9]],"remote_engine_id":"prefill-0","remote_request_id":"cmpl-1234-0","remote)"
        R"(_host":"10.0.0.1","remote_port":5600,"tp_size":2,"extra_field":{"x":[1,null]}})");
  Write("kv_params", "vllm-flat-tp-sources",
        R"({"do_remote_prefill":true,"remote_block_ids":[4,5,6],"remote_engine_id":"p","tra)"
        R"(nsfer_id":"t-9","remote_host":"h","remote_port":1,"mode":"read","num_tokens":33,)"
        R"("tp_sources":[{"remote_engine_id":"p1","remote_host":"h1","remote_port":2,"trans)"
        R"(fer_id":"t-9","remote_block_ids":[4,5,6]}]})");
  Write("kv_params", "moriio-write",
        R"({"do_remote_prefill":true,"remote_block_ids":{"swa_kv":[1,2],"c4a_kv":[3]},"remo)"
        R"(te_host":"h","remote_port":9,"transfer_id":"moriio-tx","mode":"write","remote_ha)"
        R"(ndshake_port":6301,"remote_notify_port":61005})");

  for (const char* preset : {"mha", "deepseek-v3", "deepseek-v4-flash"}) {
    absl::StatusOr<Layout> layout = PresetLayout(preset);
    if (!layout.ok()) continue;
    AssignBacking(&*layout, 0x7f0000000000, 4, 2);
    Write("layout_json", preset, LayoutToJson(*layout));
  }
  MhaOptions tp2;
  tp2.layers = 2;
  tp2.tp_size = 2;
  tp2.tp_rank = 1;
  Layout mha = MhaLayout(tp2);
  AssignBacking(&mha, 0x10000, 8);
  Write("layout_json", "mha-tp", LayoutToJson(mha));

  // Connector metadata as BuildConnectorMeta writes it.
  const std::string params = read.ToJson();
  Write("connector_meta", "load",
        absl::StrCat(R"({"loads":[{"request_id":"req-1","num_cached":0,"params":)", params,
                     R"(,"blocks":{"kv":[0,1,2]}}],"saves":[{"request_id":"req-2"}]})"));
  Write("connector_meta", "empty", R"({"loads":[],"saves":[]})");

  // Peer messages, separated by 0x1e; "$TID" is the held request's transfer id.
  MhaOptions fixture;
  fixture.layers = 2;
  fixture.kv_heads = 1;
  fixture.head_dim = 8;
  fixture.tokens_per_block = 16;
  Layout peer = MhaLayout(fixture);
  peer.model = "fuzz-mha";
  AssignBacking(&peer, 0x20000000, 16);
  const std::string hello = absl::StrCat(R"({"t":"hello","engine_id":"attacker","mode":"auto",)",
                                         R"("layout":)", LayoutToJson(peer), R"(,"regions":[]})");
  const std::string rs = "\x1e";
  Write("connector_peer_messages", "hello", hello);
  Write("connector_peer_messages", "read",
        absl::StrCat(hello, rs, R"({"t":"read_start","transfer_id":"$TID"})", rs,
                     R"({"t":"release","transfer_id":"$TID","ok":true})"));
  Write("connector_peer_messages", "release-count",
        absl::StrCat(
            hello, rs, R"({"t":"read_start","transfer_id":"$TID"})", rs,
            R"({"t":"release","transfer_id":"$TID","ok":true,"read_bytes":4096})", rs,
            R"({"t":"release","transfer_id":"$TID","ok":true,"read_bytes":1125899906842625})"));
  Write("connector_peer_messages", "release-failed",
        absl::StrCat(R"({"t":"release","transfer_id":"$TID","ok":false,"reason":"read failed"})"));
  Write("connector_peer_messages", "write-mode",
        absl::StrCat(hello, rs,
                     R"({"t":"write_req","transfer_id":"$TID","blocks":{"kv":[4,5]},)"
                     R"("num_cached":0})",
                     rs, R"({"t":"layer","transfer_id":"$TID","layer":0})", rs,
                     R"({"t":"done","transfer_id":"$TID"})", rs,
                     R"({"t":"fail","transfer_id":"$TID","reason":"aborted"})"));
  Write("connector_peer_messages", "hello-ack",
        absl::StrCat(R"({"t":"hello_ack","engine_id":"attacker","mode":"read","layout":)",
                     LayoutToJson(peer), R"(,"regions":[[536870912,4096,7]]})", rs,
                     R"({"t":"hello_err","error":"no"})"));
}

void Dsv4() {
  std::ifstream tiny(std::filesystem::path(KVWIRE_SOURCE_DIR) / "examples/dsv4/configs/tiny.json");
  const std::string config((std::istreambuf_iterator<char>(tiny)),
                           std::istreambuf_iterator<char>());
  Write("model_config", "tiny", config);
  std::ifstream small(std::filesystem::path(KVWIRE_SOURCE_DIR) /
                      "examples/dsv4/configs/small.json");
  Write("model_config", "small",
        std::string((std::istreambuf_iterator<char>(small)), std::istreambuf_iterator<char>()));

  const std::vector<uint8_t> f32(4 * 6, 0x3f);
  const std::vector<uint8_t> bf16(2 * 4, 0x40);
  absl::StatusOr<std::vector<uint8_t>> file =
      dsv4::SerializeSafetensors({{"embed.weight", "F32", {2, 3}, f32},
                                  {"norm.weight", "BF16", {4}, bf16},
                                  {"empty", "I32", {0, 5}, {}}},
                                 {{"format", "pt"}});
  Write("safetensors", "small", std::string(file->begin(), file->end()));

  Write("completion_request", "plain",
        R"({"prompt":"Hello","max_tokens":8,"temperature":0.7,"seed":1,"stream":false,)"
        R"("model":"dsv4-tiny"})");
  Write("completion_request", "stream", R"({"prompt":["a b c"],"max_tokens":2,"stream":true})");
  Write("completion_request", "remote-prefill",
        absl::StrCat(R"({"prompt":"Hello","max_tokens":4,"kv_transfer_params":)",
                     ReadParams().ToJson(), R"(,"kvwire_prefill":{"ttft_ms":3.5}})"));
  Write("completion_request", "remote-decode",
        R"({"prompt":"Hello","kv_transfer_params":{"do_remote_decode":true,"mode":"read"}})");
  // vLLM's proxy: prefill's fields as nulls, the rest of the request as the client sent it.
  Write(
      "completion_request", "vllm-proxy-prefill",
      R"({"prompt":"Hello","max_tokens":1,"stream":false,"min_tokens":null,)"
      R"("kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,)"
      R"("remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}})");
  Write("completion_request", "token-ids", R"({"prompt":[[256,72,105]],"max_tokens":3})");
  Write("completion_request", "stop-usage",
        R"({"prompt":"a","stop":["\n\n","END"],"stream":true,)"
        R"("stream_options":{"include_usage":true},"n":1,"top_p":1,"user":"u"})");
  Write(
      "completion_request", "chat",
      R"({"messages":[{"role":"system","content":"Be terse."},{"role":"user","content":)"
      R"([{"type":"text","text":"Hi"}]}],"max_completion_tokens":4,"stop":"x","model":"dsv4-tiny"})");
  Write("completion_request", "unsupported", R"({"prompt":"a","n":2,"logit_bias":{"1":2}})");
  // vLLM's sampling parameters, each set.
  Write(
      "completion_request", "sampling",
      R"({"prompt":"a","max_tokens":8,"temperature":0.9,"top_p":0.95,"top_k":50,"min_p":0.01,)"
      R"("seed":-7,"presence_penalty":0.5,"frequency_penalty":-0.5,"repetition_penalty":1.2,)"
      R"("ignore_eos":true,"min_tokens":4,"logprobs":5,"n":3,"return_tokens_as_token_ids":true})");
  Write("completion_request", "chat-logprobs",
        R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":-1,)"
        R"("max_tokens":2,"max_completion_tokens":3})");
}

void Perf() {
  // The initiator's lines (perf/session.h), byte 0 = options (bit 0 pool, bits 1-2 threads-1).
  Write("perf_side_channel", "run",
        Byte(0x00) +
            "HELLO kvwire-perf/1 op=write size=4096 threads=1\nRUN 4096 10\nDONE 4096 10\n"
            "RUN 65536 0\nDONE 65536 3\nBYE\n");
  Write("perf_side_channel", "pool", Byte(0x03) + "RUN 1024 0\nDONE 1024 5,5\nBYE\n");
  // Hundreds of refused lines, each answered with an ERROR line: the answers outgrow the
  // socket buffer (stop 34's fuzz-ci timeout, when nothing read them).
  std::string refused = Byte(0x00);
  for (int i = 0; i < 2000; ++i) refused += "x\n";
  Write("perf_side_channel", "many-refusals", refused + "BYE\n");
}

}  // namespace
}  // namespace kvwire

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  kvwire::g_root = argv[1];
  kvwire::Control();
  kvwire::Tcp();
  kvwire::Shm();
  kvwire::Rdma();
  kvwire::ConnectorSeeds();
  kvwire::Dsv4();
  kvwire::Perf();
  std::printf("wrote %d seeds under %s\n", kvwire::g_written, argv[1]);
  return 0;
}
