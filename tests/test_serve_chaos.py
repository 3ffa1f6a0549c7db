"""One request never harms another (issue 44): the real server (``build_app`` over ``AsyncLLM`` under uvicorn) on a
loopback port, 32 streaming clients beside a stream of bad requests of every kind, clients that disconnect
mid-stream and one request whose sampling fails (injected). Every innocent stream ends with ``[DONE]`` and the text
``LLM.generate`` gives (stop strings spanning two and three tokens among them); every bad request gets its 4xx in
OpenAI's body; ``/health`` answers within a second throughout; ``/metrics`` counts each abort; no KV block is held
at the end.

In-process (a thread runs uvicorn), so the failure can be planted in the sampler; the tiny model with every course
kernel off, so a step costs milliseconds. Bounded: a fixed number of requests, each client with a timeout, the
whole run under RUN_S. Two more faults: one prompt whose tokenization takes SLOW_S (planted: the event loop must
not wait for it), and the server shut down while a stream runs (it must end with an error event and [DONE], not be
cut).
"""

import asyncio
import json
import random
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the server is the optional 'serve' extra (pip install lessonlib[serve])")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from lessonlib import tiny_model  # noqa: E402
from lessonlib.engine import LLM, SamplingParams  # noqa: E402
from lessonlib.engine import sampler as sampler_module  # noqa: E402
from lessonlib.engine.async_llm import AsyncLLM  # noqa: E402
from lessonlib.engine.chat import chat_prompts  # noqa: E402
from lessonlib.engine.features import PLAIN_PYTORCH  # noqa: E402
from lessonlib.engine.serve import build_app  # noqa: E402
from lessonlib.engine.serve.__main__ import server as graceful_server  # noqa: E402

MODEL = "tiny"
CLIENTS = 32
DISCONNECTS = 3
POISON_SEED = 424242  # the request whose sampling the test makes fail
RUN_S = 120  # the whole load, at most (it takes a few seconds)
HEALTH_S = 1.0
SLOW_S = 1.5  # the planted tokenization's time: longer than /health may take
WORDS = "attention key value block cache query tile softmax kernel decode prefill page".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llm():
    return LLM(model=str(tiny_model.build()), dtype="auto", max_model_len=384, num_blocks=256, max_num_seqs=64,
               features=PLAIN_PYTORCH)


def innocent_requests(llm, rng) -> list[dict]:
    """32 greedy requests (prompts shorter than a KV block: none is served from the prefix cache, so each is
    computed as offline), a third with a stop string that spans two or three tokens of its own output, and the
    text LLM.generate gives for each (the oracle, from the same engine, before it serves)."""
    requests = []
    for i in range(CLIENTS):
        prompt = " ".join(rng.choices(WORDS, k=rng.randrange(2, 6)))
        requests.append({"prompt": prompt, "max_tokens": rng.randrange(6, 20), "chat": i % 4 == 3})
    plain = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    prompts = [_prompt(llm, r) for r in requests]
    outs = llm.generate(prompts, plain)
    for i, (request, out) in enumerate(zip(requests, outs)):
        ids = out.outputs[0].token_ids
        if i % 3 == 0:  # a stop string made of the end of token k and the start of token k + span - 1
            k, span = rng.randrange(1, len(ids) - 3), 2 + i % 2
            pieces = [llm.tokenizer.decode([t]) for t in ids[k:k + span]]
            stop = pieces[0][-1:] + "".join(pieces[1:-1]) + pieces[-1][:1]
            request["stop"], request["include_stop_str_in_output"] = [stop], i % 2 == 0
    with_stop = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, stop=r.get("stop"),
                                include_stop_str_in_output=r.get("include_stop_str_in_output", False))
                 for r in requests]
    for request, out in zip(requests, llm.generate(prompts, with_stop)):
        request["expected"] = out.outputs[0].text
    return requests


def _prompt(llm, request):
    """The prompt LLM.generate gets: the text, or the conversation rendered as LLM.chat renders it."""
    if not request["chat"]:
        return request["prompt"]
    return chat_prompts(llm.tokenizer, [{"role": "user", "content": request["prompt"]}], None, True)[0]


def bad_requests(vocab: int) -> list[tuple[str, str, object, int]]:
    """(method, route, body, status): one of each kind the server must refuse (body bytes are sent raw)."""
    ok = {"model": MODEL, "prompt": "attention", "max_tokens": 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [({**ok, "logprobs": 21}, 400), ({**chat, "logprobs": True, "top_logprobs": 21}, 400),
             ({**ok, "n": 100000}, 400), ({**ok, "stop_token_ids": [vocab + 5]}, 400),
             ({**ok, "stop_token_ids": ["3"]}, 400), ({**ok, "prompt": [1.5, 2]}, 400),
             ({**ok, "prompt": [True, 2]}, 400), ({**ok, "prompt": [vocab]}, 400),
             ({**ok, "suffix": "x"}, 400), ({**ok, "best_of": 3}, 400), ({**ok, "echo": True, "logprobs": 1}, 400),
             ({**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
             ({**chat, "response_format": {"type": "json_object"}}, 400),
             ({**ok, "stream_options": {"include_usage": True}}, 400), ({**ok, "logit_bias": {str(vocab): 1}}, 400),
             ({**ok, "presence_penalty": 3}, 400), ({**ok, "model": "no-such-model"}, 404),
             ({**chat, "messages": []}, 400), ({**ok, "prompt": "attention \ud800"}, 400),
             ({**ok, "prompt": "attention " * 50_000}, 400), ({**ok, "max_tokens": 0}, 400)]
    out = [("POST", "/v1/chat/completions" if "messages" in body else "/v1/completions", body, status)
           for body, status in cases]
    return out + [("POST", "/v1/completions", b"\xff\xfe{}", 400), ("POST", "/v1/completions", b"{not json", 400),
                  ("POST", "/v1/completions", b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}', 413),
                  ("GET", "/v1/completions", None, 405), ("POST", "/v1/nothing", ok, 404)]


async def stream(client, request) -> tuple[str, list[str]]:
    route = "/v1/chat/completions" if request["chat"] else "/v1/completions"
    body = {"model": MODEL, "max_tokens": request["max_tokens"], "temperature": 0.0, "ignore_eos": True,
            "stream": True, **{k: request[k] for k in ("stop", "include_stop_str_in_output") if k in request}}
    body.update({"messages": [{"role": "user", "content": request["prompt"]}]} if request["chat"]
                else {"prompt": request["prompt"]})
    events = []
    async with client.stream("POST", route, json=body) as answer:
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    text = ""
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            text += choice["delta"].get("content") or "" if request["chat"] else choice["text"]
    return text, events


async def refused(client, method, route, body, status) -> None:
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()  # (\ud800 escaped)
    answer = await client.request(method, route, content=content, headers={"content-type": "application/json"})
    assert answer.status_code == status, (route, str(body)[:80], answer.status_code, answer.text[:200])
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error


async def disconnect(client) -> None:
    body = {"model": MODEL, "prompt": "attention kernel", "max_tokens": 300, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as answer:
        async for line in answer.aiter_lines():
            if line.startswith("data: "):
                break  # one chunk, then the connection closes with the request far from its end


async def poisoned(client) -> list[str]:
    body = {"model": MODEL, "prompt": "attention kernel", "max_tokens": 50, "temperature": 1.0, "seed": POISON_SEED,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as answer:
        return [line[len("data: "):] async for line in answer.aiter_lines() if line.startswith("data: ")]


async def slow(client) -> None:
    answer = await client.post("/v1/completions", json={"model": MODEL, "prompt": "SLOW attention", "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


async def health_watch(client, done: asyncio.Event) -> float:
    worst = 0.0
    while not done.is_set():
        start = time.monotonic()
        assert (await client.get("/health", timeout=HEALTH_S * 5)).status_code == 200
        worst = max(worst, time.monotonic() - start)
        await asyncio.sleep(0.05)
    return worst


def aborts(text: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total" and sample.labels.get("finished_reason") == "abort":
                return sample.value
    return 0.0


async def load(url: str, requests, vocab: int):
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        before = aborts((await client.get("/metrics")).text)
        done = asyncio.Event()
        watch = asyncio.create_task(health_watch(client, done))
        bad = bad_requests(vocab)
        tasks = [asyncio.create_task(stream(client, r)) for r in requests]
        others = [asyncio.create_task(poisoned(client)), asyncio.create_task(slow(client))] + [
            asyncio.create_task(disconnect(client)) for _ in range(DISCONNECTS)]
        for case in bad:  # beside the streams, one after another
            await refused(client, *case)
        results = await asyncio.gather(*tasks)
        poisoned_events, *_ = await asyncio.gather(*others)
        done.set()
        worst = await watch
        # An abort is counted when the engine has let the request go: give the server's loop a moment to see it.
        deadline = time.monotonic() + 10
        while (after := aborts((await client.get("/metrics")).text)) < before + 1 + DISCONNECTS \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return results, poisoned_events, worst, after - before


async def shut_down_mid_stream(url: str, server) -> tuple[list[str], float]:
    """A long stream; once its first chunk is in, the server is told to stop. Its events, and how long the stream
    took to end after that."""
    body = {"model": MODEL, "prompt": "attention kernel", "max_tokens": 300, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    events, stopped = [], None
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=body) as answer:
            async for line in answer.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if stopped is None:
                        server.should_exit, stopped = True, time.monotonic()
    return events, time.monotonic() - stopped


def test_innocent_requests_survive_bad_ones_disconnects_and_a_failed_sampling(llm, monkeypatch):
    rng = random.Random()
    requests = innocent_requests(llm, rng)
    real = sampler_module.sampling_probs

    def failing_for_the_poisoned(logits, params):
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("injected sampling failure")
        return real(logits, params)

    monkeypatch.setattr(sampler_module, "sampling_probs", failing_for_the_poisoned)
    encode = llm.tokenizer.encode

    def slow_for_the_slow_one(text, *args, **kwargs):
        if "SLOW" in text:
            time.sleep(SLOW_S)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "encode", slow_for_the_slow_one)
    engine = AsyncLLM(llm)
    port = free_port()
    server = graceful_server(engine, build_app(engine, MODEL), host="127.0.0.1", port=port, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started
        url = f"http://127.0.0.1:{port}"
        results, poisoned_events, worst, counted = asyncio.run(
            asyncio.wait_for(load(url, requests, llm.config.vocab_size), RUN_S))
        blocks_after_load = llm.num_blocks_in_use()
        last_events, ending_s = asyncio.run(asyncio.wait_for(shut_down_mid_stream(url, server), RUN_S))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    for request, (text, events) in zip(requests, results):
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
        assert text == request["expected"], request
    assert poisoned_events[-1] == "[DONE]"
    error = json.loads(poisoned_events[-2])["error"]
    assert "injected sampling failure" in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert worst < HEALTH_S, f"/health took {worst:.2f} s"
    assert counted == 1 + DISCONNECTS  # the failed request and each disconnected one, once each
    assert blocks_after_load == 0 and llm.num_blocks_in_use() == 0 and llm.scheduler.is_finished()
    assert last_events[-1] == "[DONE]" and "shutting down" in json.loads(last_events[-2])["error"]["message"]
    assert ending_s < 3, f"the stream took {ending_s:.1f} s to end after the shutdown began"
    assert not thread.is_alive()
