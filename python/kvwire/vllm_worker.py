"""kvwire's vLLM connector, worker side: the native kvwire.Connector, its KV caches and
transfers (kvwire.vllm_connector's docstring tells the whole protocol)."""
import json
import logging

import _kvwire
from kvwire.vllm_blocks import _own_blocks
from kvwire.vllm_metadata import (KvwireConnectorMetadata, KvwireConnectorStats,
                                  KvwireHandshakeMetadata)

logger = logging.getLogger("kvwire.vllm")


class _WorkerSide:
    def __init__(self, conn: "KvwireConnector"):
        self.c = conn
        s = conn._settings
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            self.tp_rank = int(get_tensor_model_parallel_rank())
        except (ImportError, AssertionError, AttributeError):
            self.tp_rank = 0
        # The KVWIRE_* environment (KVWIRE_SECRET, KVWIRE_TCP_CONNECTIONS, ...), read where the
        # library asks its users to read it; the settings below win over it, as they always did.
        engine_options = _kvwire.EngineOptions.from_environment()
        if s.verify_checksums:
            engine_options.verify_checksums = True
        self.native = _kvwire.Connector(
            name=f"{conn.engine_id}/tp{self.tp_rank}", mode=s.mode,
            transport=s.transport, request_timeout_s=s.request_timeout_s,
            secret=s.secret, listen_address=s.listen_address,
            metrics_address=s.metrics_address, read_grants=s.read_grants,
            engine_options=engine_options)
        self.layout = None
        self.layer_of: dict = {}  # vLLM layer name -> model layer index
        self.names_of_layer: dict = {}  # model layer index -> its layer names
        # decode request -> the block ids its load fills (reported on failure; never the local
        # prefix blocks before them, which other requests may share)
        self.load_blocks: dict = {}
        self.loading: set = set()  # decode loads not reported yet
        self.sending: set = set()  # prefill requests the native holds or saves
        self.done_recving: set = set()  # reported by us, not by the native
        self.done_sending: set = set()
        self.failed_loads: dict = {}  # decode request -> its own blocks, failure not reported
        self.invalid: set = set()
        self.finished_seen: set = set()  # request ids vLLM has passed to get_finished
        self.unreported_sending: set = set()
        self.failed_saves: set = set()  # write mode saves the native refused
        self.saves_bound = False
        self.any_cache = None
        self.saved_names: set = set()
        self.sent_layers: set = set()
        self.events: list = []
        self.last_stats = {"completed": 0, "failed": 0, "bytes": 0}

    def handshake_metadata(self) -> KvwireHandshakeMetadata:
        host = self.native.address.rpartition(":")[0]
        return KvwireHandshakeMetadata(self.c.engine_id, self.native.address, self.tp_rank,
                                       self.c._settings.host_ip or host)

    # registration --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        from kvwire.vllm_layout import build_layout
        layout_json, memory, layer_of = build_layout(
            kv_caches, self.c._kv_cache_config, self.c._names, self.c._settings.groups,
            self.c._block_size, self.tp_rank, self.c._tp_size)
        self.layout = _kvwire.Layout.from_json(layout_json)
        mem = [_kvwire.KvMemory(ptr, length, kind, device) for ptr, length, kind, device in memory]
        self.native.register_kv_caches(self.layout, mem)
        self.layer_of = layer_of
        self.any_cache = next(iter(kv_caches.values()))
        self.names_of_layer = {}
        for name, idx in layer_of.items():
            self.names_of_layer.setdefault(idx, set()).add(name)
        logger.info("kvwire connector %s: registered %d caches in %d groups at %s",
                    self.c.engine_id, len(kv_caches), len(self.layout.groups),
                    self.native.address)

    # per step ------------------------------------------------------------------------------
    def bind(self, meta) -> None:
        if not isinstance(meta, KvwireConnectorMetadata):
            raise TypeError(f"kvwire connector: metadata of type {type(meta).__name__}")
        n = self.native
        self.saves_bound = False
        for f in meta.failed:
            rid = f["request_id"]
            logger.warning("kvwire connector: load of %s failed: %s", rid, f["reason"])
            self.done_recving.add(rid)
            self.failed_loads[rid] = list(f["block_ids"])
        for r in meta.releases:
            if self.tp_rank != 0:
                continue  # rank 0 tells every prefill rank (the params name them all)
            try:
                n.release_unread(r["request_id"], r["params"], r["reason"])
            except (ValueError, RuntimeError) as err:
                logger.warning("kvwire connector: cannot tell the prefill of %s to free its "
                               "blocks (its lease will): %s", r["request_id"], err)
        for e in meta.loads:
            rid = e["request_id"]
            own = _own_blocks(list(e["blocks"].values()), e["num_computed"], self.c._block_size)
            self.load_blocks[rid] = sorted({b for ids in own for b in ids})
            try:
                got, _ = n.get_num_new_matched_tokens(rid, e["num_tokens"], e["num_computed"],
                                                      e["params"])
                if got == 0:
                    raise ValueError("nothing to load")
                try:
                    n.update_state_after_alloc(rid, e["blocks"], got)
                except (ValueError, RuntimeError):
                    n.request_finished(rid, e["blocks"], e["num_tokens"], e["params"], True)
                    raise
                self.loading.add(rid)
            except (ValueError, RuntimeError) as err:
                logger.warning("kvwire connector: load of %s failed: %s", rid, err)
                self.done_recving.add(rid)
                self.failed_loads[rid] = self.load_blocks.pop(rid)
        for e in meta.saves:
            rid = e["request_id"]
            try:
                n.get_num_new_matched_tokens(rid, e["num_tokens"], 0, e["params"])
                try:
                    n.update_state_after_alloc(rid, e["blocks"], 0)
                except (ValueError, RuntimeError):
                    n.request_finished(rid, e["blocks"], e["num_tokens"], e["params"], True)
                    raise
                self.sending.add(rid)
                self.saves_bound = True
            except (ValueError, RuntimeError) as err:
                # The scheduler frees the blocks when the request finishes (delay, then
                # reported here as sent); decode's load fails at its deadline or on "fail".
                logger.error("kvwire connector: write-mode save of %s refused: %s", rid, err)
                self.failed_saves.add(rid)
        for e in meta.holds:
            rid = e["request_id"]
            try:
                delay, _ = n.request_finished(rid, e["blocks"], e["num_tokens"],
                                              '{"do_remote_decode": true, "mode": "read"}',
                                              False, e["transfer_id"])
                if delay:
                    self.sending.add(rid)
                else:
                    self.done_sending.add(rid)
            except (ValueError, RuntimeError) as err:
                logger.error("kvwire connector: cannot hold the blocks of %s: %s", rid, err)
                self.done_sending.add(rid)  # the scheduler kept them: free them now
        for e in meta.finishes:
            rid = e["request_id"]
            if rid in self.failed_saves:
                self.failed_saves.discard(rid)
                self.done_sending.add(rid)
                continue
            if rid not in self.loading and rid not in self.sending:
                continue  # already reported (or never started here)
            try:
                delay, _ = n.request_finished(rid, e["blocks"], e["num_tokens"], e["params"],
                                              bool(e["aborted"]))
            except (ValueError, RuntimeError) as err:
                logger.error("kvwire connector: finishing %s: %s", rid, err)
                delay = False
            if not delay:
                if rid in self.loading:
                    self.loading.discard(rid)
                    self.done_recving.add(rid)
                    self.load_blocks.pop(rid, None)
                elif rid in self.sending:
                    self.sending.discard(rid)
                    self.done_sending.add(rid)
        try:
            n.bind_connector_meta(n.build_connector_meta())
        except (ValueError, RuntimeError) as err:
            logger.error("kvwire connector: binding this step's metadata: %s", err)
        self.saved_names = set()
        self.sent_layers = set()

    def start_load_kv(self) -> None:
        try:
            self.native.start_load_kv()
        except (ValueError, RuntimeError) as err:
            logger.error("kvwire connector: start_load_kv: %s", err)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Nothing to wait for: every load is asynchronous (get_num_new_matched_tokens says so),
        # so vLLM schedules no request whose KV is still on the way; blocking here would only
        # hold up the forward pass of the others.
        return

    def _event_for(self, kv_layer):
        """A GPU event recorded on the current stream after the kernel that wrote the layer's
        KV (the send is ordered after it), or None for host memory."""
        if kv_layer is None or not getattr(kv_layer, "is_cuda", False):
            return None
        import torch
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(kv_layer.device))
        self.events.append(event)  # alive until wait_for_save
        return event, kv_layer.device.index or 0

    def _send_layer(self, idx: int, event) -> None:
        if idx in self.sent_layers:
            return
        self.sent_layers.add(idx)
        try:
            if event is None:
                self.native.save_kv_layer(idx)
            else:
                self.native.save_kv_layer(idx, int(event[0].cuda_event), event[1])
        except (ValueError, RuntimeError) as err:
            logger.error("kvwire connector: save_kv_layer(%d): %s", idx, err)

    def save_kv_layer(self, layer_name: str, kv_layer) -> None:
        if not self.saves_bound:
            return
        idx = self.layer_of.get(layer_name)
        if idx is None:
            return
        self.saved_names.add(layer_name)
        # A model layer goes out once every cache of it was written this step.
        if self.names_of_layer.get(idx, set()) <= self.saved_names:
            self._send_layer(idx, self._event_for(kv_layer))

    def wait_for_save(self) -> None:
        if self.saves_bound:
            # Layers whose caches did not all pass through save_kv_layer are final now, once
            # the work queued on the current stream so far has run.
            event = self._event_for(self.any_cache) if self.unsent_layers() else None
            for idx in self.unsent_layers():
                self._send_layer(idx, event)
            try:
                self.native.wait_for_save()
            except (ValueError, RuntimeError) as err:
                logger.error("kvwire connector: wait_for_save: %s", err)
        self.events = []
        self.saves_bound = False

    def unsent_layers(self) -> list:
        return [i for i in sorted(self.names_of_layer) if i not in self.sent_layers]

    def get_transfer_results(self, finished_req_ids, per_request: bool):
        """(finished sending, finished receiving, failed receiving). A failed load is also
        received (vLLM's contract). `per_request`: vLLM takes failures per request
        (failed_recving): with more than one KV cache group that is the only way (block ids
        are per group), so failures go there and never into the block ids; with one group
        they go as block ids (the blocks the load filled only), so vLLM keeps the valid local
        prefix. vLLM recomputes or fails the request per kv_load_failure_policy."""
        sending, recving = self.get_finished(finished_req_ids)
        failed, self.failed_loads = self.failed_loads, {}
        if per_request and len(self.c._names) > 1:
            return sending, recving, set(failed)
        for blocks in failed.values():
            self.invalid.update(blocks)
        return sending, recving, set()

    def get_finished(self, finished_req_ids):
        """(finished sending, finished receiving). A failed load is received and remembered
        in failed_loads (get_transfer_results reports it), never reported as a good load."""
        sending, recving, failed = self.native.get_finished()
        recving = set(recving) | self.done_recving
        self.done_recving = set()
        for rid, reason in failed:
            logger.warning("kvwire connector: load of %s failed: %s", rid, reason)
            recving.add(rid)
            self.failed_loads[rid] = self.load_blocks.get(rid, [])
        for rid in recving:
            self.loading.discard(rid)
            self.load_blocks.pop(rid, None)
        self.unreported_sending |= set(sending) | self.done_sending
        self.done_sending = set()
        # Only ids this worker may still report are remembered (others would pile up).
        self.finished_seen |= set(finished_req_ids or ()) & (self.sending |
                                                             self.unreported_sending |
                                                             self.failed_saves)
        # vLLM: a finished send must be of a request passed here as finished (now or before).
        out_sending = self.unreported_sending & self.finished_seen
        self.unreported_sending -= out_sending
        self.finished_seen -= out_sending
        self.sending -= out_sending
        return (out_sending or None), (recving or None)

    def take_load_errors(self) -> set:
        invalid, self.invalid = self.invalid, set()
        return invalid

    def interval_stats(self):
        s = json.loads(self.native.stats_json())
        now = {"completed": int(s.get("completed", 0)), "failed": int(s.get("failed", 0)),
               "bytes": sum(int(g.get("bytes", 0)) for g in (s.get("groups") or {}).values())}
        delta = {"requests_completed": now["completed"] - self.last_stats["completed"],
                 "requests_failed": now["failed"] - self.last_stats["failed"],
                 "bytes": now["bytes"] - self.last_stats["bytes"]}
        self.last_stats = now
        stats = KvwireConnectorStats(data=delta)
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        self.native = None
