"""``LLM``: vLLM's offline interface over the engine's parts (scheduler, block manager, model runner, sampler).

    llm = LLM(model=path, dtype=None, block_size=16, max_num_seqs=64, features=Features(),  # Features(cuda_graphs=False): eager
              check_kernels=False)  # True: eager, each step's block tables checked first (engine/checks.py)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64))
    outs[i].outputs[0].token_ids, outs[i].outputs[0].text
    outs = llm.chat([{"role": "user", "content": "Hi"}], params)  # the tokenizer's chat template

Every input is checked before the engine's state changes (``engine/requests.py``). A request whose own sampling or
stop check fails ends alone, "abort" with its ``error``, the others go on; a step whose batched model fails frees
the running requests (the waiting ones stay queued), so after any error the engine is usable for the next call.

Asynchronous scheduling (``Features.async_scheduling``, vLLM's ``async_scheduling``): a greedy decode step is left
running on the GPU while the host schedules and launches the next one, whose input tokens the GPU takes from the
step before (the host writes a placeholder, ``PENDING``, for each). Only then does the host wait for the first
step's tokens and fill its placeholders in. So the host's work per step (scheduling, input preparation, the
bookkeeping of finished requests) runs while the GPU computes, instead of between steps with the GPU idle. The price:
a request that emits a stop token runs one step more than it needs (its extra token is dropped); one that ends by
length is known in advance and is not scheduled again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lessonlib import runtime
from lessonlib.engine.block_manager import BlockManager
from lessonlib.engine.chat import chat_prompts
from lessonlib.engine.checks import check_step
from lessonlib.engine.config import ModelConfig
from lessonlib.engine.features import Features
from lessonlib.engine.model import Model
from lessonlib.engine.model_runner import ModelRunner, PendingTokens
from lessonlib.engine.outputs import request_output, stop_reason
from lessonlib.engine.requests import RequestLimits, longest_token_chars, make_sequences
from lessonlib.engine.sampler import ABORTED, Sampler
from lessonlib.engine.scheduler import Scheduler, token_budget
from lessonlib.engine.sequence import RequestOutput, SamplingParams, Sequence, Status

CPU_POOL_BYTES = 64 * 2**20  # default KV pool on the CPU: the interpreter serves tiny models only
GPU_POOL_SHARE = 0.8  # default KV pool on a GPU: this share of the memory budget left after the weights


PENDING = -1  # a token the GPU has computed (or is computing) that has not reached the host yet
MAX_STEP_RECORDS = 100_000  # llm.steps keeps the latest ones: an add_request/step loop that runs for days stays bounded


@dataclass
class Launched:
    """A step on its way: launched on the GPU, its tokens not yet read on the host."""

    seqs: list[Sequence]
    is_prefill: bool
    tokens: PendingTokens
    token_index: list[int]  # where each sequence's new token goes in its token_ids (a PENDING placeholder now)
    new_tokens: int
    cached: int
    started: float
    record: dict  # what StepRecord reports about the scheduler's state, taken at launch (just after scheduling)


@dataclass
class StepRecord:
    """One engine step, for the lesson's timeline and block-usage plots."""

    kind: str  # "prefill" or "decode"
    num_seqs: int  # rows the step ran (with scheduling ahead, a request that met a stop token runs one step more)
    num_tokens: int  # tokens run through the model (a prefill's cached prefix not counted)
    cached_tokens: int  # prompt tokens served from the prefix cache (prefill steps)
    blocks_used: int  # after scheduling: blocks held by running sequences (and idle cached blocks not counted)
    blocks_reserved: int  # blocks the running sequences would hold if each reserved its max length up front
    waiting: int
    preemptions: int  # so far in this run
    seconds: float  # from its launch (or the previous step's completion, if later) to its completion


class LLM:
    def __init__(self, model: str | Path, dtype: torch.dtype | str | None = None, block_size: int = 16,
                 max_num_seqs: int = 64, max_model_len: int | None = None, num_blocks: int | None = None,
                 max_num_batched_tokens: int | None = None,
                 features: Features | None = None, check_kernels: bool = False):
        path = Path(model)
        for name, value in (("max_model_len", max_model_len), ("num_blocks", num_blocks)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 (or None: the default), got {value!r}")
        if features is not None and not isinstance(features, Features):
            raise TypeError(f"features must be a lessonlib.engine.Features, got {type(features).__name__}")
        features = features or Features()
        if check_kernels:  # each step checked on the host first (checks.py): no CUDA graphs
            features = replace(features, cuda_graphs=False)
        self.check_kernels = bool(check_kernels)
        self.config = config = ModelConfig.from_folder(path)
        self.dtype = dtype = resolve_dtype(dtype)
        if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, at least 16 (paged_attention's), got {block_size!r}")
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
        device = runtime.device()
        max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        element = torch.empty((), dtype=dtype).element_size()
        runtime.check_fits(config.weight_bytes(element), f"{path.name}'s weights in {dtype}")
        block_bytes = 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element
        if num_blocks is None:
            wanted = max_num_seqs * -(-max_model_len // block_size)
            profile = runtime.gpu_profile()
            room = CPU_POOL_BYTES if profile is None else \
                GPU_POOL_SHARE * (profile.memory_budget - config.weight_bytes(element))
            num_blocks = max(1, min(wanted, int(room // block_bytes)))
        runtime.check_fits(num_blocks * block_bytes, f"a KV cache of {num_blocks} blocks")
        # The longest sequence: what the positions allow and what the whole pool holds.
        self.max_model_len = min(max_model_len, num_blocks * block_size)
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.features = features

        self.tokenizer = _load_tokenizer(path)
        self.limits = RequestLimits(config.vocab_size, self.max_model_len,
                             self.max_model_len * longest_token_chars(self.tokenizer))
        self.model = Model(config, dtype, device, max_positions=self.max_model_len, features=features)
        self.model.load_weights(path)
        self.model.eval()
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs,
                                   token_budget(max_num_batched_tokens, features, max_num_seqs, self.max_model_len),
                                   continuous=features.continuous_batching, chunked=features.chunked_prefill)
        self.runner = ModelRunner(self.model, num_blocks, block_size, self.max_model_len, max_num_seqs, features)
        self.sampler = Sampler(device)
        self.steps: list[StepRecord] = []  # the last generate()'s steps
        self._in_flight: Launched | None = None  # a step left running on the GPU (asynchronous scheduling)
        self._last_done = 0.0  # when the last step completed (a step's time runs from its launch or from then)

    @property
    def cuda_graphs(self) -> bool:
        return bool(self.runner.graphs)

    # --- requests ----------------------------------------------------------------------------------------------
    def make_sequences(self, prompt, params: SamplingParams) -> list[Sequence]:
        """One request's ``n`` sequences, checked (``engine/requests.py``); no state changes here."""
        return make_sequences(prompt, params, self.limits, self.tokenizer)

    def add_request(self, prompt, params: SamplingParams) -> Sequence:
        if isinstance(params, SamplingParams) and params.n != 1:
            raise ValueError(f"add_request runs one sample (n=1), got n={params.n}: use generate() for n > 1")
        [seq] = self.make_sequences(prompt, params)
        self.add_sequences([seq])
        return seq

    def add_sequences(self, seqs: list[Sequence]) -> None:
        """Queue sequences that ``make_sequences`` made (checked there), each with its own generator."""
        now = time.perf_counter()
        for seq in seqs:
            seq.queued_at = now
            self.sampler.start(seq.seq_id, seq.params.seed)
            self.scheduler.add(seq)

    def abort_request(self, seq: Sequence) -> bool:
        """Stop a request added with add_request: it leaves the scheduler and its KV blocks return to the pool now.
        A step left running on the GPU that holds it drops its token (``_complete`` skips a finished sequence).
        False if it had already finished."""
        if seq.status is Status.FINISHED:
            return False
        while seq.token_ids and seq.token_ids[-1] == PENDING:
            seq.token_ids.pop()
        self.scheduler.abort(seq)
        self.sampler.forget(seq.seq_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished() or self._in_flight is not None

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion, in one continuously batched run; outputs in the prompts' order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("generate needs a non-empty list of prompts")
        if isinstance(prompts[0], int):  # one prompt given as token ids
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        # All checked before any is added. The n samples of a prompt are n sequences with the same prompt: admitted
        # together, all but the first find its full prompt blocks in the prefix cache and share them.
        groups = [self.make_sequences(p, sp) for p, sp in zip(prompts, params)]
        if self.has_unfinished_requests():
            raise RuntimeError("requests added with add_request() are still running: step() them to completion")
        self.steps = []
        for group in groups:
            self.add_sequences(group)
        try:
            while self.has_unfinished_requests():
                self.step()
        except BaseException:  # a failed step ended the running requests; generate's waiting ones end with them
            for seq in [seq for group in groups for seq in group]:
                self.abort_request(seq)
            raise
        return [request_output(self.tokenizer, group) for group in groups]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} dicts) or a list of them, each rendered
        with the tokenizer's chat template (or ``chat_template``) and generated from."""
        prompts = chat_prompts(self.tokenizer, messages, chat_template, add_generation_prompt,
                               self.limits.max_prompt_chars)
        return self.generate(prompts, sampling_params)

    def step(self) -> list[Sequence]:
        """One scheduler step: prefill or decode, sample, retire finished sequences; returns those. With
        asynchronous scheduling a greedy decode step is left running and completed by the next call, after that
        call has launched the step that follows it (or has found that the next step needs its tokens first). A
        failure frees every running request and the prefix cache, and is raised; the waiting requests stay queued."""
        previous, self._in_flight = self._in_flight, None
        try:
            if previous is None:
                seqs, is_prefill = self.scheduler.schedule()
                if not seqs:
                    raise RuntimeError("the scheduler found nothing to run: a request cannot fit the KV cache")
            else:
                seqs, is_prefill = self.scheduler.schedule_ahead(self._ends_by_length), False
                if not seqs:  # the next step depends on the running step's tokens: wait for them first
                    return self._complete(previous)
            launched = self._launch(seqs, is_prefill, previous)
            finished = self._complete(previous) if previous is not None else []
            if self._may_leave_running(launched):
                self._in_flight = launched
            else:
                finished += self._complete(launched)
            return finished
        except BaseException:
            self._in_flight = None
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                while seq.token_ids and seq.token_ids[-1] == PENDING:  # tokens that will never arrive
                    seq.token_ids.pop()
            for seq in self.scheduler.running:
                self.sampler.forget(seq.seq_id)
            self.scheduler.abort_running()
            raise

    def _launch(self, seqs: list[Sequence], is_prefill: bool, previous: Launched | None) -> Launched:
        """Run the step's model and sampler (queued on the GPU), start its tokens' copy to the host, and give each
        sequence a placeholder for its new token."""
        started = time.perf_counter()
        for seq in seqs:
            seq.first_scheduled_at = seq.first_scheduled_at or started
        if self.check_kernels:
            check_step(seqs, list(self.scheduler.running), self.block_manager, is_prefill)
        chunks = self.scheduler.chunks if is_prefill and self.features.chunked_prefill else None
        if chunks is not None:  # a mixed step: only the sequences whose chunk ends their tokens get one
            out = self.runner.prefill(seqs, [chunks[s.seq_id] for s in seqs])
            new_tokens = sum(end - start for start, end in chunks.values())
            cached = sum(s.num_cached_tokens for s in seqs if chunks[s.seq_id][0] == s.num_cached_tokens > 0)
            seqs = [s for s in seqs if chunks[s.seq_id][1] == len(s)]
        elif is_prefill:
            out = self.runner.prefill(seqs)
        else:
            rows = {seq.seq_id: row for row, seq in enumerate(previous.seqs)} if previous is not None else {}
            out = self.runner.decode(seqs, [rows[s.seq_id] if s.token_ids[-1] == PENDING else None for s in seqs])
        eos = self.config.eos_token_ids
        tokens = self.sampler(out.logits, [s.seq_id for s in seqs], [s.params for s in seqs], greedy=out.greedy,
                              check_all=self.check_kernels,
                              histories=[(s.token_ids[:s.num_prompt_tokens], s.output_token_ids) for s in seqs],
                              stop_ids=[(() if s.params.ignore_eos else eos) + s.params.stop_token_ids for s in seqs])
        tokens = self.sampler.keep_logprobs(seqs, out.logits, tokens)
        if chunks is None:
            cached = sum(s.num_cached_tokens for s in seqs) if is_prefill else 0
            new_tokens = sum(len(s) for s in seqs) - cached if is_prefill else len(seqs)
        for seq in seqs:
            seq.token_ids.append(PENDING)
        running = self.scheduler.running
        record = {"blocks_used": self.block_manager.num_used,
                  "blocks_reserved": sum(self.block_manager.blocks_for(min(s.num_prompt_tokens + s.params.max_tokens,
                                                                           self.max_model_len)) for s in running),
                  "waiting": len(self.scheduler.waiting)}
        return Launched(seqs, is_prefill, self.runner.host_tokens.send(tokens), [len(s) - 1 for s in seqs],
                        new_tokens, cached, started, record)

    def _may_leave_running(self, launched: Launched) -> bool:
        """A step may run on while the next is scheduled when that step could take its tokens on the GPU: a decode
        step of greedy requests (a sampled token is drawn outside the captured step) that want no logprobs."""
        return (self.features.async_scheduling and not launched.is_prefill and not self.check_kernels
                and all(seq.params.greedy and seq.params.logprobs is None and not seq.params.processes_logits
                        for seq in launched.seqs))

    def _complete(self, launched: Launched) -> list[Sequence]:
        """Wait for a step's tokens, put them in place of its placeholders, retire the sequences that end, and
        register the prefix-cache blocks the step filled; returns the finished sequences."""
        tokens = launched.tokens.wait()
        finished = []
        for seq, token, index in zip(launched.seqs, tokens, launched.token_index):
            if seq.status is not Status.RUNNING:  # it ended at the step before, which this one was launched behind
                continue
            if token == ABORTED:  # NaN/inf logits or probabilities, or its sampling failed: it ends alone
                self._end_alone(seq, index, self.sampler.errors.get(seq.seq_id)
                                or "the model's logits or probabilities were not finite (NaN or inf)")
                finished.append(seq)
                continue
            seq.token_ids[index] = token
            if not launched.is_prefill:
                self.block_manager.register_written(seq, index - 1)  # the fed token's K/V are written
            try:
                reason = self._finish_reason(seq, token, length=index + 1)
            except Exception as error:  # its stop strings could not be read (detokenizing failed): it alone ends
                self._end_alone(seq, index + 1, f"stop check failed: {type(error).__name__}: {error}")
                finished.append(seq)
                continue
            if reason:
                del seq.token_ids[index + 1:]  # a placeholder of the step launched behind this one
                self.scheduler.finish(seq, reason)
                self.sampler.forget(seq.seq_id)
                finished.append(seq)
        now = time.perf_counter()
        del self.steps[:len(self.steps) - MAX_STEP_RECORDS + 1]
        self.steps.append(StepRecord(
            "prefill" if launched.is_prefill else "decode", len(launched.seqs), launched.new_tokens, launched.cached,
            **launched.record, preemptions=self.scheduler.num_preemptions,
            seconds=now - max(launched.started, self._last_done)))
        self._last_done = now
        return finished

    def _end_alone(self, seq: Sequence, keep: int, error: str) -> None:
        """End one sequence with "abort" and why, its tokens from ``keep`` dropped and its unshared blocks uncached;
        the step's other sequences go on."""
        del seq.token_ids[keep:]
        seq.error = error
        self.block_manager.forget_blocks_of(seq)
        self.scheduler.finish(seq, "abort")
        self.sampler.forget(seq.seq_id)

    def _finish_reason(self, seq: Sequence, token: int, length: int) -> str | None:
        """Why a sequence whose token at ``length - 1`` is ``token`` ends there, if it does (only by length before
        it has ``min_tokens`` tokens)."""
        if length - seq.num_prompt_tokens < seq.params.min_tokens:
            token = PENDING  # (the processors masked its end tokens; stop strings wait too, as vLLM's)
        if not seq.params.ignore_eos and token in self.config.eos_token_ids:
            return "stop"
        if token != PENDING and (seq.params.stop or seq.params.stop_token_ids):  # (a plain request: no slicing)
            seq.stop_reason = stop_reason(self.tokenizer, seq.params, seq.token_ids[seq.num_prompt_tokens:length])
            if seq.stop_reason is not None:
                return "stop"
        if length - seq.num_prompt_tokens >= seq.params.max_tokens or length >= self.max_model_len:
            return "length"
        return None

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether the token the running step computes for ``seq`` (its last, a placeholder) will end it by length."""
        return self._finish_reason(seq, PENDING, length=len(seq.token_ids)) == "length"

    def output(self, seq: Sequence) -> RequestOutput:
        if seq.status is not Status.FINISHED:
            raise RuntimeError(f"request {seq.seq_id} has not finished")
        return request_output(self.tokenizer, [seq])

    # --- state, for tests and the lesson -----------------------------------------------------------------------
    def num_blocks_in_use(self) -> int:
        """Blocks held by sequences (0 after every generate: nothing leaks). Idle prefix-cache blocks are free."""
        return self.block_manager.num_used


def resolve_dtype(dtype) -> torch.dtype:
    """The engine's dtype: the course's policy by default (bfloat16 on a GPU that has it, float16 below sm_80,
    float32 in the interpreter); a requested one must be one flash_attention runs here."""
    from lessonlib.ops.flash_attention import flash_attention_dtypes

    if dtype is None or dtype == "auto":
        return runtime.dtype(cpu=torch.float32)
    if isinstance(dtype, str):
        names = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
                 "bfloat16": torch.bfloat16}
        if dtype not in names:
            raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(names)}")
        dtype = names[dtype]
    allowed = flash_attention_dtypes()
    if dtype not in allowed:
        if dtype == torch.bfloat16:
            why = runtime.why_not_bfloat16()
        elif dtype == torch.float32 and runtime.on_gpu():
            why = "on the GPU flash_attention runs 16-bit inputs only (its tl.dot would run float32 as TF32)"
        else:
            why = "the course's kernels do not run it"
        raise TypeError(f"dtype {dtype} is not supported here: {why}; use one of {', '.join(map(str, allowed))}")
    return dtype


def _load_tokenizer(path: Path):
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
