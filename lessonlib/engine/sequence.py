"""A request as the scheduler sees it (a Sequence), how it should be sampled (SamplingParams), and what
``LLM.generate`` returns (vLLM's RequestOutput / CompletionOutput shape: ``outs[i].outputs[0].token_ids``)."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field


SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy decoding (dividing by it would overflow)
SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: more is refused, as vLLM's server refuses it (a 400)
MAX_N = 128  # OpenAI's bound on n: a request's samples are sequences, each holding KV blocks
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's (and vLLM's) presence_penalty and frequency_penalty
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's logit_bias values


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's names and rules. temperature below 1e-5 (0 included) is greedy; top_k keeps the k most likely tokens
    (0 or -1: all); min_p drops tokens less likely than min_p times the most likely one; top_p keeps the smallest
    set of most likely tokens whose probabilities sum to at least top_p (applied in vLLM's order: temperature, min_p,
    top_k, top_p). ``seed`` makes sampling reproducible (each request gets its own generator seeded with it; the
    i-th of ``n`` samples with seed + i). Generation stops at an end-of-sequence token (unless ``ignore_eos``), at
    one of ``stop_token_ids``, when the detokenized output contains one of the ``stop`` strings (cut from the text
    unless ``include_stop_str_in_output``; the token ids keep the token that completed it), or after
    ``max_tokens`` tokens. ``logprobs`` N (at most MAX_LOGPROBS): each generated token's log-probability and the N
    most likely tokens' (see CompletionOutput.logprobs). ``seed=-1`` is no seed (vLLM's rule: a random one).

    The logits processors, vLLM's semantics (``sampler.process_logits``), applied to the raw logits before
    temperature and the filters, greedy included: ``logit_bias`` {token: bias} added; ``min_tokens``: until that
    many tokens are out, end-of-sequence and ``stop_token_ids`` are masked and no stop ends the request;
    ``repetition_penalty`` r divides a positive logit of a token seen in the prompt or output by r and multiplies a
    negative one by r; ``frequency_penalty`` f subtracts f times the token's count in the output,
    ``presence_penalty`` p subtracts p once if it occurs there. Every field is checked here (the bounds that need
    the model's vocabulary in ``engine/requests.py``), so a bad request fails before any is queued."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # kept as sorted (token, bias) pairs
    min_tokens: int = 0

    def __post_init__(self):
        _check_int("n", self.n, low=1, high=MAX_N)
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("top_k", self.top_k, low=-1)
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not PENALTY_RANGE[0] <= getattr(self, name) <= PENALTY_RANGE[1]:
                raise ValueError(f"{name} must be in {list(PENALTY_RANGE)}, got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            _check_int("seed", self.seed, *SEED_RANGE)
            if self.seed == -1:  # vLLM's "no seed"
                object.__setattr__(self, "seed", None)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (not isinstance(stop, (list, tuple))
                                 or not all(isinstance(s, str) and s for s in stop)):
            raise TypeError(f"stop must be a non-empty str or a list of them, got {self.stop!r}")
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or
                                not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise TypeError(f"stop_token_ids must be a list of token ids (ints >= 0), got {ids!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "stop", tuple(stop or ()))  # frozen: normalised once, read as tuples
        object.__setattr__(self, "stop_token_ids", tuple(ids or ()))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def processes_logits(self) -> bool:
        """Whether a logits processor changes this request's logits (then its token is chosen on the host)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """{token id: bias}, checked, as sorted (token, bias) pairs (frozen and hashable, as ``stop``); the token ids'
    range is checked against the vocabulary in ``engine/requests.py``."""
    if not bias:
        return ()
    if isinstance(bias, tuple):  # already normalised (dataclasses.replace passes it back)
        bias = dict(bias)
    if not isinstance(bias, dict):
        raise TypeError(f"logit_bias must be a dict {{token id: bias}}, got {bias!r}")
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise TypeError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError(f"logit_bias values must be finite numbers, got {value!r}")
        if not LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1]:
            raise ValueError(f"logit_bias values must be in {list(LOGIT_BIAS_RANGE)}, got {value}")
    return tuple(sorted((token, float(value)) for token, value in bias.items()))


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low}, {high if high is not None else 'inf'}], got {value}")


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
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's stop_reason)
    logprobs: list[dict] | None = None  # per generated token, when params.logprobs asks (see CompletionOutput)
    error: str | None = None  # why it was aborted alone (its sampling failed, its logits were not finite)
    queued_at: float | None = None  # time.perf_counter() when the scheduler got it, and when a step first ran it
    first_scheduled_at: float | None = None

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
    finish_reason: str | None  # "stop" (end-of-sequence token, stop token or string), "length" (max_tokens, or the
    # longest sequence the cache holds) or "abort" (a failed step; or this request's probabilities were NaN/inf); None
    # while a stream runs on
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for eos or length
    # vLLM's form: one dict per generated token, {token_id: Logprob}, holding the sampled token and the
    # ``logprobs`` most likely ones; log-probabilities of the model's raw logits (before temperature, top-k, ...)
    logprobs: list[dict[int, "Logprob"]] | None = None
    error: str | None = None  # finish_reason "abort" by the engine: why (None when a caller aborted it)


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 for the most likely token
    decoded_token: str | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    finished: bool = True  # False: a stream's output so far (AsyncLLM.generate)
    queue_s: float | None = None  # seconds from the scheduler's queue to the first step that ran it (vLLM's queue time)
