"""kvwire's vLLM connector, scheduler side: plain Python, no engine and no KV memory in this
process. It decides per request and puts what the workers must do into
KvwireConnectorMetadata (kvwire.vllm_connector's docstring tells the whole protocol)."""
import json
import logging
import secrets

import _kvwire
from kvwire.vllm_blocks import _block_lists, _hands_off, _own_blocks, _prompt_len
from kvwire.vllm_metadata import KvwireConnectorMetadata, KvwireHandshakeMetadata

logger = logging.getLogger("kvwire.vllm")


class _SchedulerSide:
    def __init__(self, conn: "KvwireConnector"):
        self.c = conn
        self.workers: dict = {}  # tp rank -> KvwireHandshakeMetadata
        self.meta = KvwireConnectorMetadata()
        self.load_started: set = set()  # decode requests whose load went to the workers
        self.loading: dict = {}  # decode request id -> (blocks, num_tokens, params)
        self.pending_saves: dict = {}  # prefill write mode, not sent yet: id -> (req, entry)
        self.saving: dict = {}  # prefill write mode, sent: id -> entry
        self.holding: set = set()  # prefill read mode, blocks held for a reader

    # handshake ---------------------------------------------------------------------------
    def set_workers(self, metadata) -> None:
        workers = {}
        for rank, m in dict(metadata or {}).items():
            if not isinstance(m, KvwireHandshakeMetadata):
                raise ValueError(f"kvwire connector: handshake metadata of rank {rank} is "
                                 f"{type(m).__name__}, not KvwireHandshakeMetadata")
            workers[int(rank)] = m
        self.workers = workers
        logger.info("kvwire connector %s: workers %s", self.c.engine_id,
                    {r: m.address for r, m in sorted(workers.items())})

    def pending_push_work(self) -> bool:
        return bool(self.pending_saves or self.saving)

    # params ------------------------------------------------------------------------------
    def _table(self, lists) -> dict:
        names = self.c._names
        if len(lists) != len(names):
            raise ValueError(f"{len(lists)} block lists for {len(names)} KV cache groups")
        return {n: list(ids) for n, ids in zip(names, lists)}

    def _remote_table(self, remote) -> dict:
        """remote_block_ids as a decode's kvwire block table: vLLM's per-group lists (or one
        flat list for one group) map onto this engine's groups by index; an object by name."""
        if isinstance(remote, dict):
            return {str(k): v for k, v in remote.items()}
        if not isinstance(remote, list):
            raise ValueError(f"remote_block_ids must be a list or an object, got "
                             f"{type(remote).__name__}")
        if remote and all(isinstance(x, list) for x in remote):
            return self._table(remote)
        if len(self.c._names) != 1:
            raise ValueError(f"remote_block_ids is one flat list but this engine has "
                             f"{len(self.c._names)} KV cache groups")
        return {self.c._names[0]: remote}

    def _load_params(self, params: dict, prompt_len: int) -> str:
        """A decode request's kv_transfer_params as the kvwire JSON its worker loads with;
        ValueError with the reason when they cannot be used."""
        if not isinstance(params, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {type(params).__name__}")
        out = {k: v for k, v in params.items() if v is not None}
        out.pop("block_ids", None)
        remote = params.get("remote_block_ids")
        if remote is None:
            remote = params.get("block_ids")
        if remote is not None:
            out["remote_block_ids"] = self._remote_table(remote)
        sources = []
        for i, s in enumerate(params.get("tp_sources") or []):
            if not isinstance(s, dict):
                raise ValueError(f"tp_sources[{i}] must be an object")
            s = {k: v for k, v in s.items() if v is not None}
            rb = s.pop("remote_block_ids", None)
            rb = s.pop("block_ids", rb)
            if rb is not None:
                s["remote_block_ids"] = self._remote_table(rb)
            sources.append(s)
        if sources:
            out["tp_sources"] = sources
        n = params.get("num_tokens")
        out["num_tokens"] = prompt_len if n is None else min(int(n), prompt_len)
        out["do_remote_prefill"] = True
        out["do_remote_decode"] = False
        text = json.dumps(out)
        _kvwire.parse_kv_transfer_params(text)  # the worker's typed parser: ValueError if bad
        return text

    # vLLM's calls ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Decode (do_remote_prefill): the prompt tokens beyond the local prefix come from the
        prefill, asynchronously. No side effects (vLLM may call it again)."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return 0, False
        if request.request_id in self.load_started:
            return 0, False
        count = _prompt_len(request) - int(num_computed_tokens)
        if count > 1:
            return count, True
        # Everything but the last prompt token is in the local prefix cache (vLLM never counts
        # the last one as a hit): vLLM computes that token here even after a load (it replays
        # it to sample the next), so nothing is loaded and the prefill is told to free its
        # blocks (update_state_after_alloc).
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        try:
            self._update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception as e:  # noqa: BLE001 - a connector error must not end vLLM's loop
            rid = getattr(request, "request_id", "?")
            logger.error("kvwire connector: update_state_after_alloc(%s): %s; no transfer",
                         rid, e)
            params = getattr(request, "kv_transfer_params", None)
            if (isinstance(params, dict) and params.get("do_remote_prefill") and
                    num_external_tokens > 0 and rid in self.load_started and
                    rid not in self.loading):
                # vLLM waits for this load: it must end, as a failed one.
                try:
                    computed = max(_prompt_len(request) - int(num_external_tokens), 0)
                    flat = sorted({b for g in _own_blocks(_block_lists(blocks), computed,
                                                          self.c._block_size) for b in g})
                except Exception:  # noqa: BLE001
                    flat = []
                self.meta.failed.append({"request_id": rid, "reason": str(e),
                                         "block_ids": flat})
                self.loading[rid] = None

    def _update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict):
            return
        rid = request.request_id
        if params.get("do_remote_prefill"):
            if rid in self.load_started:
                return  # the second call, after the load: nothing more to do
            self.load_started.add(rid)
            if num_external_tokens <= 0:
                # A full local prefix hit: nothing to load, and the prefill frees its blocks
                # now rather than at the end of its lease.
                self._release(request, params, "decode found the prompt in its prefix cache")
                return
            lists = _block_lists(blocks)
            prompt_len = _prompt_len(request)
            num_computed = max(prompt_len - int(num_external_tokens), 0)
            # Only the blocks this load fills: a local prefix block may be shared.
            flat = sorted({b for g in _own_blocks(lists, num_computed, self.c._block_size)
                           for b in g})
            try:
                text = self._load_params(params, prompt_len)
                table = self._table(lists)
            except (ValueError, TypeError, RuntimeError) as e:
                # Never into vLLM: the load fails (its blocks reported as failed), and vLLM's
                # kv_load_failure_policy recomputes or fails the request; blocks are freed.
                reason = f"bad kv_transfer_params: {e}"
                logger.error("kvwire connector: request %s: %s", rid, reason)
                self.meta.failed.append({"request_id": rid, "reason": reason,
                                         "block_ids": flat})
                self.loading[rid] = None
                return
            self.meta.loads.append({"request_id": rid, "params": text, "blocks": table,
                                    "num_tokens": prompt_len, "num_computed": num_computed})
            self.loading[rid] = (table, prompt_len, text)
            return
        if params.get("do_remote_decode") and str(params.get("mode") or "") == "write":
            if rid in self.pending_saves or rid in self.saving:
                return
            lists = _block_lists(blocks)
            if self.c._settings.mode == "read":
                logger.error("kvwire connector: request %s asks for write mode but this engine "
                             "is 'read'; no hand-off", rid)
                return
            tid = params.get("transfer_id") or params.get("remote_request_id")
            if not isinstance(tid, str) or not tid:
                logger.error("kvwire connector: request %s: write mode without a transfer_id; "
                             "no hand-off", rid)
                return
            entry = {"request_id": rid, "blocks": self._table(lists),
                     "num_tokens": _prompt_len(request),
                     "params": json.dumps({"do_remote_decode": True, "mode": "write",
                                           "transfer_id": tid})}
            self.pending_saves[rid] = (request, entry)

    def _release(self, request, params, reason: str) -> None:
        """Decode will not load this hand-off: the workers tell the prefill ranks."""
        try:
            text = self._load_params(params, _prompt_len(request))
        except (ValueError, TypeError, RuntimeError) as e:
            logger.warning("kvwire connector: request %s: cannot tell the prefill to free its "
                           "blocks (bad kv_transfer_params: %s); its lease will", request.request_id,
                           e)
            return
        self.meta.releases.append({"request_id": request.request_id, "params": text,
                                   "reason": reason})

    def build_connector_meta(self, scheduler_output) -> KvwireConnectorMetadata:
        # Write mode: a save goes to the workers with the step that computes the last prompt
        # chunk (its layers are final at that step's save_kv_layer), with every block the
        # request got since (chunked prefill allocates as it goes).
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        new_blocks = {}
        if cached is not None:
            for rid, nb in zip(getattr(cached, "req_ids", []) or [],
                               getattr(cached, "new_block_ids", []) or []):
                if nb is not None:
                    new_blocks[rid] = _block_lists(nb)
        for rid in list(self.pending_saves):
            request, entry = self.pending_saves[rid]
            if rid in new_blocks:
                for name, ids in zip(self.c._names, new_blocks[rid]):
                    entry["blocks"][name].extend(ids)
            n = scheduled.get(rid)
            if n is None:
                continue  # not scheduled this step
            if int(getattr(request, "num_computed_tokens", 0)) + int(n) < entry["num_tokens"]:
                continue  # a partial prefill: not final yet
            del self.pending_saves[rid]
            self.meta.saves.append(entry)
            self.saving[rid] = entry
        meta, self.meta = self.meta, KvwireConnectorMetadata()
        return meta

    def request_finished(self, request, lists, flat=False):
        """(delay freeing the blocks, kv_transfer_params for the output). Never raises.
        `flat`: vLLM passed one flat list (no hybrid allocator); the params carry one too."""
        try:
            return self._request_finished(request, lists, flat)
        except Exception as e:  # noqa: BLE001 - a connector error must not end vLLM's loop
            logger.error("kvwire connector: request_finished(%s): %s; blocks freed now",
                         getattr(request, "request_id", "?"), e)
            return False, None

    def _request_finished(self, request, lists, flat):
        rid = request.request_id
        params = getattr(request, "kv_transfer_params", None)
        params = params if isinstance(params, dict) else {}
        started = rid in self.load_started
        self.load_started.discard(rid)
        if params.get("do_remote_prefill") and not started and rid not in self.loading:
            # Decode, ended (aborted) before vLLM allocated its blocks: the load never started.
            self._release(request, params, "decode request ended before its load started")
            return False, None
        if rid in self.loading:
            # Decode, finished (aborted) before its KV arrived: the workers stop the load and
            # report it received; vLLM keeps the blocks until then (finish_requests).
            entry = self.loading.pop(rid)
            if entry is not None:
                table, n, text = entry
                self.meta.finishes.append({"request_id": rid, "aborted": True, "blocks": table,
                                           "num_tokens": n, "params": text})
            return False, None
        if rid in self.pending_saves:
            del self.pending_saves[rid]  # never reached the workers
            return False, None
        if rid in self.saving:
            entry = self.saving.pop(rid)
            self.meta.finishes.append({
                "request_id": rid, "aborted": not _hands_off(request),
                "blocks": entry["blocks"], "num_tokens": entry["num_tokens"],
                "params": entry["params"]})
            self.holding.add(rid)
            return True, None
        if not params.get("do_remote_decode") or str(params.get("mode") or "") == "write":
            return False, None
        try:
            _kvwire.parse_kv_transfer_params(json.dumps(params))
        except (ValueError, TypeError) as e:
            logger.error("kvwire connector: request %s: bad kv_transfer_params: %s; no "
                         "hand-off, blocks freed", rid, e)
            return False, None
        if not _hands_off(request):
            return False, None  # aborted or failed: nothing to hand off
        if self.c._settings.mode == "write":
            logger.error("kvwire connector: request %s: read-mode hand-off but this engine is "
                         "'write'; blocks freed", rid)
            return False, None
        if 0 not in self.workers:
            logger.error("kvwire connector: request %s: no worker address yet (vLLM has not "
                         "called set_xfer_handshake_metadata); blocks freed", rid)
            return False, None
        table = self._table(lists)
        delay = any(len(ids) > 0 for ids in lists)
        tid = secrets.token_hex(16)  # the capability a reader presents: 128 random bits
        n = _prompt_len(request)
        by_index = all(name == str(i) for i, name in enumerate(self.c._names))
        blocks_out = [list(ids) for ids in lists] if by_index else table
        if flat and by_index and len(lists) == 1:
            blocks_out = list(lists[0])

        def where(m):
            host, _, port = m.address.rpartition(":")
            return (self.c._settings.host_ip or m.host or host), int(port)

        host, port = where(self.workers[0])
        out = {"do_remote_prefill": True, "do_remote_decode": False,
               "remote_engine_id": self.c.engine_id, "remote_host": host, "remote_port": port,
               "remote_block_ids": blocks_out, "remote_request_id": rid,
               "transfer_id": tid, "tp_size": self.c._tp_size, "mode": "read",
               "num_tokens": n}
        others = [r for r in sorted(self.workers) if r != 0]
        if others:
            out["tp_sources"] = []
            for r in others:
                h, p = where(self.workers[r])
                out["tp_sources"].append({"remote_engine_id": self.workers[r].engine_id,
                                          "remote_host": h, "remote_port": p,
                                          "transfer_id": tid, "remote_block_ids": blocks_out})
        if delay:
            self.meta.holds.append({"request_id": rid, "transfer_id": tid, "blocks": table,
                                    "num_tokens": n})
            self.holding.add(rid)
        return delay, out

    def update_connector_output(self, output) -> None:
        for rid in getattr(output, "finished_recving", None) or ():
            self.loading.pop(rid, None)
        for rid in getattr(output, "finished_sending", None) or ():
            self.holding.discard(rid)
