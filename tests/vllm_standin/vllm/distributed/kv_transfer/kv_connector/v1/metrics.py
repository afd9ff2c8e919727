"""KVConnectorStats as vLLM declares it (stand-in, tests only)."""
from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVConnectorStats:
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self):
        raise NotImplementedError

    def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
        raise NotImplementedError

    def reduce(self) -> dict[str, int | float]:
        raise NotImplementedError

    def is_empty(self) -> bool:
        raise NotImplementedError
