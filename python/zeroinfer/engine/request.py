"""Request: the only per-request state of the engine.

Token bookkeeping (who writes what):
  prompt_ids, output_ids   committed tokens; output_ids grows only in Scheduler.commit
  inflight                 tokens sampled by launched rounds whose results are not committed yet
                           (written by Scheduler.schedule when a row samples, cleared by commit)
  num_computed             tokens whose K/V the launched rounds have written or will write
                           (advanced by Scheduler.schedule: optimistic, the zero-overhead way)
The logical sequence is prompt_ids + output_ids + <inflight unknown tokens>.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from zeroinfer.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    want_prompt_logits: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    prompt_logits: list = field(default_factory=list)
    inflight: int = 0
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    slot: int | None = None  # compressor-state slot while it holds cache
    blocks: dict[str, list[int]] = field(default_factory=dict)
    num_preemptions: int = 0
    detok: object | None = None  # IncrementalDetokenizer when stop strings are used
    # structured output's grammar matcher (zeroinfer.structured_output), at the committed tokens
    matcher: object | None = None
    # speculative decoding's drafter (engine/speculative.NgramIndex, or DeviceDrafts for the
    # MTP drafter) over the committed tokens; None where the request does not speculate
    drafter: object | None = None
    num_drafted: int = 0  # drafts its verification rows checked, and kept
    num_accepted: int = 0
    text: str = ""

    @property
    def num_known(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_total(self) -> int:
        """Known tokens plus those already sampled on the device but not committed."""
        return self.num_known + self.inflight

    def token_at(self, i: int) -> int:
        p = len(self.prompt_ids)
        return self.prompt_ids[i] if i < p else self.output_ids[i - p]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
