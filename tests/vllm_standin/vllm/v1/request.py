"""vllm.v1.request (stand-in): RequestStatus and the Request fields a connector reads."""
import enum


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], max_tokens: int = 16,
                 kv_transfer_params: dict | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.kv_transfer_params = kv_transfer_params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_external_computed_tokens = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    def append_output_token_ids(self, token: int) -> None:
        self._output_token_ids.append(token)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)
