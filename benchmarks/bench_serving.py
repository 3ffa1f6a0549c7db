"""Lesson 07's load benchmark: OpenAI-compatible servers under Poisson traffic, through the real ``openai`` client.

    python benchmarks/bench_serving.py --out lessonlib/results/serving-h200.json

Servers, each started here as its own process on the same model, on loopback, one at a time:
``python -m lessonlib.engine.serve`` with chunked prefill and without it (``--enable-chunked-prefill`` /
``--no-enable-chunked-prefill``: ``Features.chunked_prefill``), and transformers' own server,
``transformers serve --continuous-batching`` (it needs ``accelerate``).
The model: a Llama-3.2-1B-shaped random-weight checkpoint (hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192)
with the course's tiny tokenizer (``lessonlib.tiny_model``: a 512-token vocabulary, so the output head is small and
the text is nonsense; nothing downloaded), served in bfloat16.

Traffic: for each request rate, REQUESTS requests whose arrival times are a seeded Poisson process; prompt lengths
and output lengths drawn from a seeded distribution (the same requests for every server); a ``shared prefix``
variant gives every prompt the same long opening (the prefix cache's case). Each request streams (``stream=True``)
and asks for usage; ``ignore_eos`` is sent to the course's server only (transformers refuses unknown fields; random
weights rarely meet the end-of-sequence token, and the output tokens are counted from each answer's usage anyway).
Every rate is bounded in count and in time (RATE_DEADLINE_S): a request not finished by then is cancelled and
counted as failed.

Recorded per (server, workload, rate): time to first token, inter-token latency (the gaps between a stream's
chunks, pooled) and end-to-end latency, each at p50/p90/p99 in milliseconds, output tokens/s (all output tokens /
from the first arrival to the last completion), completed and failed requests. A server that fails to start or
to answer is recorded with its error.

``--smoke`` (any machine, CPU included): the course's tiny model, the course's server with every kernel off
(``--plain-pytorch``), a handful of short requests at two rates; the peer is started only with ``--smoke-peer``
(transformers' server takes a minute to start on a busy CPU; on a machine whose cores were shared with other
heavy jobs it once answered each streamed completion with status 200 and closed the stream without a chunk, which is
recorded as failed requests with the tail of the server's log; on a quieter machine it answered every request).
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import socket
import subprocess
import tempfile
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lessonlib import bench, tiny_model  # noqa: E402
from lessonlib.results import Benchmark, Impl, Op  # noqa: E402

RATES = (2.0, 8.0, 32.0, 128.0)  # requests per second
REQUESTS = 100  # per rate and workload: about a minute of arrivals per workload and server, all rates together
PROMPT_WORDS = (32, 512)  # prompt lengths, words of the course's text (about a token each), log-uniform
OUTPUT_TOKENS = (16, 256)  # max_tokens, log-uniform
SHARED_PREFIX_WORDS = 384  # the shared-prefix workload's common opening
RATE_DEADLINE_S = 120.0
STARTUP_S = 600.0
LLAMA_1B = dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, architecture="llama")
SMOKE = dict(rates=(2.0, 8.0), requests=4, prompt_words=(3, 12), output_tokens=(2, 4), shared_prefix_words=16,
             deadline_s=120.0)


@dataclass
class Request:
    arrival: float  # seconds after the rate's start
    prompt: str
    max_tokens: int


def workload(rate: float, count: int, prompt_words, output_tokens, prefix_words: int, seed: str) -> list[Request]:
    """``count`` requests with Poisson arrivals at ``rate``, lengths log-uniform in the given ranges (seeded: the
    same requests for every server); ``prefix_words`` > 0 opens every prompt with the same text."""
    rng = random.Random(seed)
    words = tiny_model.CORPUS.split()

    def text(n):
        return " ".join(rng.choice(words) for _ in range(n))

    def log_uniform(lo, hi):
        return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))

    prefix = text(prefix_words) + " " if prefix_words else ""
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(Request(t, prefix + text(log_uniform(*prompt_words)), log_uniform(*output_tokens)))
    return out


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(math.ceil(q * len(ordered))) - 1)]  # nearest rank
    return {f"p{int(q * 100)}": round(pick(q) * 1e3, 3) for q in (0.5, 0.9, 0.99)}


async def one_request(client, model: str, request: Request, start: float, extra: dict) -> dict:
    await asyncio.sleep(max(0.0, start + request.arrival - time.perf_counter()))
    sent = time.perf_counter()
    chunks, tokens = [], None
    stream = await client.completions.create(model=model, prompt=request.prompt, max_tokens=request.max_tokens,
                                             temperature=0.0, stream=True, stream_options={"include_usage": True},
                                             extra_body=extra)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            chunks.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    done = time.perf_counter()
    return {"ttft": chunks[0] - sent if chunks else None, "itl": [b - a for a, b in zip(chunks, chunks[1:])],
            "e2e": done - sent, "tokens": tokens if tokens is not None else len(chunks), "done": done}


async def run_rate(base_url: str, model: str, requests: list[Request], deadline_s: float, extra: dict) -> dict:
    """Send every request at its arrival time, streamed; the measurements, bounded by ``deadline_s``."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=deadline_s)
    start = time.perf_counter()
    tasks = [asyncio.ensure_future(one_request(client, model, r, start, extra)) for r in requests]
    await asyncio.wait(tasks, timeout=deadline_s)
    finished, errors = [], []
    for task in tasks:
        if not task.done():
            task.cancel()
            errors.append("deadline")
        elif task.exception() is not None:
            errors.append(f"{type(task.exception()).__name__}: {task.exception()}"[:200])
        else:
            finished.append(task.result())
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    tokens = sum(r["tokens"] for r in finished)
    span = max((r["done"] for r in finished), default=start) - start - min(r.arrival for r in requests)
    return {"ttft_ms": percentiles([r["ttft"] for r in finished if r["ttft"] is not None]),
            "itl_ms": percentiles([g for r in finished for g in r["itl"]]),
            "e2e_ms": percentiles([r["e2e"] for r in finished]),
            "output_tokens_per_s": round(tokens / span, 2) if finished and span > 0 else None, "output_tokens": tokens,
            "completed": len(finished), "failed": len(errors), "first_error": errors[0] if errors else None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free loopback port, up once /health answers; stopped on exit (always)."""

    def __init__(self, command: list[str], log: Path):
        self.command, self.log, self.port = command, log, free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        import httpx

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen([*self.command, "--port", str(self.port)], cwd=ROOT, env=env,
                                        stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.__exit__()
                raise RuntimeError(f"exited with {self.process.returncode}: {self.log.read_text()[-400:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"no answer on /health within {STARTUP_S:.0f} s")

    def __exit__(self, *exc):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def servers(model: Path, smoke: bool, peer: bool) -> dict[str, tuple[list[str] | None, dict, str | None]]:
    """impl -> (the command without --port, the extra request fields it takes, why it is not run)."""
    from lessonlib.engine.serve.__main__ import features

    ours = [sys.executable, "-m", "lessonlib.engine.serve", "--model", str(model), "--served-model-name", "model",
            "--host", "127.0.0.1"]
    ours += ["--dtype", "auto", "--plain-pytorch", "--max-model-len", "256"] if smoke else ["--dtype", "bfloat16"]
    table = {}
    for impl, chunked in ((Impl.SERVER_CHUNKED_PREFILL, True), (Impl.SERVER_NO_CHUNKED_PREFILL, False)):
        try:
            features(chunked)
            flag, why = ("--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill"), None
        except ValueError as error:  # the engine has no chunked-prefill switch yet: the server as it is, once
            flag, why = None, (str(error) if chunked else None)
        table[impl] = (ours + ([flag] if flag else []), {"ignore_eos": True}, why)
    cli = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; sys.exit(main())"
    hf = [sys.executable, "-c", cli, "serve", "--continuous-batching", "--host",
          "127.0.0.1", "--dtype", "auto" if smoke else "bfloat16", str(model)]
    table[Impl.HF_SERVE] = (hf, {}, None if peer else "not run in --smoke (add --smoke-peer)")
    return table


def serve_and_load(run: bench.Run, impl: str, command, extra: dict, model_name: str, sizes: dict, log: Path) -> None:
    """Start one server, send every workload at every rate, record each; a failure is recorded with its error."""
    kinds = (("random", 0), ("shared prefix", sizes["shared_prefix_words"]))
    try:
        with Server(command, log) as server:
            # Warm-up, not recorded: a server's first requests pay for compilation and lazy loading (transformers'
            # first streamed answers on CPU took seconds longer than the later ones).
            warm = workload(100.0, 4, sizes["prompt_words"], sizes["output_tokens"], 0, seed="warm-up")
            asyncio.run(run_rate(server.url, model_name, warm, sizes["deadline_s"], extra))
            for kind, prefix in kinds:
                for rate in sizes["rates"]:
                    requests = workload(rate, sizes["requests"], sizes["prompt_words"], sizes["output_tokens"],
                                        prefix, seed=f"{kind} {rate}")
                    measured = asyncio.run(run_rate(server.url, model_name, requests, sizes["deadline_s"], extra))
                    if not measured["completed"]:  # the server's own account of it, for the record
                        measured["server_log_tail"] = log.read_text(errors="replace")[-600:]
                    run.add(Op.SERVING, impl, {"rate": rate, "requests": len(requests), "workload": kind},
                            **measured)
    except Exception as error:  # the peer may not start or not answer here: recorded, the run goes on
        for kind, _ in kinds:
            run.add(Op.SERVING, impl, {"workload": kind}, error=bench._error(error))


def main() -> None:
    args = bench.parse_args(__doc__, "bench_serving.py", checkable=False,
                            flags={"--smoke-peer": "with --smoke: start transformers serve too"})
    run = bench.Run(Benchmark.SERVING, smoke=args.smoke)
    if args.smoke:
        model, sizes = tiny_model.build(), SMOKE
    else:
        model = tiny_model.build(tiny_model.default_path("llama").parent / "llama-1b-shaped", **LLAMA_1B)
        sizes = dict(rates=RATES, requests=REQUESTS, prompt_words=PROMPT_WORDS, output_tokens=OUTPUT_TOKENS,
                     shared_prefix_words=SHARED_PREFIX_WORDS, deadline_s=RATE_DEADLINE_S)
    run.notes.update(sizes=sizes, model=str(model))
    logs = Path(tempfile.mkdtemp(prefix="bench_serving-"))  # each server's output; a failure's tail is recorded
    print("server logs in", logs, flush=True)
    for impl, (command, extra, why) in servers(model, args.smoke, peer=not args.smoke or args.smoke_peer).items():
        if why is not None:
            run.add(Op.SERVING, impl, {}, error=why)
            continue
        name = str(model) if impl == Impl.HF_SERVE else "model"  # transformers serves a model by its path
        serve_and_load(run, impl, command, extra, name, sizes, logs / f"{impl.split(',')[0].replace(' ', '_')}.log")
    run.save(args.out, {"bandwidth_gbs": None, "matmul_tflops": None})


if __name__ == "__main__":
    main()
