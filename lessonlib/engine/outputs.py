"""From finished sequences to what ``LLM.generate`` returns (vLLM's RequestOutput / CompletionOutput), and the stop
conditions read on the detokenized text.

A stop string is matched on the text of the tokens generated so far (``skip_special_tokens``), after each new
token; the request ends at the first step whose text contains one. As in vLLM the token ids keep every generated
token (the last one completed the stop string) while the text is cut just before the stop string, or just after it
with ``include_stop_str_in_output``.
"""

from __future__ import annotations

from dataclasses import replace

from lessonlib.engine.sequence import CompletionOutput, RequestOutput, SamplingParams, Sequence


def output_text(tokenizer, seq: Sequence) -> str | None:
    """The generated text: every output token, detokenized (None without a tokenizer)."""
    return tokenizer.decode(seq.output_token_ids, skip_special_tokens=True) if tokenizer is not None else None


def find_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` and where it starts; None if there is none."""
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found, key=lambda hit: (hit[0], -len(hit[1]))) if found else None


def stop_reason(tokenizer, params: SamplingParams, output_ids: list[int]) -> int | str | None:
    """What ends a sequence whose generated tokens are ``output_ids`` at the last of them, besides end-of-sequence
    and length: one of its stop_token_ids (that id), or a stop string now in its text (that string); else None."""
    if output_ids[-1] in params.stop_token_ids:
        return output_ids[-1]
    if params.stop and tokenizer is not None:
        hit = find_stop(tokenizer.decode(output_ids, skip_special_tokens=True), params.stop)
        return hit[1] if hit else None
    return None


def completion(tokenizer, seq: Sequence, index: int) -> CompletionOutput:
    text = output_text(tokenizer, seq)
    if isinstance(seq.stop_reason, str) and text is not None:
        start, stop = find_stop(text, (seq.stop_reason,))
        text = text[:start + len(stop)] if seq.params.include_stop_str_in_output else text[:start]
    logprobs = None
    if seq.logprobs is not None:
        decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else (lambda t: None)
        logprobs = [{t: replace(lp, decoded_token=decode(t)) for t, lp in entry.items()} for entry in seq.logprobs]
    return CompletionOutput(index, text, list(seq.output_token_ids), seq.finish_reason, seq.stop_reason, logprobs)


def request_output(tokenizer, seqs: list[Sequence]) -> RequestOutput:
    """One request's output from its ``n`` sequences (same prompt), in the order they were made."""
    first = seqs[0]
    return RequestOutput(first.seq_id, first.prompt, first.token_ids[:first.num_prompt_tokens],
                         [completion(tokenizer, seq, i) for i, seq in enumerate(seqs)],
                         num_cached_tokens=first.num_prompt_cached_tokens,
                         num_preemptions=sum(seq.num_preemptions for seq in seqs))
