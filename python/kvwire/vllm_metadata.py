"""What kvwire's vLLM connector hands through vLLM: the scheduler's per-step metadata for the
workers, a worker's handshake metadata for the scheduler, and the interval transfer stats."""
from kvwire.vllm_compat import (KVConnectorHandshakeMetadata, KVConnectorMetadata,
                                KVConnectorStats)


class KvwireConnectorMetadata(KVConnectorMetadata):
    """What the scheduler-side connector asks of every worker in one step. Plain data, so it
    crosses processes as vLLM sends it (pickled with the scheduler output).

      loads:    decode, {request_id, params (kvwire JSON), blocks, num_tokens, num_computed}
      saves:    prefill write mode, {request_id, params, blocks, num_tokens}
      holds:    prefill read mode, {request_id, transfer_id, blocks, num_tokens}
      finishes: the scheduler finished a request the workers still move, {request_id,
                aborted, blocks, num_tokens, params}
      failed:   decode loads refused before they started, {request_id, reason, block_ids}
                (block_ids: only the blocks the load would have filled, never local prefix
                blocks other requests may share)
      releases: decode will not load a prefill's hand-off (its prompt is in the local prefix
                cache, or it ended before its load started): {request_id, params, reason};
                worker rank 0 tells the prefill ranks to free the blocks now
    """

    def __init__(self):
        self.loads: list = []
        self.saves: list = []
        self.holds: list = []
        self.finishes: list = []
        self.failed: list = []
        self.releases: list = []

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.holds or self.finishes or self.failed or
                    self.releases)

    def __repr__(self):
        return (f"KvwireConnectorMetadata(loads={len(self.loads)}, saves={len(self.saves)}, "
                f"holds={len(self.holds)}, finishes={len(self.finishes)}, "
                f"failed={len(self.failed)}, releases={len(self.releases)})")


class KvwireHandshakeMetadata(KVConnectorHandshakeMetadata):
    """A worker's control-channel address, for its scheduler (vLLM carries it)."""

    def __init__(self, engine_id: str, address: str, tp_rank: int, host: str = ""):
        self.engine_id = engine_id
        self.address = address
        self.tp_rank = tp_rank
        self.host = host

    def __repr__(self):
        return (f"KvwireHandshakeMetadata(engine_id={self.engine_id!r}, "
                f"address={self.address!r}, tp_rank={self.tp_rank})")


class KvwireConnectorStats(KVConnectorStats):
    """Transfer counters of one interval (vLLM aggregates them over workers)."""

    KEYS = ("requests_completed", "requests_failed", "bytes")

    def __init__(self, data=None):
        super().__init__(data=dict(data or {}))

    def reset(self):
        self.data = {}

    def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict:
        return {k: self.data.get(k, 0) for k in self.KEYS}

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in self.KEYS)
