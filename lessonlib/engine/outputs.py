"""From finished sequences to what ``LLM.generate`` returns (vLLM's RequestOutput / CompletionOutput), and the stop
conditions read on the detokenized text.

A stop string is matched on the text of the tokens generated so far (``skip_special_tokens``), after each new
token; the request ends at the first step whose text contains one. As in vLLM the token ids keep every generated
token (the last one completed the stop string) while the text is cut just before the stop string, or just after it
with ``include_stop_str_in_output``.

One builder for both paths: ``LLM.generate``'s finished requests and ``AsyncLLM``'s outputs so far. An unfinished
sequence's text is what may be sent already (vLLM's detokenizer rule): a trailing partial UTF-8 character (``\ufffd``)
is held back until it completes, and, when stop strings are set and not kept in the output, so are the last
``len(longest stop) - 1`` characters, which could be the start of a stop string. So each output's text is a prefix of
the next one's and of the finished text: a stream's concatenated deltas equal ``LLM.generate``'s text.
"""

from __future__ import annotations

from dataclasses import replace

from lessonlib.engine.sequence import CompletionOutput, RequestOutput, SamplingParams, Sequence


def output_text(tokenizer, seq: Sequence) -> str | None:
    """The generated text: every output token, detokenized (None without a tokenizer)."""
    return tokenizer.decode(seq.output_token_ids, skip_special_tokens=True) if tokenizer is not None else None


def find_stop(text: str, stops: tuple[str, ...], new_from: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends past ``new_from`` (the text's length before its last token: a
    stop string is looked for where the new characters are, as vLLM's detokenizer does, so one that stood in the
    text before ``min_tokens`` were out never ends it later), and where it starts; None if there is none."""
    found = [(text.find(s, max(0, new_from - len(s) + 1)), s) for s in stops]
    found = [hit for hit in found if hit[0] >= 0]
    return min(found, key=lambda hit: (hit[0], -len(hit[1]))) if found else None


def _stop_in(tokenizer, stops: tuple[str, ...], output_ids: list[int]) -> tuple[int, str] | None:
    """The stop string the last of ``output_ids`` completed, and where it starts in their text."""
    text = tokenizer.decode(output_ids, skip_special_tokens=True)
    before = tokenizer.decode(output_ids[:-1], skip_special_tokens=True).rstrip("\ufffd")
    return find_stop(text, stops, len(before))


def stop_reason(tokenizer, params: SamplingParams, output_ids: list[int]) -> int | str | None:
    """What ends a sequence whose generated tokens are ``output_ids`` at the last of them, besides end-of-sequence
    and length: one of its stop_token_ids (that id), or a stop string its last token completed (that string); else
    None."""
    if output_ids[-1] in params.stop_token_ids:
        return output_ids[-1]
    if params.stop and tokenizer is not None:
        hit = _stop_in(tokenizer, params.stop, output_ids)
        return hit[1] if hit else None
    return None


def stop_holdback(params: SamplingParams) -> int:
    """How many trailing characters of an unfinished text are held back: they may begin a stop string."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(stop) for stop in params.stop) - 1


def completion(tokenizer, seq: Sequence, index: int, known: list[int] | None = None) -> CompletionOutput:
    """Sample ``index``'s output: finished, its whole text (cut at a stop string) and logprobs with their tokens
    decoded; unfinished, its ``known`` tokens (those that reached the host) and the text that may be sent."""
    if seq.finish_reason is None:  # (a stream's output so far)
        ids = list(seq.output_token_ids if known is None else known)
        text = tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd") if tokenizer is not None else None
        if text is not None:
            text = text[:max(0, len(text) - stop_holdback(seq.params))]
        logprobs = seq.logprobs[:len(ids)] if seq.logprobs is not None else None
        return CompletionOutput(index, text, ids, None, logprobs=logprobs)
    text = output_text(tokenizer, seq)
    if isinstance(seq.stop_reason, str) and text is not None:
        start, stop = _stop_in(tokenizer, (seq.stop_reason,), seq.output_token_ids)
        text = text[:start + len(stop)] if seq.params.include_stop_str_in_output else text[:start]
    logprobs = None
    if seq.logprobs is not None:
        decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else (lambda t: None)
        logprobs = [{t: replace(lp, decoded_token=decode(t)) for t, lp in entry.items()} for entry in seq.logprobs]
    return CompletionOutput(index, text, list(seq.output_token_ids), seq.finish_reason, seq.stop_reason, logprobs,
                            error=seq.error)


def request_output(tokenizer, seqs: list[Sequence], request_id=None,
                   known: list[list[int]] | None = None) -> RequestOutput:
    """One request's output from its ``n`` sequences (same prompt), in the order they were made; ``known``: each
    unfinished sample's tokens that reached the host (default: all it has)."""
    first = seqs[0]
    known = known or [None] * len(seqs)
    queued = first.first_scheduled_at - first.queued_at if first.first_scheduled_at and first.queued_at else None
    return RequestOutput(first.seq_id if request_id is None else request_id, first.prompt,
                         first.token_ids[:first.num_prompt_tokens],
                         [completion(tokenizer, seq, i, ids) for i, (seq, ids) in enumerate(zip(seqs, known))],
                         num_cached_tokens=first.num_prompt_cached_tokens,
                         num_preemptions=sum(seq.num_preemptions for seq in seqs),
                         finished=all(seq.finish_reason is not None for seq in seqs), queue_s=queued)
