/* The C API's engine surface and the connector options added beside it, called from C (this
 * file is compiled as C): every function, its error paths (NULL handles and pointers, bad
 * options, wrong lengths, out-of-range values) and one real transfer between two engines over
 * tcp through the C API only. Exits non-zero with the failed check's line on failure. */
#define _GNU_SOURCE
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvwire/kvwire.h"

static int failures = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                              \
    }                                                                          \
  } while (0)

/* `code` must be the non-zero `want` (0: any non-zero) and the message must contain `part`. */
static void ExpectError(int line, int code, int want, char** err, const char* part) {
  int ok = code != 0 && (want == 0 || code == want) && *err != NULL && strstr(*err, part) != NULL;
  if (!ok) {
    fprintf(stderr, "%s:%d: expected error %d containing \"%s\", got %d: %s\n", __FILE__, line,
            want, part, code, *err != NULL ? *err : "(no message)");
    ++failures;
  }
  kvw_free(*err);
  *err = NULL;
}
#define EXPECT_ERROR(call, want, part) ExpectError(__LINE__, (call), (want), &err, (part))

static void ExpectOk(int line, int code, char** err) {
  if (code != 0) {
    fprintf(stderr, "%s:%d: expected success, got %d: %s\n", __FILE__, line, code,
            *err != NULL ? *err : "(no message)");
    ++failures;
  }
  kvw_free(*err);
  *err = NULL;
}
#define EXPECT_OK(call) ExpectOk(__LINE__, (call), &err)

/* A NULL result must come with a message containing `part`. */
#define EXPECT_NULL_ERROR(expr, part)                              \
  do {                                                             \
    const void* made_ = (const void*)(expr);                       \
    CHECK(made_ == NULL);                                          \
    ExpectError(__LINE__, made_ == NULL ? 3 : 0, 0, &err, (part)); \
  } while (0)

typedef int (*IntSetter)(kvw_engine_options_t*, int64_t, char**);
typedef struct {
  const char* name;
  IntSetter set;
  int64_t lo, hi;
} RangeCase;

/* A value one past an end of an option's range: refused, with the option's name and "is out of
 * range" in the message, by the setter when the field's type cannot hold it, else by
 * kvw_engine_create (Engine::Create's one validator; tests/support/bad_engine_options.tsv holds
 * the exact messages, shared with C++ and Python). */
static void ExpectRefused(int line, const RangeCase* c, int64_t v) {
  char* err = NULL;
  char want[256];
  kvw_engine_options_t* o = kvw_engine_options_create();
  int code = c->set(o, v, &err);
  if (code == 0) {
    kvw_engine_t* e = kvw_engine_create(o, &err);
    code = e == NULL ? 3 : 0;
    kvw_engine_destroy(e);
  }
  snprintf(want, sizeof(want), "%s: ", c->name);
  int ok = code == 3 && err != NULL && strstr(err, want) != NULL &&
           strstr(err, " is out of range (") != NULL;
  if (!ok) {
    fprintf(stderr, "%s:%d: %s = %lld: expected out of range, got %d: %s\n", __FILE__, line,
            c->name, (long long)v, code, err != NULL ? err : "(no message)");
    ++failures;
  }
  kvw_free(err);
  kvw_engine_options_destroy(o);
}

/* Every numeric engine option and its setter, with the ends of its range. */
static const RangeCase kCases[] = {
    {"max_op_bytes", kvw_engine_options_set_max_op_bytes, 1, 64 << 20},
    {"stripe_min_bytes", kvw_engine_options_set_stripe_min_bytes, 0, (int64_t)1 << 40},
    {"max_frame_bytes", kvw_engine_options_set_max_frame_bytes, 4096, (int64_t)1 << 30},
    {"heartbeat_interval", kvw_engine_options_set_heartbeat_interval, 1, 3600000},
    {"peer_lease", kvw_engine_options_set_peer_lease, 1, 86400000},
    {"connect_timeout", kvw_engine_options_set_connect_timeout, 1, 3600000},
    {"transfer_timeout", kvw_engine_options_set_transfer_timeout, 1, 86400000},
    {"io_threads", kvw_engine_options_set_io_threads, 1, 64},
    {"max_message_bytes", kvw_engine_options_set_max_message_bytes, 1, (int64_t)1 << 30},
    {"verify_checksums", kvw_engine_options_set_verify_checksums, 0, 1},
    {"max_pending_handshakes", kvw_engine_options_set_max_pending_handshakes, 1, 1 << 16},
    {"max_pending_handshakes_per_source", kvw_engine_options_set_max_pending_handshakes_per_source,
     1, 1 << 16},
    {"max_control_connections", kvw_engine_options_set_max_control_connections, 1, 1 << 20},
    {"max_control_send_queue_bytes", kvw_engine_options_set_max_control_send_queue_bytes, 4096,
     (int64_t)1 << 40},
    {"max_undrained_notifications", kvw_engine_options_set_max_undrained_notifications, 1,
     (int64_t)1 << 32},
    {"closed_peers_kept", kvw_engine_options_set_closed_peers_kept, 0, 1 << 16},
};

/* Every numeric engine option: the setter takes its ends, one past either end is refused with
 * the option's name and range in the message, and a NULL options is refused. */
static void TestEngineOptionRanges(void) {
  char* err = NULL;
  for (size_t i = 0; i < sizeof(kCases) / sizeof(kCases[0]); ++i) {
    const RangeCase* c = &kCases[i];
    kvw_engine_options_t* o = kvw_engine_options_create();
    CHECK(o != NULL);
    EXPECT_OK(c->set(o, c->lo, &err));
    EXPECT_OK(c->set(o, c->hi, &err));
    ExpectRefused(__LINE__, c, c->lo - 1);
    ExpectRefused(__LINE__, c, c->hi + 1);
    ExpectRefused(__LINE__, c, INT64_MIN);
    EXPECT_ERROR(c->set(NULL, c->lo, &err), 3, "options is NULL");
    /* errptr NULL: the code still comes back. */
    CHECK(c->set(NULL, c->hi, NULL) == 3);
    kvw_engine_options_destroy(o);
  }
}

static void TestEngineOptionsOther(void) {
  char* err = NULL;
  kvw_engine_options_t* o = kvw_engine_options_create();
  EXPECT_OK(kvw_engine_options_set_name(o, "c-opts", &err));
  EXPECT_ERROR(kvw_engine_options_set_name(o, NULL, &err), 3, "name is NULL");
  EXPECT_ERROR(kvw_engine_options_set_name(NULL, "x", &err), 3, "options is NULL");
  EXPECT_OK(kvw_engine_options_set_listen_address(o, "127.0.0.1:0", &err));
  EXPECT_ERROR(kvw_engine_options_set_listen_address(o, NULL, &err), 3, "address is NULL");
  EXPECT_OK(kvw_engine_options_set_transport(o, "tcp", &err));
  EXPECT_ERROR(kvw_engine_options_set_transport(o, NULL, &err), 3, "transport is NULL");
  EXPECT_OK(kvw_engine_options_set_secret(o, "s\0cret", 6, &err));
  EXPECT_OK(kvw_engine_options_set_secret(o, NULL, 0, &err));
  EXPECT_ERROR(kvw_engine_options_set_secret(o, NULL, 5, &err), 3, "secret is NULL but count is 5");
  EXPECT_ERROR(kvw_engine_options_set_secret(o, "x", (size_t)1 << 20, &err), 3, "over the");
  /* Each transport's options, by name: the transport's own setter parses, create checks. */
  EXPECT_OK(kvw_engine_options_set_transport_option(o, "rdma", "devices", "mlx5_0,mlx5_1:1", &err));
  EXPECT_OK(kvw_engine_options_set_transport_option(o, "tcp", "io_poll", "50us", &err));
  EXPECT_OK(kvw_engine_options_set_transport_option(o, "tcp", "io_threads", "2", &err));
  EXPECT_ERROR(kvw_engine_options_set_transport_option(o, "tcp", "io_poll", "fast", &err), 3,
               "tcp.io_poll: \"fast\" is not a duration");
  EXPECT_ERROR(kvw_engine_options_set_transport_option(o, "tcp", "speed", "1", &err), 3,
               "unknown option \"speed\" of transport tcp (connections, io_threads, io_poll,");
  EXPECT_ERROR(kvw_engine_options_set_transport_option(o, "pigeon", "speed", "1", &err), 3,
               "unknown transport \"pigeon\" (options exist for rdma, shm, tcp)");
  EXPECT_ERROR(kvw_engine_options_set_transport_option(o, "rdma", "devices", NULL, &err), 3,
               "value is NULL");
  EXPECT_ERROR(kvw_engine_options_set_transport_option(NULL, "tcp", "io_poll", "1us", &err), 3,
               "options is NULL");
  EXPECT_OK(kvw_engine_options_set_compat_salt(o, UINT64_MAX, &err));
  EXPECT_ERROR(kvw_engine_options_set_compat_salt(NULL, 1, &err), 3, "options is NULL");
  EXPECT_ERROR(kvw_engine_options_from_environment(NULL, &err), 3, "options is NULL");
  kvw_engine_options_destroy(o);
  kvw_engine_options_destroy(NULL); /* like free(NULL) */

  /* Options each setter accepts but that contradict each other: refused by create. */
  o = kvw_engine_options_create();
  EXPECT_OK(kvw_engine_options_set_max_frame_bytes(o, 65536, &err));
  EXPECT_OK(kvw_engine_options_set_max_message_bytes(o, 65536, &err));
  EXPECT_NULL_ERROR(kvw_engine_create(o, &err), "must stay below max_frame_bytes");
  EXPECT_OK(kvw_engine_options_set_max_message_bytes(o, 1024, &err));
  EXPECT_OK(kvw_engine_options_set_max_control_send_queue_bytes(o, 65536, &err));
  EXPECT_NULL_ERROR(kvw_engine_create(o, &err), "at least max_frame_bytes + 4");
  EXPECT_OK(kvw_engine_options_set_max_control_send_queue_bytes(o, 1 << 20, &err));
  EXPECT_OK(kvw_engine_options_set_transport_option(o, "shm", "cma", "1", &err));
  EXPECT_OK(kvw_engine_options_set_transport_option(o, "shm", "deny_ptrace", "true", &err));
  EXPECT_NULL_ERROR(kvw_engine_create(o, &err), "cannot be combined");
  {
    /* The connector's engine is held to the same rules. */
    kvw_options_t* co = kvw_options_create();
    EXPECT_OK(kvw_options_set_engine_options(co, o, &err));
    EXPECT_NULL_ERROR(kvw_connector_create(co, &err), "cannot be combined");
    kvw_options_destroy(co);
  }
  kvw_engine_options_destroy(o);

  /* A forced transport is any name, checked by create against the transports with options. */
  o = kvw_engine_options_create();
  EXPECT_OK(kvw_engine_options_set_transport(o, "carrier-pigeon", &err));
  EXPECT_NULL_ERROR(kvw_engine_create(o, &err),
                    "transport: unknown transport \"carrier-pigeon\" (expected auto, rdma, shm, "
                    "tcp)");
  kvw_engine_options_destroy(o);

  /* The environment: a variable replaces what was set before from_environment; a setter after
   * it wins; a bad value is refused, naming the variable, and changes nothing. Seen through
   * the engine: not listening vs listening. */
  o = kvw_engine_options_create();
  EXPECT_OK(kvw_engine_options_set_listen_address(o, "", &err));
  setenv("KVWIRE_LISTEN", "127.0.0.1:0", 1);
  setenv("KVWIRE_TCP_CONNECTIONS", "0", 1);
  EXPECT_ERROR(kvw_engine_options_from_environment(o, &err), 3,
               "KVWIRE_TCP_CONNECTIONS=0: tcp.connections: 0 is out of range (1..64)");
  unsetenv("KVWIRE_TCP_CONNECTIONS");
  {
    kvw_options_t* co = kvw_options_create();
    setenv("KVWIRE_TCP_IO_POLL", "fast", 1);
    EXPECT_ERROR(kvw_options_from_environment(co, &err), 3, "KVWIRE_TCP_IO_POLL=fast: tcp.io_poll");
    unsetenv("KVWIRE_TCP_IO_POLL");
    EXPECT_OK(kvw_options_set_transport_option(co, "tcp", "connections", "65", &err));
    EXPECT_NULL_ERROR(kvw_connector_create(co, &err),
                      "tcp.connections: 65 is out of range (1..64)");
    kvw_options_destroy(co);
  }
  EXPECT_OK(kvw_engine_options_from_environment(o, &err));
  kvw_engine_t* e = kvw_engine_create(o, &err);
  CHECK(e != NULL);
  char* address = kvw_engine_address(e);
  CHECK(address != NULL && strncmp(address, "127.0.0.1:", 10) == 0);
  kvw_free(address);
  kvw_engine_destroy(e);
  EXPECT_OK(kvw_engine_options_set_listen_address(o, "", &err));
  e = kvw_engine_create(o, &err);
  CHECK(e != NULL);
  address = kvw_engine_address(e);
  CHECK(address != NULL && address[0] == '\0');
  kvw_free(address);
  kvw_engine_destroy(e);
  unsetenv("KVWIRE_LISTEN");
  kvw_engine_options_destroy(o);
}

static void TestRegionAndOtherOptions(void) {
  char* err = NULL;
  kvw_region_options_t* r = kvw_region_options_create();
  EXPECT_OK(kvw_region_options_set_access(r, KVW_ACCESS_REMOTE_READ, &err));
  EXPECT_ERROR(kvw_region_options_set_access(r, 4, &err), 3, "4 is out of range (0..3)");
  EXPECT_ERROR(kvw_region_options_set_access(r, -1, &err), 3, "out of range");
  EXPECT_OK(kvw_region_options_set_kind(r, KVW_MEMORY_HOST, &err));
  EXPECT_ERROR(kvw_region_options_set_kind(r, 2, &err), 3, "kind: 2 is out of range (0..1)");
  EXPECT_OK(kvw_region_options_set_gpu_device(r, -1, &err));
  EXPECT_ERROR(kvw_region_options_set_gpu_device(r, -2, &err), 3, "out of range (-1..1023)");
  EXPECT_OK(kvw_region_options_set_export_to_all_peers(r, 1, &err));
  EXPECT_ERROR(kvw_region_options_set_export_to_all_peers(r, 2, &err), 3, "out of range (0..1)");
  EXPECT_ERROR(kvw_region_options_set_access(NULL, 1, &err), 3, "options is NULL");
  EXPECT_ERROR(kvw_region_options_set_kind(NULL, 0, &err), 3, "options is NULL");
  EXPECT_ERROR(kvw_region_options_set_gpu_device(NULL, 0, &err), 3, "options is NULL");
  EXPECT_ERROR(kvw_region_options_set_export_to_all_peers(NULL, 0, &err), 3, "options is NULL");
  kvw_region_options_destroy(r);

  kvw_connect_options_t* c = kvw_connect_options_create();
  uint64_t ids[2] = {1, 2};
  EXPECT_OK(kvw_connect_options_set_exports(c, ids, 2, &err));
  EXPECT_OK(kvw_connect_options_set_exports(c, NULL, 0, &err));
  EXPECT_ERROR(kvw_connect_options_set_exports(c, NULL, 2, &err), 3, "regions is NULL");
  EXPECT_ERROR(kvw_connect_options_set_exports(c, ids, (size_t)1 << 21, &err), 3, "out of range");
  EXPECT_ERROR(kvw_connect_options_set_exports(NULL, ids, 1, &err), 3, "options is NULL");
  EXPECT_OK(kvw_connect_options_set_transport(c, "shm", &err));
  /* Any name: kvw_engine_connect fails for one no transport of the engine has. */
  EXPECT_OK(kvw_connect_options_set_transport(c, "udp", &err));
  EXPECT_ERROR(kvw_connect_options_set_transport(NULL, "tcp", &err), 3, "options is NULL");
  kvw_connect_options_destroy(c);

  kvw_transfer_options_t* t = kvw_transfer_options_create();
  EXPECT_OK(kvw_transfer_options_set_notification(t, "n", 1, &err));
  EXPECT_OK(kvw_transfer_options_set_notification(t, NULL, 0, &err));
  EXPECT_ERROR(kvw_transfer_options_set_notification(t, NULL, 3, &err), 3, "data is NULL");
  EXPECT_ERROR(kvw_transfer_options_set_notification(NULL, "n", 1, &err), 3, "options is NULL");
  EXPECT_OK(kvw_transfer_options_set_timeout(t, 1000, &err));
  EXPECT_ERROR(kvw_transfer_options_set_timeout(t, 0, &err), 3, "0 is out of range");
  EXPECT_ERROR(kvw_transfer_options_set_timeout(NULL, 1, &err), 3, "options is NULL");
  kvw_transfer_options_destroy(t);
}

static kvw_engine_t* MakeTcpEngine(const char* name) {
  char* err = NULL;
  kvw_engine_options_t* o = kvw_engine_options_create();
  EXPECT_OK(kvw_engine_options_set_name(o, name, &err));
  EXPECT_OK(kvw_engine_options_set_transport(o, "tcp", &err));
  EXPECT_OK(kvw_engine_options_set_transport_option(o, "tcp", "connections", "2", &err));
  EXPECT_OK(kvw_engine_options_set_transfer_timeout(o, 20000, &err));
  kvw_engine_t* e = kvw_engine_create(o, &err);
  if (e == NULL) {
    fprintf(stderr, "engine %s: %s\n", name, err != NULL ? err : "?");
    exit(1);
  }
  kvw_engine_options_destroy(o);
  return e;
}

static int64_t NowMs(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void SleepMs(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

enum { kBytes = 1 << 20 };

/* Two engines over tcp, driven only through the C API: export, WRITE with a notification,
 * READ back polled to its end, messages and inbox events, unexport, disconnect. */
static void TestTransferOverTcp(void) {
  char* err = NULL;
  kvw_engine_t* a = MakeTcpEngine("c-api-a");
  kvw_engine_t* b = MakeTcpEngine("c-api-b");
  CHECK(strcmp(kvw_engine_name(a), "c-api-a") == 0);
  CHECK(kvw_engine_name(NULL) == NULL);
  CHECK(kvw_engine_address(NULL) == NULL);

  unsigned char* src = malloc(kBytes);
  unsigned char* back = malloc(kBytes);
  unsigned char* target = malloc(kBytes);
  for (size_t i = 0; i < kBytes; ++i) src[i] = (unsigned char)(i * 131 + 7);
  memset(back, 0, kBytes);
  memset(target, 0, kBytes);

  uint64_t ra_src = 0, ra_back = 0, rb = 0;
  EXPECT_OK(kvw_engine_register_memory(a, src, kBytes, NULL, &ra_src, &err));
  EXPECT_OK(kvw_engine_register_memory(a, back, kBytes, NULL, &ra_back, &err));
  kvw_region_options_t* ro = kvw_region_options_create();
  EXPECT_OK(kvw_region_options_set_access(ro, KVW_ACCESS_REMOTE_READ_WRITE, &err));
  EXPECT_OK(kvw_engine_register_memory(b, target, kBytes, ro, &rb, &err));
  kvw_region_options_destroy(ro);
  EXPECT_ERROR(kvw_engine_register_memory(a, NULL, 16, NULL, &ra_src, &err), 3, "ptr is NULL");
  EXPECT_ERROR(kvw_engine_register_memory(a, src, 0, NULL, &ra_src, &err), 3, "length is 0");
  EXPECT_ERROR(kvw_engine_register_memory(a, src, 16, NULL, NULL, &err), 3, "region is NULL");
  EXPECT_ERROR(kvw_engine_register_memory(NULL, src, 16, NULL, &ra_src, &err), 3, "engine is NULL");
  EXPECT_ERROR(kvw_engine_deregister_memory(a, 987654, &err), 0, "");
  EXPECT_ERROR(kvw_engine_deregister_memory(NULL, 1, &err), 3, "engine is NULL");

  kvw_inbox_t* inbox = kvw_engine_open_inbox(b, "c-topic", 0, 1, &err);
  CHECK(inbox != NULL);
  CHECK(inbox != NULL && strcmp(kvw_inbox_topic(inbox), "c-topic") == 0);
  EXPECT_NULL_ERROR(kvw_engine_open_inbox(b, "c-topic", 0, 1, &err), "");
  EXPECT_NULL_ERROR(kvw_engine_open_inbox(NULL, "x", 0, 1, &err), "engine is NULL");
  EXPECT_NULL_ERROR(kvw_engine_open_inbox(b, NULL, 0, 1, &err), "topic is NULL");

  /* Connect a -> b over tcp (forced per peer too), exporting nothing of a's. */
  char* b_address = kvw_engine_address(b);
  kvw_connect_options_t* co = kvw_connect_options_create();
  EXPECT_OK(kvw_connect_options_set_transport(co, "tcp", &err));
  uint64_t peer_b = 0, peer_a = 0, found = 0;
  EXPECT_OK(kvw_engine_connect(a, b_address, co, &peer_b, &err));
  kvw_connect_options_destroy(co);
  EXPECT_ERROR(kvw_engine_connect(a, NULL, NULL, &peer_b, &err), 3, "address is NULL");
  EXPECT_ERROR(kvw_engine_connect(a, b_address, NULL, NULL, &err), 3, "peer is NULL");
  EXPECT_ERROR(kvw_engine_connect(NULL, b_address, NULL, &peer_b, &err), 3, "engine is NULL");
  kvw_free(b_address);
  EXPECT_OK(kvw_engine_wait_for_peer(b, "c-api-a", 10000, &peer_a, &err));
  EXPECT_ERROR(kvw_engine_wait_for_peer(b, "c-api-a", -1, &peer_a, &err), 3, "out of range");
  EXPECT_ERROR(kvw_engine_wait_for_peer(b, "nobody", 0, &peer_a, &err), 0, "");
  EXPECT_OK(kvw_engine_find_peer(a, "c-api-b", &found, &err));
  CHECK(found == peer_b);
  EXPECT_ERROR(kvw_engine_find_peer(a, "nobody", &found, &err), 5, "");
  EXPECT_ERROR(kvw_engine_find_peer(a, NULL, &found, &err), 3, "name is NULL");

  /* b exports its region to a; a sees it. */
  EXPECT_OK(kvw_engine_export(b, peer_a, &rb, 1, &err));
  EXPECT_ERROR(kvw_engine_export(b, peer_a, NULL, 1, &err), 3, "regions is NULL");
  EXPECT_ERROR(kvw_engine_export(b, 999999, &rb, 1, &err), 0, "");
  EXPECT_OK(kvw_engine_wait_for_remote_region(a, peer_b, rb, 10000, &err));
  EXPECT_ERROR(kvw_engine_wait_for_remote_region(a, peer_b, rb, INT64_MAX, &err), 3,
               "out of range");
  uint64_t ids[4] = {0}, lengths[4] = {0};
  uint32_t access[4] = {0};
  int kinds[4] = {-1, -1, -1, -1};
  size_t count = 0;
  EXPECT_OK(kvw_engine_remote_regions(a, peer_b, ids, lengths, access, kinds, 4, &count, &err));
  CHECK(count == 1 && ids[0] == rb && lengths[0] == kBytes &&
        access[0] == KVW_ACCESS_REMOTE_READ_WRITE && kinds[0] == KVW_MEMORY_HOST);
  count = 0;
  EXPECT_OK(kvw_engine_remote_regions(a, peer_b, NULL, NULL, NULL, NULL, 0, &count, &err));
  CHECK(count == 1);
  EXPECT_ERROR(kvw_engine_remote_regions(a, peer_b, ids, NULL, NULL, NULL, 4, NULL, &err), 3,
               "count is NULL");
  EXPECT_ERROR(kvw_engine_remote_regions(a, 424242, ids, NULL, NULL, NULL, 4, &count, &err), 0, "");

  /* WRITE src -> b with a notification, in two ops. */
  kvw_op_t ops[2] = {{ra_src, 0, rb, 0, kBytes / 2},
                     {ra_src, kBytes / 2, rb, kBytes / 2, kBytes / 2}};
  kvw_transfer_options_t* to = kvw_transfer_options_create();
  EXPECT_OK(kvw_transfer_options_set_notification(to, "w\0ne", 4, &err));
  EXPECT_OK(kvw_transfer_options_set_timeout(to, 20000, &err));
  uint64_t id = 0;
  EXPECT_OK(kvw_engine_transfer(a, peer_b, KVW_OP_WRITE, ops, 2, to, &id, &err));
  kvw_transfer_options_destroy(to);
  EXPECT_OK(kvw_engine_wait(a, id, 20000, &err));
  CHECK(memcmp(src, target, kBytes) == 0);
  kvw_notifications_t* n = kvw_engine_wait_notification(b, 10000, &err);
  CHECK(n != NULL && kvw_notifications_count(n) == 1);
  size_t plen = 0;
  const char* payload = kvw_notifications_payload(n, 0, &plen);
  CHECK(payload != NULL && plen == 4 && memcmp(payload, "w\0ne", 4) == 0);
  CHECK(kvw_notifications_peer(n, 0) == peer_a);
  CHECK(strcmp(kvw_notifications_peer_name(n, 0), "c-api-a") == 0);
  CHECK(kvw_notifications_transfer_id(n, 0) == id);
  CHECK(kvw_notifications_payload(n, 1, &plen) == NULL && plen == 0);
  CHECK(kvw_notifications_peer(n, 1) == 0 && kvw_notifications_peer_name(n, 1) == NULL);
  CHECK(kvw_notifications_transfer_id(n, 7) == 0);
  kvw_notifications_destroy(n);
  CHECK(kvw_notifications_count(NULL) == 0);
  kvw_free(err);
  err = NULL;
  EXPECT_NULL_ERROR(kvw_engine_wait_notification(b, 0, &err), "");
  EXPECT_NULL_ERROR(kvw_engine_wait_notification(b, -5, &err), "out of range");
  n = kvw_engine_take_notifications(b, &err);
  CHECK(n != NULL && kvw_notifications_count(n) == 0);
  kvw_notifications_destroy(n);
  EXPECT_NULL_ERROR(kvw_engine_take_notifications(NULL, &err), "engine is NULL");

  /* READ it back into `back`, polled to its end with a deadline. */
  kvw_op_t read_op = {ra_back, 0, rb, 0, kBytes};
  EXPECT_OK(kvw_engine_transfer(a, peer_b, KVW_OP_READ, &read_op, 1, NULL, &id, &err));
  int state = KVW_TRANSFER_PENDING;
  const int64_t deadline = NowMs() + 20000;
  while (state == KVW_TRANSFER_PENDING && NowMs() < deadline) {
    EXPECT_OK(kvw_engine_poll(a, id, &state, &err));
    if (state == KVW_TRANSFER_PENDING) {
      struct timespec ms = {0, 1000000};
      nanosleep(&ms, NULL);
    }
  }
  CHECK(state == KVW_TRANSFER_SUCCEEDED);
  CHECK(memcmp(src, back, kBytes) == 0);
  EXPECT_ERROR(kvw_engine_poll(a, id, NULL, &err), 3, "state is NULL");

  /* Transfer errors: bad kind, no ops, too many, NULL ops, out-of-bounds op, unknown peer. */
  EXPECT_ERROR(kvw_engine_transfer(a, peer_b, 7, &read_op, 1, NULL, &id, &err), 3,
               "kind 7 is neither");
  EXPECT_ERROR(kvw_engine_transfer(a, peer_b, KVW_OP_READ, &read_op, 0, NULL, &id, &err), 3,
               "0 ops is out of range");
  EXPECT_ERROR(
      kvw_engine_transfer(a, peer_b, KVW_OP_READ, &read_op, (size_t)1 << 21, NULL, &id, &err), 3,
      "ops is out of range");
  EXPECT_ERROR(kvw_engine_transfer(a, peer_b, KVW_OP_READ, NULL, 1, NULL, &id, &err), 3,
               "ops is NULL");
  EXPECT_ERROR(kvw_engine_transfer(a, peer_b, KVW_OP_READ, &read_op, 1, NULL, NULL, &err), 3,
               "id is NULL");
  kvw_op_t too_long = {ra_back, 0, rb, 1, kBytes};
  EXPECT_ERROR(kvw_engine_transfer(a, peer_b, KVW_OP_READ, &too_long, 1, NULL, &id, &err), 0, "");
  EXPECT_ERROR(kvw_engine_transfer(a, 777777, KVW_OP_READ, &read_op, 1, NULL, &id, &err), 0, "");
  EXPECT_ERROR(kvw_engine_wait(a, 123456789, 0, &err), 0, "");
  EXPECT_ERROR(kvw_engine_wait(a, id, -1, &err), 3, "out of range");
  EXPECT_ERROR(kvw_engine_wait(NULL, id, 0, &err), 3, "engine is NULL");

  /* Peers and stats as JSON text. */
  char* peers = kvw_engine_peers_json(a);
  CHECK(peers != NULL && strstr(peers, "\"name\":\"c-api-b\"") != NULL &&
        strstr(peers, "\"alive\":true") != NULL && strstr(peers, "tcp") != NULL);
  kvw_free(peers);
  CHECK(kvw_engine_peers_json(NULL) == NULL);
  char* stats = kvw_engine_stats_json(a);
  CHECK(stats != NULL && strstr(stats, "bytes_written") != NULL);
  kvw_free(stats);
  stats = kvw_engine_stats_prometheus(a);
  CHECK(stats != NULL && strstr(stats, "c-api-a") != NULL);
  kvw_free(stats);
  CHECK(kvw_engine_stats_json(NULL) == NULL && kvw_engine_stats_prometheus(NULL) == NULL);

  /* Messages: a -> b's inbox, in order; then a's disconnect reaches the inbox as a close. */
  EXPECT_OK(kvw_engine_send_message(a, peer_b, "c-topic", "hello", 5, &err));
  EXPECT_OK(kvw_engine_send_message(a, peer_b, "c-topic", NULL, 0, &err));
  EXPECT_ERROR(kvw_engine_send_message(a, peer_b, "c-topic", NULL, 5, &err), 3,
               "payload is NULL but count is 5");
  EXPECT_ERROR(kvw_engine_send_message(a, peer_b, NULL, "x", 1, &err), 3, "topic is NULL");
  EXPECT_ERROR(kvw_engine_send_message(a, 31337, "c-topic", "x", 1, &err), 0, "");
  size_t got = 0;
  const int64_t msg_deadline = NowMs() + 10000;
  int saw_hello = 0, saw_empty = 0;
  while (got < 2 && NowMs() < msg_deadline) {
    kvw_inbox_events_t* ev = kvw_inbox_wait(inbox, 1000, &err);
    CHECK(ev != NULL);
    for (size_t i = 0; i < kvw_inbox_events_count(ev); ++i, ++got) {
      size_t len = 0;
      const char* p = kvw_inbox_events_payload(ev, i, &len);
      CHECK(kvw_inbox_events_kind(ev, i) == KVW_INBOX_MESSAGE);
      CHECK(kvw_inbox_events_peer(ev, i) == peer_a);
      CHECK(strcmp(kvw_inbox_events_peer_name(ev, i), "c-api-a") == 0);
      if (got == 0) saw_hello = len == 5 && memcmp(p, "hello", 5) == 0;
      if (got == 1) saw_empty = len == 0;
    }
    CHECK(kvw_inbox_events_kind(ev, 99) == -1 && kvw_inbox_events_peer(ev, 99) == 0 &&
          kvw_inbox_events_peer_name(ev, 99) == NULL);
    kvw_inbox_events_destroy(ev);
  }
  CHECK(saw_hello && saw_empty);
  kvw_inbox_events_t* none = kvw_inbox_take(inbox, &err);
  CHECK(none != NULL && kvw_inbox_events_count(none) == 0);
  kvw_inbox_events_destroy(none);
  CHECK(kvw_inbox_events_count(NULL) == 0);
  EXPECT_NULL_ERROR(kvw_inbox_take(NULL, &err), "inbox is NULL");
  EXPECT_NULL_ERROR(kvw_inbox_wait(inbox, -1, &err), "out of range");

  /* Unexport: the key stops working before the call returns. */
  EXPECT_OK(kvw_engine_unexport(b, peer_a, &rb, 1, &err));
  EXPECT_ERROR(kvw_engine_unexport(b, peer_a, NULL, 1, &err), 3, "regions is NULL");
  {
    /* Once the revocation reached a, a refuses the op itself (sent before that, b would drop
     * a as a peer using a region it no longer has, and the close below would carry that
     * reason instead). */
    size_t left = 1;
    const int64_t revoke_deadline = NowMs() + 10000;
    while (left != 0 && NowMs() < revoke_deadline) {
      uint64_t ids[4];
      uint64_t lengths[4];
      uint32_t access[4];
      int kinds[4];
      EXPECT_OK(kvw_engine_remote_regions(a, peer_b, ids, lengths, access, kinds, 4, &left, &err));
      if (left != 0) SleepMs(10);
    }
    CHECK(left == 0);
    int code = kvw_engine_transfer(a, peer_b, KVW_OP_READ, &read_op, 1, NULL, &id, &err);
    kvw_free(err);
    err = NULL;
    if (code == 0) code = kvw_engine_wait(a, id, 20000, &err);
    CHECK(code != 0);
    kvw_free(err);
    err = NULL;
  }

  /* a disconnects with a reason; b's inbox sees the close with it. */
  EXPECT_OK(kvw_engine_disconnect(a, peer_b, "c test is done", &err));
  EXPECT_ERROR(kvw_engine_disconnect(NULL, peer_b, NULL, &err), 3, "engine is NULL");
  int closed = 0;
  const int64_t close_deadline = NowMs() + 10000;
  while (!closed && NowMs() < close_deadline) {
    kvw_inbox_events_t* ev = kvw_inbox_wait(inbox, 1000, &err);
    for (size_t i = 0; ev != NULL && i < kvw_inbox_events_count(ev); ++i) {
      if (kvw_inbox_events_kind(ev, i) == KVW_INBOX_PEER_CLOSED) {
        const char* why = kvw_inbox_events_payload(ev, i, NULL);
        closed = 1;
        CHECK(strstr(why, "c test is done") != NULL);
      }
    }
    kvw_inbox_events_destroy(ev);
  }
  CHECK(closed);
  EXPECT_ERROR(kvw_engine_disconnect(b, 55555, NULL, &err), 0, "");

  EXPECT_OK(kvw_engine_deregister_memory(a, ra_src, &err));
  kvw_engine_destroy(a);
  kvw_inbox_destroy(inbox); /* the inbox may outlive nothing in particular; destroyed first */
  kvw_engine_destroy(b);
  kvw_engine_destroy(NULL);
  free(src);
  free(back);
  free(target);
}

/* The connector options added with the engine surface, the connector's engine, Announce. */
static void TestConnectorAdditions(void) {
  char* err = NULL;
  kvw_options_t* o = kvw_options_create();
  kvw_engine_options_t* eo = kvw_engine_options_create();
  EXPECT_OK(kvw_engine_options_set_name(eo, "c-conn", &err));
  EXPECT_OK(kvw_engine_options_set_transport(eo, "tcp", &err));
  EXPECT_OK(kvw_options_set_engine_options(o, eo, &err));
  EXPECT_ERROR(kvw_options_set_engine_options(o, NULL, &err), 3, "engine is NULL");
  EXPECT_ERROR(kvw_options_set_engine_options(NULL, eo, &err), 3, "options is NULL");
  kvw_engine_options_destroy(eo);
  /* Values out of range are kvw_connector_create's errors (TestSharedBadConnectorOptions). */
  EXPECT_OK(kvw_options_set_request_timeout(o, 5000, &err));
  EXPECT_ERROR(kvw_options_set_request_timeout(NULL, 1, &err), 3, "options is NULL");
  EXPECT_OK(kvw_options_set_handshake_timeout(o, 5000, &err));
  EXPECT_ERROR(kvw_options_set_handshake_timeout(NULL, 1, &err), 3, "options is NULL");
  EXPECT_OK(kvw_options_set_read_grants(o, 0, &err));
  EXPECT_OK(kvw_options_set_read_grants(o, 1, &err));
  EXPECT_ERROR(kvw_options_set_read_grants(o, 2, &err), 3, "expected 0 or 1");
  EXPECT_ERROR(kvw_options_set_read_grants(NULL, 1, &err), 3, "options is NULL");
  EXPECT_OK(kvw_options_set_metrics_address(o, "127.0.0.1:0", &err));
  EXPECT_ERROR(kvw_options_set_metrics_address(NULL, "", &err), 3, "options is NULL");
  EXPECT_OK(kvw_options_set_etcd_call_timeout(o, 500, &err));
  EXPECT_ERROR(kvw_options_set_etcd_call_timeout(NULL, 500, &err), 3, "options is NULL");
  EXPECT_OK(kvw_options_set_etcd_lease_seconds(o, 5, &err));
  EXPECT_ERROR(kvw_options_set_etcd_lease_seconds(NULL, 5, &err), 3, "options is NULL");
  EXPECT_ERROR(kvw_options_set_etcd_endpoints(NULL, "", &err), 3, "options is NULL");
  EXPECT_ERROR(kvw_options_set_cluster(NULL, "", &err), 3, "options is NULL");

  /* Without etcd: Announce is a FailedPrecondition. */
  kvw_connector_t* c = kvw_connector_create(o, &err);
  CHECK(c != NULL);
  kvw_engine_t* ce = kvw_connector_engine(c);
  CHECK(ce != NULL && strcmp(kvw_engine_name(ce), "c-conn") == 0 &&
        strcmp(kvw_engine_name(ce), kvw_connector_engine_id(c)) == 0);
  char* peers = kvw_engine_peers_json(ce);
  CHECK(peers != NULL && strcmp(peers, "[]") == 0);
  kvw_free(peers);
  kvw_engine_destroy(ce); /* borrowed: does nothing */
  CHECK(strcmp(kvw_engine_name(kvw_connector_engine(c)), "c-conn") == 0);
  char* metrics = kvw_connector_metrics_address(c);
  CHECK(metrics != NULL && strncmp(metrics, "127.0.0.1:", 10) == 0 && strlen(metrics) > 10);
  kvw_free(metrics);
  EXPECT_ERROR(kvw_connector_announce(c, NULL, &err), 9, "");
  CHECK(kvw_connector_announced(c) == 0);
  int delay_free = -1;
  char* out = NULL;
  EXPECT_OK(kvw_request_finished_with_transfer_id(c, "r1", NULL, 0, "", 0, "my-id", &delay_free,
                                                  &out, &err));
  CHECK(delay_free == 0);
  kvw_free(out);
  EXPECT_ERROR(
      kvw_request_finished_with_transfer_id(NULL, "r1", NULL, 0, "", 0, NULL, NULL, NULL, &err), 3,
      "connector is NULL");
  kvw_connector_destroy(c);

  /* etcd configured but nobody listening there: Announce succeeds (it keeps trying in the
   * background) and the registration is not in etcd. */
  EXPECT_OK(kvw_options_set_metrics_address(o, NULL, &err));
  EXPECT_OK(kvw_options_set_etcd_endpoints(o, "http://127.0.0.1:1", &err));
  EXPECT_OK(kvw_options_set_cluster(o, "c-test", &err));
  c = kvw_connector_create(o, &err);
  CHECK(c != NULL);
  metrics = kvw_connector_metrics_address(c);
  CHECK(metrics != NULL && metrics[0] == '\0');
  kvw_free(metrics);
  EXPECT_OK(kvw_connector_announce(c, "127.0.0.1:8000", &err));
  CHECK(kvw_connector_announced(c) == 0);
  kvw_connector_destroy(c);
  kvw_options_destroy(o);

  EXPECT_ERROR(kvw_connector_announce(NULL, NULL, &err), 3, "connector is NULL");
  CHECK(kvw_connector_announced(NULL) == 0);
  CHECK(kvw_connector_engine(NULL) == NULL);
  CHECK(kvw_connector_metrics_address(NULL) == NULL);

  /* The calls without errptr take NULL handles: 0 / NULL, or nothing happens. */
  CHECK(kvw_buffer_data(NULL) == NULL && kvw_buffer_size(NULL) == 0);
  CHECK(kvw_layout_to_json(NULL) == NULL && kvw_layout_num_groups(NULL) == 0);
  CHECK(kvw_layout_assign_backing(NULL, 0, 4, 0) == 0);
  CHECK(kvw_layout_group_name(NULL, 0) == NULL && kvw_layout_group_page_bytes(NULL, 0) == 0);
  CHECK(kvw_layout_group_tokens_per_block(NULL, 0) == 0 && kvw_layout_group_is_state(NULL, 0) == 0);
  CHECK(kvw_layout_group_num_layers(NULL, 0) == 0 && kvw_layout_block_address(NULL, 0, 0, 0) == 0);
  kvw_block_table_set(NULL, "g", NULL, 3);
  kvw_block_table_t* table = kvw_block_table_create();
  kvw_block_table_set(table, "g", NULL, 3); /* ignored */
  kvw_block_table_destroy(table);
  kvw_options_set_role(NULL, "prefill");
  kvw_options_set_mode(NULL, KVW_MODE_READ);
  kvw_options_set_name(NULL, "x");
  kvw_options_set_listen_address(NULL, "x");
  kvw_options_set_request_timeout_ms(NULL, 5);
  CHECK(kvw_connector_engine_id(NULL) == NULL && kvw_connector_address(NULL) == NULL);
  CHECK(kvw_build_connector_meta(NULL) == NULL && kvw_get_finished(NULL) == NULL);
  CHECK(kvw_finished_count(NULL, KVW_FINISHED_SENDING) == 0);
  CHECK(kvw_finished_request(NULL, KVW_FAILED_LOADS, 0) == NULL);
  CHECK(kvw_finished_reason(NULL, 0) == NULL && kvw_live_requests(NULL) == 0);
  CHECK(kvw_stats_json(NULL) == NULL && kvw_stats_prometheus(NULL) == NULL);
}

/* A free loopback port (bound, read back, released). */
static int FreePort(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a;
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (fd < 0 || bind(fd, (struct sockaddr*)&a, sizeof(a)) != 0 ||
      getsockname(fd, (struct sockaddr*)&a, &len) != 0) {
    fprintf(stderr, "no free port\n");
    exit(1);
  }
  close(fd);
  return ntohs(a.sin_port);
}

/* Announce through the C API against a real single-member etcd-server started here: the
 * registration reaches etcd (kvw_connector_announced turns 1 within a deadline). */
static void TestAnnounceWithRealEtcd(void) {
  static const char kEtcd[] = "/usr/bin/etcd";
  if (access(kEtcd, X_OK) != 0) {
    fprintf(stderr, "%s is missing (scripts/install-deps.sh installs etcd-server)\n", kEtcd);
    ++failures;
    return;
  }
  char dir[] = "/tmp/kvwire-c-etcd-XXXXXX";
  if (mkdtemp(dir) == NULL) {
    ++failures;
    return;
  }
  char client[64], peer[64], cluster[96], data[128];
  snprintf(client, sizeof(client), "http://127.0.0.1:%d", FreePort());
  snprintf(peer, sizeof(peer), "http://127.0.0.1:%d", FreePort());
  snprintf(cluster, sizeof(cluster), "c=%s", peer);
  snprintf(data, sizeof(data), "%s/data", dir);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlives the test */
    if (getppid() != parent) _exit(126);
    freopen("/dev/null", "w", stdout);
    freopen("/dev/null", "w", stderr);
    execl(kEtcd, kEtcd, "--name", "c", "--data-dir", data, "--listen-client-urls", client,
          "--advertise-client-urls", client, "--listen-peer-urls", peer,
          "--initial-advertise-peer-urls", peer, "--initial-cluster", cluster, "--log-level",
          "warn", (char*)NULL);
    _exit(127);
  }
  CHECK(pid > 0);

  char* err = NULL;
  kvw_options_t* o = kvw_options_create();
  kvw_options_set_name(o, "c-announce");
  EXPECT_OK(kvw_options_set_transport(o, "tcp", &err));
  EXPECT_OK(kvw_options_set_etcd_endpoints(o, client, &err));
  EXPECT_OK(kvw_options_set_cluster(o, "c-real", &err));
  EXPECT_OK(kvw_options_set_etcd_call_timeout(o, 1000, &err));
  EXPECT_OK(kvw_options_set_etcd_lease_seconds(o, 5, &err));
  kvw_connector_t* c = kvw_connector_create(o, &err);
  kvw_options_destroy(o);
  CHECK(c != NULL);
  kvw_layout_t* layout = kvw_layout_preset("deepseek-v3", &err);
  CHECK(layout != NULL);
  kvw_buffer_t* memory = NULL;
  if (c != NULL && layout != NULL) {
    memory = kvw_buffer_create(kvw_layout_assign_backing(layout, 0, 4, 0), &err);
    CHECK(memory != NULL);
    kvw_layout_assign_backing(layout, (uint64_t)(uintptr_t)kvw_buffer_data(memory), 4, 0);
    void* ptr = kvw_buffer_data(memory);
    size_t len = kvw_buffer_size(memory);
    EXPECT_OK(kvw_register_kv_caches(c, layout, &ptr, &len, 1, &err));
    /* etcd may still be starting: Announce succeeds and keeps trying in the background. */
    EXPECT_OK(kvw_connector_announce(c, "127.0.0.1:8000", &err));
    const int64_t deadline = NowMs() + 20000;
    while (kvw_connector_announced(c) == 0 && NowMs() < deadline) {
      struct timespec ms = {0, 20000000};
      nanosleep(&ms, NULL);
    }
    CHECK(kvw_connector_announced(c) == 1);
  }
  kvw_connector_destroy(c);
  kvw_layout_destroy(layout);
  kvw_buffer_destroy(memory);
  if (pid > 0) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
  }
  char rm[160];
  snprintf(rm, sizeof(rm), "rm -rf '%s'", dir);
  CHECK(system(rm) == 0);
}

/* A row of a tests/support/bad_*_options.tsv table (tab-separated: option, kind, value, and
 * the message C++, C and Python must all give), its fields pointing into `line`. */
typedef struct {
  char line[512];
  const char* option;
  const char* kind;
  const char* value;
  const char* want;
} BadOptionRow;

/* Reads the next row of `f` into `row`, past comments and blank lines; 0 at the end of the
 * file. A row without its four fields fails the test and is skipped. */
static int NextBadOptionRow(FILE* f, BadOptionRow* row) {
  while (fgets(row->line, sizeof(row->line), f) != NULL) {
    if (row->line[0] == '#' || row->line[0] == '\n') continue;
    row->line[strcspn(row->line, "\n")] = '\0';
    char* save = NULL;
    row->option = strtok_r(row->line, "\t", &save);
    row->kind = strtok_r(NULL, "\t", &save);
    row->value = strtok_r(NULL, "\t", &save);
    row->want = strtok_r(NULL, "\t", &save);
    CHECK(row->option != NULL && row->kind != NULL && row->value != NULL && row->want != NULL);
    if (row->want != NULL) return 1;
  }
  return 0;
}

/* "<transport>.<key>": copies the transport's name into `transport` and returns the key, or
 * NULL when there is no dot or the name does not fit. */
static const char* SplitTransportOption(const char* option, char* transport, size_t size) {
  const char* dot = strchr(option, '.');
  if (dot == NULL || (size_t)(dot - option) >= size) return NULL;
  memcpy(transport, option, (size_t)(dot - option));
  transport[dot - option] = '\0';
  return dot + 1;
}

/* The row's value must have been refused (code 3, from kvw_*_create) with exactly the row's
 * message after the status code ("INVALID_ARGUMENT: "), as the table holds it. */
static void ExpectRowRefused(const BadOptionRow* row, int code, const char* err) {
  const char* message = err == NULL ? NULL : strstr(err, ": ");
  if (code != 3 || message == NULL || strcmp(message + 2, row->want) != 0) {
    fprintf(stderr, "%s:%d: %s = %s: want \"%s\", got %d: %s\n", __FILE__, __LINE__, row->option,
            row->value, row->want, code, err != NULL ? err : "(no message)");
    ++failures;
  }
}

/* tests/support/bad_engine_options.tsv: each value, set through its C setter, is refused with
 * exactly the table's message (by the setter or by kvw_engine_create), as C++ and Python refuse
 * it. */
static void TestSharedBadOptions(const char* path) {
  FILE* f = fopen(path, "r");
  CHECK(f != NULL);
  if (f == NULL) return;
  BadOptionRow row;
  int rows = 0;
  while (NextBadOptionRow(f, &row)) {
    const char* option = row.option;
    const char* kind = row.kind;
    const char* value = row.value;
    ++rows;
    char* err = NULL;
    kvw_engine_options_t* o = kvw_engine_options_create();
    int code = 0;
    if (strcmp(kind, "text") == 0) {
      /* "<transport>.<key>": the transport's by-name setter. */
      char transport[64];
      const char* key = SplitTransportOption(option, transport, sizeof(transport));
      CHECK(key != NULL);
      if (key == NULL) {
        kvw_engine_options_destroy(o);
        continue;
      }
      code = kvw_engine_options_set_transport_option(o, transport, key, value, &err);
    } else if (strcmp(kind, "name") == 0) {
      CHECK(strcmp(option, "transport") == 0);
      code = kvw_engine_options_set_transport(o, value, &err);
    } else {
      const RangeCase* c = NULL;
      for (size_t i = 0; i < sizeof(kCases) / sizeof(kCases[0]); ++i) {
        if (strcmp(kCases[i].name, option) == 0) c = &kCases[i];
      }
      CHECK(c != NULL);
      if (c == NULL) {
        kvw_engine_options_destroy(o);
        continue;
      }
      code = c->set(o, strtoll(value, NULL, 10), &err);
    }
    if (code == 0) {
      kvw_engine_t* e = kvw_engine_create(o, &err);
      code = e == NULL ? 3 : 0;
      kvw_engine_destroy(e);
    }
    ExpectRowRefused(&row, code, err);
    kvw_free(err);
    kvw_engine_options_destroy(o);
  }
  fclose(f);
  CHECK(rows >= 10);
}

/* Sets one connector option of a row of tests/support/bad_connector_options.tsv through its C
 * setter; the setter's code (0: set). */
static int SetConnectorOption(kvw_options_t* o, const char* option, const char* kind,
                              const char* value, char** err) {
  if (strcmp(kind, "ms") == 0 || strcmp(kind, "int") == 0) {
    const int64_t v = strtoll(value, NULL, 10);
    if (strcmp(option, "request_timeout") == 0) return kvw_options_set_request_timeout(o, v, err);
    if (strcmp(option, "handshake_timeout") == 0) {
      return kvw_options_set_handshake_timeout(o, v, err);
    }
    if (strcmp(option, "etcd_call_timeout") == 0) {
      return kvw_options_set_etcd_call_timeout(o, v, err);
    }
    if (strcmp(option, "etcd_lease_seconds") == 0) {
      return kvw_options_set_etcd_lease_seconds(o, v, err);
    }
  } else if (strcmp(kind, "text") == 0) {
    if (strcmp(option, "role") == 0) {
      kvw_options_set_role(o, value);
      return 0;
    }
    if (strcmp(option, "etcd_user") == 0) return kvw_options_set_etcd_auth(o, value, NULL, err);
    if (strcmp(option, "etcd_password") == 0) return kvw_options_set_etcd_auth(o, NULL, value, err);
    if (strcmp(option, "etcd_ca_file") == 0)
      return kvw_options_set_etcd_tls(o, value, NULL, NULL, err);
    if (strcmp(option, "etcd_cert_file") == 0) {
      return kvw_options_set_etcd_tls(o, NULL, value, NULL, err);
    }
    if (strcmp(option, "etcd_key_file") == 0) {
      return kvw_options_set_etcd_tls(o, NULL, NULL, value, err);
    }
    if (strcmp(option, "etcd_endpoints") == 0) return kvw_options_set_etcd_endpoints(o, value, err);
    if (strcmp(option, "cluster") == 0) return kvw_options_set_cluster(o, value, err);
  } else if (strcmp(kind, "transport") == 0) {
    char transport[64];
    const char* key = SplitTransportOption(option, transport, sizeof(transport));
    if (key != NULL) return kvw_options_set_transport_option(o, transport, key, value, err);
  }
  fprintf(stderr, "%s:%d: unknown row %s (%s)\n", __FILE__, __LINE__, option, kind);
  ++failures;
  return -1;
}

/* tests/support/bad_connector_options.tsv: each value, set through its C setter (or put in the
 * environment for kvw_options_from_environment), is refused with exactly the table's message by
 * kvw_connector_create (ValidateConnectorOptions) or the environment reader, as C++ and Python
 * refuse it; the setters themselves hold no range. */
static void TestSharedBadConnectorOptions(const char* path) {
  FILE* f = fopen(path, "r");
  CHECK(f != NULL);
  if (f == NULL) return;
  BadOptionRow row;
  int rows = 0;
  while (NextBadOptionRow(f, &row)) {
    const char* option = row.option;
    const char* kind = row.kind;
    const char* value = row.value;
    ++rows;
    char* err = NULL;
    kvw_options_t* o = kvw_options_create();
    int code = 0;
    if (strcmp(kind, "env") == 0) {
      setenv(option, value, 1);
      code = kvw_options_from_environment(o, &err);
      unsetenv(option);
    } else {
      code = SetConnectorOption(o, option, kind, value, &err);
      if (code == 0) {
        kvw_connector_t* c = kvw_connector_create(o, &err);
        code = c == NULL ? 3 : 0;
        kvw_connector_destroy(c);
      }
    }
    ExpectRowRefused(&row, code, err);
    kvw_free(err);
    kvw_options_destroy(o);
  }
  fclose(f);
  CHECK(rows >= 10);

  /* A mode that is none of KVW_MODE_* (once taken as auto) is kvw_connector_create's error. */
  char* err = NULL;
  kvw_options_t* o = kvw_options_create();
  kvw_options_set_mode(o, 7);
  EXPECT_NULL_ERROR(kvw_connector_create(o, &err), "mode: 7 is out of range (0..2)");
  kvw_options_destroy(o);
}

int main(int argc, char** argv) {
  TestEngineOptionRanges();
  if (argc > 1) TestSharedBadOptions(argv[1]);
  if (argc > 2) TestSharedBadConnectorOptions(argv[2]);
  TestEngineOptionsOther();
  TestRegionAndOtherOptions();
  TestTransferOverTcp();
  TestConnectorAdditions();
  TestAnnounceWithRealEtcd();
  if (failures != 0) {
    fprintf(stderr, "c_api_engine_test: %d check(s) failed\n", failures);
    return 1;
  }
  printf("c_api_engine_test: all checks passed\n");
  return 0;
}
