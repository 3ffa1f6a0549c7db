"""A request as the scheduler sees it (a Sequence), how it should be sampled (SamplingParams), and what
``LLM.generate`` returns (vLLM's RequestOutput / CompletionOutput shape: ``outs[i].outputs[0].token_ids``)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_p keeps the smallest set of most likely tokens whose probabilities sum to at
    least top_p; ``seed`` makes sampling reproducible (each request gets its own generator seeded with it);
    generation stops at an end-of-sequence token (unless ``ignore_eos``) or after ``max_tokens`` tokens."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")


class Status(enum.Enum):
    WAITING = "waiting"  # not in the cache: never started, or preempted (its blocks freed; it is recomputed)
    RUNNING = "running"  # its K/V are in the cache
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request: its tokens so far (prompt, then generated), and where its K/V live in the cache."""

    token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_prompt_tokens: int = 0
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)  # physical block of each logical block
    num_cached_tokens: int = 0  # leading tokens whose K/V were found in the prefix cache at admission
    num_prompt_cached_tokens: int = 0  # the same, at the first admission (a recomputed request may hit its own blocks)
    num_preemptions: int = 0
    finish_reason: str | None = None

    def __post_init__(self):
        self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class CompletionOutput:
    index: int
    text: str | None  # None when the checkpoint has no tokenizer
    token_ids: list[int]
    finish_reason: str | None  # "stop" (end-of-sequence token) or "length" (max_tokens, or the longest sequence the
    # cache holds); None while a stream runs on


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    finished: bool = True  # False: a stream's output so far (AsyncLLM.generate)
