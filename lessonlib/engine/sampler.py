"""From logits to the next token: the logits processors (logit bias, min tokens, penalties), then greedy, or sampled
with temperature, min-p, top-k and top-p (vLLM's order), reproducible with a seed; a row whose logits or
probabilities are not finite is refused (ABORTED), greedy or sampled; the logprobs a request asks for.

Fault isolation: the rows are one batch, but a row's failure is its request's alone. A processor runs row by row;
if the batched filters raise, each row is run alone and only the rows that raise alone get ABORTED, their error kept
in ``Sampler.errors`` for the engine to end that request with ("abort", and why); the others go on.
"""

from __future__ import annotations

import torch

from lessonlib import ops, runtime
from lessonlib.engine.sequence import Logprob, SamplingParams, Sequence

ABORTED = -2  # the token of a row whose logits or probabilities were NaN or inf: its request ends alone, "abort"


def greedy_tokens(logits: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """Each row's argmax, or ABORTED for a row whose logits hold NaN or an infinity (its request then ends alone,
    with "abort", instead of taking whatever index the NaN sits at). On a GPU ``ops.argmax``, which spreads a row
    over the GPU (PyTorch's argmax reads a row with one thread block: 40 us for Llama 3's 128,256 logits on the
    H200) and checks the row in the same read; in the interpreter PyTorch's, the same indices
    (tests/ops/test_argmax.py) without a Triton program per row at milliseconds each. ``fused`` False (the engine's
    fused_ops feature off): PyTorch's everywhere."""
    if fused and runtime.on_gpu() and logits.is_cuda:
        return ops.argmax(logits, nonfinite=ABORTED)
    return torch.where(torch.isfinite(logits).all(dim=-1), logits.argmax(dim=-1), ABORTED)


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, in each row, the smallest set of most likely tokens whose probabilities sum to at least ``top_p``
    (ties at the boundary are kept), zero the rest, renormalise. probs: (B, V) float32; top_p: (B,).

    A token is kept when the probability mass of the tokens strictly more likely than it is below top_p: the most
    likely token is always kept, and the set stops at the first token that brings the sum to top_p or beyond.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above each one
    keep_sorted = mass_before < top_p[:, None]
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def min_p_filter(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min-p: zero, in each row, the tokens whose probability is below min_p times the row's largest (the
    most likely token always stays); renormalise. probs: (B, V) float32; min_p: (B,), 0 keeps every token."""
    kept = torch.where(probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True), probs, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def top_k_filter(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep, in each row, the logits at least as large as its k-th largest (ties at the boundary kept), the rest
    -inf. logits: (B, V); top_k: (B,) int64, 0 or -1 keeps every token."""
    vocab = logits.shape[-1]
    k = torch.where(top_k < 1, vocab, top_k.clamp(max=vocab))
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return torch.where(logits >= kth, logits, float("-inf"))


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row is drawn from: temperature, then min-p, top-k and top-p. logits: (B, V) float32."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    if any(p.min_p > 0 for p in params):
        probs = min_p_filter(torch.softmax(logits, dim=-1), torch.tensor([p.min_p for p in params], device=device))
        logits = torch.where(probs > 0, logits, float("-inf"))
    if any(p.top_k > 0 for p in params):
        logits = top_k_filter(logits, torch.tensor([p.top_k for p in params], device=device))
    return top_p_filter(torch.softmax(logits, dim=-1), torch.tensor([p.top_p for p in params], device=device))


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                   stop_ids: tuple[int, ...]) -> torch.Tensor:
    """One row's logits (V,) after vLLM's processors, in vLLM's order: ``min_tokens`` (``stop_ids`` -inf while
    fewer than min_tokens are out), ``logit_bias`` (added), then the penalties: ``repetition_penalty`` r on every
    token seen in the prompt or output (a positive logit divided by r, a negative one multiplied by it),
    ``frequency_penalty`` f times the token's count in the output and ``presence_penalty`` p once if it is there,
    subtracted. A new tensor; the raw logits (whose logprobs are reported) are left alone."""
    logits = logits.float().clone()
    vocab, device = logits.shape[-1], logits.device
    if len(output) < params.min_tokens and stop_ids:
        logits[torch.tensor(stop_ids, device=device)] = float("-inf")
    if params.logit_bias:
        tokens, biases = zip(*params.logit_bias)
        logits[torch.tensor(tokens, device=device)] += torch.tensor(biases, device=device)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long, device=device), minlength=vocab).float()
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        r = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()


def top_logprobs(logits: torch.Tensor, tokens: list[int], counts: list[int]) -> list[dict[int, Logprob]]:
    """For each row: the chosen token's log-probability and rank, and the ``counts[row]`` most likely tokens'
    (vLLM's raw logprobs: log_softmax of the model's logits, before temperature and filters). logits: (B, V)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(tokens, device=logits.device)[:, None]
    chosen_lp = logprobs.gather(-1, chosen)
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    best_lp, best = logprobs.topk(max(counts), dim=-1) if max(counts) else (logprobs[:, :0], chosen[:, :0])
    rows = []
    for row, (token, count) in enumerate(zip(tokens, counts)):
        entry = {token: Logprob(float(chosen_lp[row, 0]), int(ranks[row]))}
        for rank, (t, lp) in enumerate(zip(best[row, :count].tolist(), best_lp[row, :count].tolist()), start=1):
            entry.setdefault(t, Logprob(lp, rank))
        rows.append(entry)
    return rows


class Sampler:
    """Samples one token per row. Each request draws from its own generator, seeded with its SamplingParams.seed,
    so a request's tokens do not depend on which other requests share its batch."""

    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[int, torch.Generator] = {}
        self.errors: dict[int, str] = {}  # seq_id -> why its row failed (its token is ABORTED); the engine pops it

    def start(self, seq_id: int, seed: int | None) -> None:
        generator = torch.Generator(device=self.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        self._generators[seq_id] = generator

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)
        self.errors.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams],
                 greedy: torch.Tensor | None = None, check_all: bool = False,
                 histories: list[tuple[list[int], list[int]]] | None = None,
                 stop_ids: list[tuple[int, ...]] | None = None) -> torch.Tensor:
        """logits: (B, V) float32; greedy: (B,) each row's ``greedy`` token if the step computed it already (the
        engine's runner does, on the GPU, ABORTED where the row's logits are not finite). Returns the B token ids as
        a (B,) int64 tensor on the logits' device, without the host waiting for the GPU. A row whose logits
        (greedy) or probabilities (sampled) are not finite gets ABORTED instead of a token, as does a row whose
        own sampling raises (``errors``). ``check_all``: every row's logits checked here again, as
        LLM(check_kernels=True) asks. ``histories``: each row's (prompt, output) token ids and ``stop_ids`` its
        end tokens, for the rows whose params process their logits."""
        tokens = greedy_tokens(logits) if greedy is None else greedy
        processed = [i for i, p in enumerate(params) if p.processes_logits]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled or check_all or processed:  # rows overwrite their token (a copy: greedy may be a graph's output)
            tokens = tokens.clone()
        if check_all:
            tokens[~torch.isfinite(logits).all(dim=-1)] = ABORTED
        if processed:
            raw, logits = logits, logits.clone()

            def process(i):  # (a processor may set -inf: the model's own logits are the ones checked for NaN/inf)
                logits[i] = process_logits(raw[i], params[i], *histories[i], stop_ids[i])
                if params[i].greedy:
                    tokens[i] = torch.where(torch.isfinite(raw[i]).all(), logits[i].argmax(), ABORTED)
            self._alone(processed, seq_ids, tokens, process)
        sampled = [i for i in sampled if seq_ids[i] not in self.errors]
        if sampled:
            self._sample(logits, tokens, sampled, seq_ids, params)
        return tokens

    def keep_logprobs(self, seqs: list[Sequence], logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The logprobs of the step's new tokens, for the sequences that ask (the host waits for their tokens); a
        row whose logprobs fail gets ABORTED and its error kept, as a row whose sampling fails. Returns the step's
        tokens (a copy if a row was ABORTED here: ``tokens`` may be a graph's output)."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None and seq.seq_id not in self.errors]

        def keep(group: list[int]) -> None:
            chosen = tokens[group].tolist()
            entries = top_logprobs(logits[group], [max(t, 0) for t in chosen],
                                   [seqs[i].params.logprobs for i in group])
            for i, token, entry in zip(group, chosen, entries):
                seqs[i].logprobs = (seqs[i].logprobs or []) + ([entry] if token != ABORTED else [])
        try:
            if rows:
                keep(rows)
        except Exception:  # one row's failure: each alone
            tokens = tokens.clone()
            self._alone(rows, [seq.seq_id for seq in seqs], tokens, lambda i: keep([i]))
        return tokens

    def _sample(self, logits, tokens, rows: list[int], seq_ids: list[int], params: list[SamplingParams]) -> None:
        """Draw the sampled rows' tokens into ``tokens``: the filters batched, or row by row if the batch raises."""
        probs = {}
        try:
            probs.update(zip(rows, sampling_probs(logits[torch.tensor(rows, device=logits.device)],
                                                  [params[i] for i in rows])))
        except Exception:  # one row's failure: find it by running each alone (no generator has drawn yet)
            self._alone(rows, seq_ids, tokens, lambda i: probs.update({i: sampling_probs(logits[i:i + 1],
                                                                                         [params[i]])[0]}))

        def draw(i):
            finite = torch.isfinite(probs[i]).all()  # decided on the device: the host does not wait here
            row = torch.where(finite, probs[i], 1.0)  # (a drawable stand-in, replaced by ABORTED below)
            drawn = torch.multinomial(row, 1, generator=self._generators[seq_ids[i]])[0]
            tokens[i] = torch.where(finite, drawn, ABORTED)
        self._alone(list(probs), seq_ids, tokens, draw)

    def _alone(self, rows: list[int], seq_ids: list[int], tokens: torch.Tensor, work) -> None:
        """``work(i)`` for each row alone; a row whose work raises gets ABORTED and its error is kept in ``errors``
        (the exception goes no further: the other rows go on)."""
        for i in rows:
            if seq_ids[i] in self.errors:
                continue
            try:
                work(i)
            except Exception as error:
                tokens[i] = ABORTED
                self.errors[seq_ids[i]] = f"sampling failed: {type(error).__name__}: {error}"  # (or its logprobs)
