"""Issue 44 on the engine's side: a request is refused before it is queued (vLLM's bounds, token ids strictly ints
in the vocabulary), a request whose sampling fails ends alone with its reason while the batch goes on, the logits
processors follow vLLM's formulas, a stream's text never holds what a stop string will cut, and a chat prompt holds
the template's BOS once."""

import asyncio
import random
import shutil

import pytest
import torch

from lessonlib.engine import LLM, SamplingParams
from lessonlib.engine import sampler as sampler_module
from lessonlib.engine.async_llm import AsyncLLM
from lessonlib.engine.chat import chat_prompts
from lessonlib.engine.requests import RequestLimits, check_params, prompt_ids
from lessonlib.engine.sampler import process_logits
from lessonlib.engine.features import PLAIN_PYTORCH
from tests.engine_fixtures import path  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def llm(path):
    """The request path is what is tested here, not the kernels: every course kernel off, so a step costs
    milliseconds instead of the interpreter's second."""
    return LLM(model=str(path), max_num_seqs=8, num_blocks=32, max_model_len=256, features=PLAIN_PYTORCH)


def greedy(max_tokens, **options):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **options)


@pytest.mark.parametrize("bad, error, message", [
    (dict(logprobs=21), ValueError, "logprobs"), (dict(n=129), ValueError, "n must"),
    (dict(presence_penalty=2.5), ValueError, "presence_penalty"), (dict(frequency_penalty=-3), ValueError, "freq"),
    (dict(repetition_penalty=0.0), ValueError, "repetition"), (dict(min_tokens=5, max_tokens=4), ValueError, "min_"),
    (dict(logit_bias={"3": 1.0}), TypeError, "logit_bias"), (dict(logit_bias={3: 101}), ValueError, "logit_bias"),
    (dict(logit_bias={True: 1}), TypeError, "logit_bias"), (dict(stop_token_ids=[True]), TypeError, "stop_token")])
def test_sampling_params_refuse_vllms_out_of_bounds_values(bad, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**bad)


def test_seed_minus_one_is_no_seed_as_in_vllm():
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2


def test_the_vocabulary_bounds_are_checked_before_anything_is_queued():
    vocab = random.randrange(5, 20)
    limits = RequestLimits(vocab, 64, 10_000)
    with pytest.raises(ValueError, match="logprobs"):
        check_params(SamplingParams(logprobs=vocab + 1), vocab)
    with pytest.raises(ValueError, match="stop_token_ids"):
        check_params(SamplingParams(stop_token_ids=[vocab]), vocab)
    with pytest.raises(ValueError, match="logit_bias"):
        check_params(SamplingParams(logit_bias={vocab: 1.0}), vocab)
    for bad, error in [(["1", 2], TypeError), ([1.0, 2], TypeError), ([True, 2], TypeError), ([vocab], ValueError),
                       ([-1], ValueError), ([], ValueError), ([1] * 64, ValueError)]:
        with pytest.raises(error):
            prompt_ids(bad, None, limits)
    assert prompt_ids([torch.tensor(3).item(), 4], None, limits) == ([3, 4], None)
    with pytest.raises(ValueError, match="characters"):  # refused before the tokenizer sees it
        prompt_ids("x" * 10_001, object(), limits)


def test_a_lone_surrogate_is_refused_before_tokenizing(llm):
    with pytest.raises(ValueError, match="Unicode"):
        llm.make_sequences("attention \ud800", SamplingParams())


def reference_processors(logits, params, prompt, output, stop_ids):
    """vLLM's logits processors, one token at a time (the formula the vectorised one must match)."""
    out = logits.double().tolist()
    for t in range(len(out)):
        if len(output) < params.min_tokens and t in stop_ids:
            out[t] = float("-inf")
            continue
        out[t] += dict(params.logit_bias).get(t, 0.0)
        if t in prompt or t in output:
            r = params.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        out[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty * (t in output)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("vocab", [1, 7, 123, 1000])
def test_the_logits_processors_follow_vllms_formulas(vocab):
    for _ in range(5):
        prompt = [random.randrange(vocab) for _ in range(random.randrange(1, 9))]
        output = [random.randrange(vocab) for _ in range(random.randrange(0, 9))]
        params = SamplingParams(max_tokens=20, min_tokens=random.randrange(0, 12),
                                presence_penalty=random.uniform(-2, 2), frequency_penalty=random.uniform(-2, 2),
                                repetition_penalty=random.choice([1.0, random.uniform(0.5, 2.0)]),
                                logit_bias={random.randrange(vocab): random.uniform(-100, 100) for _ in range(3)})
        logits = torch.randn(vocab) * 5
        stop_ids = (random.randrange(vocab),)
        got = process_logits(logits, params, prompt, output, stop_ids)
        want = reference_processors(logits, params, prompt, output, stop_ids)
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), finite)
        # float32 arithmetic of a few terms of size <= 100 + 5 * 8: a few ulps of 200, against the float64 formula
        torch.testing.assert_close(got[finite].double(), want[finite], rtol=0, atol=200 * 2**-23 * 8)


def test_logit_bias_and_min_tokens_steer_greedy_decoding(llm):
    eos = llm.config.eos_token_ids[0]
    favourite = random.randrange(3, llm.config.vocab_size)
    [out] = llm.generate("attention kernel", greedy(6, logit_bias={favourite: 100.0}))
    assert out.outputs[0].token_ids == [favourite] * 6
    min_tokens = random.randrange(1, 4)
    [out] = llm.generate("attention kernel", SamplingParams(temperature=0.0, max_tokens=8, min_tokens=min_tokens,
                                                            logit_bias={eos: 100.0}))
    assert out.outputs[0].token_ids[-1] == eos and len(out.outputs[0].token_ids) == min_tokens + 1
    assert out.outputs[0].finish_reason == "stop"
    assert llm.num_blocks_in_use() == 0


def test_a_request_whose_sampling_fails_ends_alone_and_the_batch_goes_on(llm, monkeypatch):
    prompts = ["attention kernel decode", "softmax tile query", "block cache page"]
    alone = llm.generate(prompts, greedy(5))
    real = sampler_module.sampling_probs
    poison = random.randrange(2**31)

    def failing(logits, params):
        if any(p.seed == poison for p in params):
            raise RuntimeError("planted failure")
        return real(logits, params)

    monkeypatch.setattr(sampler_module, "sampling_probs", failing)
    outs = llm.generate(prompts + ["key value"], [greedy(5)] * 3 + [SamplingParams(seed=poison, max_tokens=5)])
    assert [o.outputs[0].token_ids for o in outs[:3]] == [o.outputs[0].token_ids for o in alone]
    assert [o.outputs[0].finish_reason for o in outs[:3]] == ["length"] * 3
    bad = outs[3].outputs[0]
    assert bad.finish_reason == "abort" and "planted failure" in bad.error and bad.token_ids == []
    assert llm.num_blocks_in_use() == 0


def test_a_request_whose_logprobs_fail_ends_alone(llm, monkeypatch):
    real = sampler_module.top_logprobs
    marker = random.randrange(3, 21)  # the failing request's logprobs count

    def failing(logits, tokens, counts):
        if marker in counts:
            raise RuntimeError("planted logprobs failure")
        return real(logits, tokens, counts)

    monkeypatch.setattr(sampler_module, "top_logprobs", failing)
    good, bad = llm.generate(["attention kernel", "softmax tile"], [greedy(3, logprobs=2), greedy(3, logprobs=marker)])
    assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].logprobs) == 3
    assert bad.outputs[0].finish_reason == "abort" and "planted logprobs failure" in bad.outputs[0].error
    assert llm.num_blocks_in_use() == 0


def test_a_failed_step_ends_the_running_requests_and_the_waiting_ones_run_on(path, monkeypatch):
    llm = LLM(model=str(path), max_num_seqs=1, num_blocks=32, max_model_len=256, features=PLAIN_PYTORCH)
    [want] = llm.generate("softmax tile", greedy(4))
    real, calls = llm.runner.decode, []

    def failing(seqs, previous_rows=None):  # the batched model fails at the running request's second decode
        calls.append(len(seqs))
        if len(calls) == 2:
            raise RuntimeError("planted step failure")
        return real(seqs, previous_rows)

    monkeypatch.setattr(llm.runner, "decode", failing)

    async def run():
        engine = AsyncLLM(llm)

        async def last(outputs):
            try:
                return [out async for out in outputs][-1]
            except RuntimeError as error:
                return error
        # one seat: "a" runs, "b" waits for it
        ends = await asyncio.gather(last(engine.generate("attention kernel", greedy(6), "a")),
                                    last(engine.generate("softmax tile", greedy(4), "b")))
        await engine.shutdown()
        return ends

    running, waiting = asyncio.run(run())
    assert isinstance(running, RuntimeError) and "planted step failure" in str(running)
    assert waiting.finished and waiting.outputs[0].token_ids == want.outputs[0].token_ids
    assert llm.num_blocks_in_use() == 0 and not llm.has_unfinished_requests()


def stop_between(tokenizer, ids, span):
    """A stop string from the last character of a token k to the first of token k + span - 1 (it spans ``span``
    tokens) whose first occurrence in the text is there: a stream would show its first character a step early."""
    text = tokenizer.decode(ids)
    for k in random.sample(range(1, len(ids) - span), len(ids) - span - 1):
        pieces = [tokenizer.decode([t]) for t in ids[k:k + span]]
        stop = pieces[0][-1:] + "".join(pieces[1:-1]) + pieces[-1][:1]
        if text.find(stop) == len(tokenizer.decode(ids[:k + 1])) - 1 and all(pieces):
            return stop
    pytest.fail(f"no stop string spans {span} tokens of {text!r}")


@pytest.mark.parametrize("span", [2, 3])
@pytest.mark.parametrize("include", [False, True])
def test_a_streams_text_never_holds_what_a_stop_string_cuts(llm, span, include):
    prompt = "attention kernel softmax"
    [free] = llm.generate(prompt, greedy(12))
    stop = stop_between(llm.tokenizer, free.outputs[0].token_ids, span)
    params = greedy(12, stop=[stop], include_stop_str_in_output=include)
    [whole] = llm.generate(prompt, params)
    assert whole.outputs[0].finish_reason == "stop" and (stop in whole.outputs[0].text) == include

    async def stream():
        engine = AsyncLLM(llm)
        texts = [out.outputs[0].text async for out in engine.generate(prompt, params, "r")]
        await engine.shutdown()
        return texts

    texts = asyncio.run(stream())
    assert texts[-1] == whole.outputs[0].text
    assert all(texts[-1].startswith(text) for text in texts), texts  # each output a prefix of the final text


def test_a_stop_string_before_min_tokens_is_passed_over_as_vllm_does(llm):
    prompt = "attention kernel softmax"
    [free] = llm.generate(prompt, greedy(12))
    ids = free.outputs[0].token_ids
    stop = stop_between(llm.tokenizer, ids[:6], 2)  # spans two of the first six tokens, where it first occurs
    [early] = llm.generate(prompt, greedy(12, stop=[stop]))
    assert early.outputs[0].finish_reason == "stop" and len(early.outputs[0].token_ids) < 6
    [late] = llm.generate(prompt, greedy(12, stop=[stop], min_tokens=6))
    out = late.outputs[0]
    assert len(out.token_ids) >= 6 and out.token_ids == ids[:len(out.token_ids)]
    assert stop in out.text  # the early one stays in the text: the request ends at a later one, or by length
    if out.finish_reason == "stop":
        text = llm.tokenizer.decode(out.token_ids)
        assert text.count(stop) >= 2 and out.text == text[:text.rindex(stop)]


@pytest.fixture(scope="module")
def bos_path(path, tmp_path_factory):
    """The tiny checkpoint with a tokenizer that adds BOS (as Llama 3's and Mistral's do) and a chat template that
    writes it too."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("bos")
    for item in path.iterdir():
        shutil.copy(item, folder / item.name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    bos = "<|im_start|>"  # a special token the tiny vocabulary has, standing in for <|begin_of_text|>
    tokenizer.bos_token = bos
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))])
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    tokenizer.save_pretrained(folder)
    return folder


def test_a_chat_prompt_holds_the_templates_bos_once(bos_path):
    pytest.importorskip("fastapi", reason="the server is the optional 'serve' extra (pip install lessonlib[serve])")
    from lessonlib.engine.serve.app import _checked
    from lessonlib.engine.serve.protocol import ChatCompletionRequest, chat_turns

    llm = LLM(model=str(bos_path), max_num_seqs=2, num_blocks=8, max_model_len=128, features=PLAIN_PYTORCH)
    bos = llm.tokenizer.bos_token_id
    assert llm.tokenizer.encode("hi")[0] == bos  # the tokenizer adds BOS ...
    messages = [{"role": "user", "content": "attention kernel"}]
    [prompt] = chat_prompts(llm.tokenizer, messages, None, True)
    body = ChatCompletionRequest(model="m", messages=messages, max_tokens=2)
    seqs, _, _ = _checked(llm, body, chat_turns(body.messages), chat=True)
    for ids in (prompt["prompt_token_ids"], seqs[0].token_ids):  # ... and the template wrote it: once, first
        assert ids[0] == bos and ids.count(bos) == prompt["prompt"].count("<|im_start|>")


def test_a_checkpoint_without_a_chat_template_is_refused(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], greedy(1))
