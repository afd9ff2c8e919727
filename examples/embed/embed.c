/* The smallest C program that embeds the kvwire connector: a prefill and a decode connector
 * in one process move one request's KV cache (DeepSeek-V3 MLA layout, fragmented blocks),
 * first in read mode, then in write mode, and check every byte.
 *
 *   kvwire_embed_c [transport]      transport: auto (default), tcp or shm
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvwire/kvwire.h"

enum { kBlocks = 16, kTokens = 300 };

typedef struct {
  kvw_connector_t* connector;
  kvw_layout_t* layout;
  kvw_buffer_t* memory;
} Side;

static void Fail(const char* what, char* err) {
  fprintf(stderr, "embed: %s: %s\n", what, err != NULL ? err : "?");
  kvw_free(err);
  exit(1);
}

static Side MakeSide(const char* name, const char* transport, uint64_t seed) {
  Side s;
  char* err = NULL;
  kvw_options_t* o = kvw_options_create();
  /* The KVWIRE_* environment (KVWIRE_SECRET, ...), then this program's own settings. */
  if (kvw_options_from_environment(o, &err) != 0) Fail("environment", err);
  kvw_options_set_name(o, name);
  if (kvw_options_set_transport(o, transport, &err) != 0) Fail("transport", err);
  kvw_options_set_request_timeout_ms(o, 30000);
  s.connector = kvw_connector_create(o, &err);
  kvw_options_destroy(o);
  if (s.connector == NULL) Fail("connector", err);
  s.layout = kvw_layout_preset("deepseek-v3", &err);
  if (s.layout == NULL) Fail("layout", err);
  uint64_t bytes = kvw_layout_assign_backing(s.layout, 0, kBlocks, 0);
  s.memory = kvw_buffer_create(bytes, &err);
  if (s.memory == NULL) Fail("memory", err);
  kvw_layout_assign_backing(s.layout, (uint64_t)(uintptr_t)kvw_buffer_data(s.memory), kBlocks, 0);
  memset(kvw_buffer_data(s.memory), (int)seed, kvw_buffer_size(s.memory));
  void* ptr = kvw_buffer_data(s.memory);
  size_t len = kvw_buffer_size(s.memory);
  if (kvw_register_kv_caches(s.connector, s.layout, &ptr, &len, 1, &err) != 0) {
    Fail("register", err);
  }
  return s;
}

static void DestroySide(Side* s) {
  kvw_connector_destroy(s->connector);
  kvw_layout_destroy(s->layout);
  kvw_buffer_destroy(s->memory);
}

/* Fragmented block ids of the two requests on each side (each request its own blocks). */
static const int64_t kPrefillIds[2][5] = {{3, 7, 8, 12, 1}, {4, 9, 11, 13, 2}};
static const int64_t kDecodeIds[2][5] = {{10, 2, 5, 6, 0}, {11, 3, 14, 7, 15}};
enum { kUsed = (kTokens + 63) / 64 };

static kvw_block_table_t* Table(const int64_t* ids) {
  kvw_block_table_t* t = kvw_block_table_create();
  kvw_block_table_set(t, "mla_kv", ids, kUsed);
  return t;
}

static uint8_t Pattern(size_t layer, size_t logical, size_t i, int round) {
  return (uint8_t)(layer * 131 + logical * 31 + i * 7 + (size_t)round * 17);
}

static void FillPrefill(Side* p, int round) {
  uint64_t page = kvw_layout_group_page_bytes(p->layout, 0);
  for (size_t l = 0; l < kvw_layout_group_num_layers(p->layout, 0); ++l) {
    for (size_t b = 0; b < kUsed; ++b) {
      uint8_t* dst = (uint8_t*)(uintptr_t)kvw_layout_block_address(
          p->layout, 0, l, (uint64_t)kPrefillIds[round - 1][b]);
      for (size_t i = 0; i < page; ++i) dst[i] = Pattern(l, b, i, round);
    }
  }
}

/* The bytes of the request's tokens: MLA pages are token-major (656 bytes a token), and the
 * last block is only partly the request's (in read mode the prefill clears the rest before
 * the decode may read it, so that nothing of an earlier request comes along). */
static int VerifyDecode(Side* d, int round) {
  uint64_t page = kvw_layout_group_page_bytes(d->layout, 0);
  uint64_t tpb = (uint64_t)kvw_layout_group_tokens_per_block(d->layout, 0);
  for (size_t l = 0; l < kvw_layout_group_num_layers(d->layout, 0); ++l) {
    for (size_t b = 0; b < kUsed; ++b) {
      const uint8_t* src = (const uint8_t*)(uintptr_t)kvw_layout_block_address(
          d->layout, 0, l, (uint64_t)kDecodeIds[round - 1][b]);
      uint64_t tokens = (uint64_t)kTokens - b * tpb;
      uint64_t filled = tokens >= tpb ? page : tokens * (page / tpb);
      for (size_t i = 0; i < filled; ++i) {
        if (src[i] != Pattern(l, b, i, round)) {
          fprintf(stderr, "embed: mismatch layer %zu block %zu byte %zu\n", l, b, i);
          return 0;
        }
      }
    }
  }
  return 1;
}

static void SleepMs(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Polls get_finished until `id` shows up in `kind` (or fails); returns 1 on success. */
static int WaitFinished(kvw_connector_t* c, const char* id, int kind) {
  for (int tries = 0; tries < 30000; ++tries) {
    kvw_finished_t* f = kvw_get_finished(c);
    int found = 0;
    for (size_t i = 0; i < kvw_finished_count(f, kind); ++i) {
      if (strcmp(kvw_finished_request(f, kind, i), id) == 0) found = 1;
    }
    for (size_t i = 0; i < kvw_finished_count(f, KVW_FAILED_LOADS); ++i) {
      fprintf(stderr, "embed: load of %s failed: %s\n",
              kvw_finished_request(f, KVW_FAILED_LOADS, i), kvw_finished_reason(f, i));
      found = -1;
    }
    kvw_finished_destroy(f);
    if (found != 0) return found == 1;
    SleepMs(1);
  }
  return 0;
}

static int Load(Side* d, const char* id, const char* params, int round) {
  char* err = NULL;
  uint64_t external = 0;
  int async = 0;
  if (kvw_get_num_new_matched_tokens(d->connector, id, kTokens, 0, params, &external, &async,
                                     &err) != 0) {
    Fail("get_num_new_matched_tokens", err);
  }
  kvw_block_table_t* t = Table(kDecodeIds[round - 1]);
  if (kvw_update_state_after_alloc(d->connector, id, t, external, &err) != 0) {
    Fail("update_state_after_alloc", err);
  }
  kvw_block_table_destroy(t);
  char* meta = kvw_build_connector_meta(d->connector);
  if (kvw_bind_connector_meta(d->connector, meta, &err) != 0) Fail("bind", err);
  kvw_free(meta);
  if (kvw_start_load_kv(d->connector, &err) != 0) Fail("start_load_kv", err);
  return 1;
}

int main(int argc, char** argv) {
  const char* transport = argc > 1 ? argv[1] : "auto";
  Side p = MakeSide("embed-prefill", transport, 0x11);
  Side d = MakeSide("embed-decode", transport, 0x22);
  char* err = NULL;
  if (kvw_layout_check_compatible(p.layout, d.layout, &err) != 0) Fail("layouts", err);

  /* Read mode: prefill finishes, hands params to decode, decode reads, prefill frees. */
  FillPrefill(&p, 1);
  kvw_block_table_t* pt = Table(kPrefillIds[0]);
  int delay_free = 0;
  char* params = NULL;
  if (kvw_request_finished(p.connector, "req-read", pt, kTokens, "{\"do_remote_decode\": true}", 0,
                           &delay_free, &params, &err) != 0) {
    Fail("request_finished", err);
  }
  Load(&d, "req-read", params, 1);
  kvw_free(params);
  if (!WaitFinished(d.connector, "req-read", KVW_FINISHED_RECVING)) return 1;
  if (!WaitFinished(p.connector, "req-read", KVW_FINISHED_SENDING)) return 1;
  if (!VerifyDecode(&d, 1)) return 1;
  printf("read mode: %d tokens moved and verified (prefill delay_free=%d)\n", kTokens, delay_free);

  /* Write mode: decode allocates first and asks; prefill saves layer by layer. */
  FillPrefill(&p, 2);
  char* address = kvw_connector_address(p.connector);
  char* colon = strrchr(address, ':');
  *colon = '\0';
  char* wparams = kvw_write_mode_params(address, atoi(colon + 1), "xfer-w", kTokens);
  kvw_free(address);
  Load(&d, "req-write", wparams, 2);
  kvw_block_table_destroy(pt);
  pt = Table(kPrefillIds[1]);
  kvw_free(wparams);
  const char* pre =
      "{\"do_remote_decode\": true, \"mode\": \"write\", \"transfer_id\": \"xfer-w\"}";
  uint64_t external = 0;
  int async = 0;
  if (kvw_get_num_new_matched_tokens(p.connector, "req-write", kTokens, 0, pre, &external, &async,
                                     &err) != 0 ||
      kvw_update_state_after_alloc(p.connector, "req-write", pt, 0, &err) != 0) {
    Fail("prefill write request", err);
  }
  char* meta = kvw_build_connector_meta(p.connector);
  if (kvw_bind_connector_meta(p.connector, meta, &err) != 0) Fail("bind", err);
  kvw_free(meta);
  for (int layer = 0; layer < (int)kvw_layout_group_num_layers(p.layout, 0); ++layer) {
    if (kvw_save_kv_layer(p.connector, layer, &err) != 0) Fail("save_kv_layer", err);
  }
  if (kvw_wait_for_save(p.connector, &err) != 0) Fail("wait_for_save", err);
  if (kvw_request_finished(p.connector, "req-write", pt, kTokens, pre, 0, &delay_free, NULL,
                           &err) != 0) {
    Fail("request_finished", err);
  }
  if (!WaitFinished(d.connector, "req-write", KVW_FINISHED_RECVING)) return 1;
  if (delay_free && !WaitFinished(p.connector, "req-write", KVW_FINISHED_SENDING)) return 1;
  if (!VerifyDecode(&d, 2)) return 1;
  printf("write mode: %d tokens moved layer by layer and verified\n", kTokens);
  kvw_block_table_destroy(pt);

  /* Errors come back as codes and messages, never as crashes. */
  if (kvw_get_num_new_matched_tokens(d.connector, "bad", 10, 0, "{nope", &external, &async, &err) ==
          0 ||
      err == NULL) {
    fprintf(stderr, "embed: corrupted params were accepted\n");
    return 1;
  }
  printf("corrupted kv_transfer_params rejected: %s\n", err);
  kvw_free(err);
  err = NULL;

  char* stats = kvw_stats_json(d.connector);
  printf("decode stats: %.200s...\n", stats);
  kvw_free(stats);
  if (kvw_live_requests(p.connector) != 0 || kvw_live_requests(d.connector) != 0) {
    fprintf(stderr, "embed: requests left behind\n");
    return 1;
  }
  DestroySide(&d);
  DestroySide(&p);
  printf("ok\n");
  return 0;
}
