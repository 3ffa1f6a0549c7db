"""Lesson 07's load benchmark: OpenAI-compatible servers under Poisson traffic, through the real ``openai`` client.

    python -m benchmarks.bench_serving --out lessonlib/results/serving-h200.json [--budget-s 300] [--logs DIR]

(on the lab's H200, with the carried wheels: ``bash tools/gpu_serving.sh``, which runs bench_chunked_prefill.py
first, so that this run finds Triton's kernels compiled.)

Servers, each started here as its own process on the same model, on loopback, one at a time:
``python -m lessonlib.engine.serve`` with chunked prefill and without it (``--enable-chunked-prefill`` /
``--no-enable-chunked-prefill``: ``Features.chunked_prefill``), and transformers' own server,
``transformers serve --continuous-batching`` (it needs ``accelerate``).
The model: a Llama-3.2-1B-shaped random-weight checkpoint (hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192)
with the course's tiny tokenizer (``lessonlib.tiny_model``: a 512-token vocabulary, so the output head is small and
the text is nonsense; nothing downloaded; its weights drawn on the GPU), served in bfloat16.

Traffic: for each request rate (RATES, doubling), about ARRIVAL_S seconds of requests (REQUESTS bounds the count)
whose arrival times are a seeded Poisson process; prompt lengths and output lengths drawn from a seeded
distribution (the same requests for every server); a ``shared prefix`` variant gives every prompt the same long
opening (the prefix cache's case), run after the random one if the server's time allows. Each request streams
(``stream=True``) and asks for usage; ``ignore_eos`` is sent to the course's server only (transformers refuses
unknown fields; random weights rarely meet the end-of-sequence token, and the output tokens are counted from each
answer's usage anyway: an early end only spares transformers work).

The plan fits ``--budget-s`` (BUDGET_S, issue 26's device call): each server gets a share of the time left when it
starts (start-up included), transformers' first and the largest (PEER_SHARE); a server's rates rise until one is past
its knee (a p99 time to first token of TTFT_KNEE_S or more, or a request the server failed: the higher rates would only
queue longer) or its share runs out. Each rate is bounded in count and in time (its arrivals plus DRAIN_S): a request
not finished by then is cancelled and counted as failed (``cut_by_deadline`` of them: not past the knee by itself), and
one still without its first token counts its wait so far as its TTFT. The run's notes hold issue 26's targets computed
from its records (``targets``); an interrupt still writes the file.

Recorded per (server, workload, rate), what ``vllm bench serve`` reports: time to first token (TTFT), time per
output token per request after its first (TPOT), inter-token latency per chunk (ITL: the gaps between a stream's
chunks, pooled) and end-to-end latency (E2EL), each as mean, median, p90 and p99 in milliseconds (``p50`` is the
median); output tokens/s (all output tokens / from the first arrival to the last completion) and its peak (the most
tokens in one second of the run, chunks counted); goodput (requests/s that met every SLO of GOODPUT_SLO_MS);
completed (successful) and failed requests; and whether ``ignore_eos`` was sent. A server that fails to start or
to answer is recorded with its error.

``--smoke`` (any machine, CPU included): the course's tiny model, the course's server with every kernel off
(``--plain-pytorch``), a handful of short requests at two rates; the peer is started only with ``--smoke-peer``
(transformers' server takes a minute to start on a busy CPU; on a machine whose cores were shared with other
heavy jobs it once answered each streamed completion with status 200 and closed the stream without a chunk, which is
recorded as failed requests with the tail of the server's log; on a quieter machine it answered every request).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import socket
import subprocess
import tempfile
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from lessonlib import bench, tiny_model
from lessonlib.results import Benchmark, Impl, Op

RATES = (2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)  # requests per second, geometric: brackets each knee
ARRIVAL_S = 5.0  # each rate sends about this many seconds of arrivals (rate x ARRIVAL_S requests) ...
REQUESTS = (10, 250)  # ... but at least and at most this many: a p99 of at least 10, a burst at the top rates
PROMPT_WORDS = (32, 512)  # prompt lengths, words of the course's text (about a token each), log-uniform
OUTPUT_TOKENS = (16, 256)  # max_tokens, log-uniform
SHARED_PREFIX_WORDS = 384  # the shared-prefix workload's common opening
DRAIN_S = 10.0  # after a rate's last arrival, how long its answers may take; then the rest count as failed
TTFT_KNEE_S = 2.0  # issue 26: a server's highest rate is the highest whose p99 TTFT stays under this
BUDGET_S = 300.0  # the whole run on the H200, model build and server start-ups included (issue 26)
PEER_SHARE = 1.5  # transformers' server's share of the budget against each of ours: its rates run to their drain
STARTUP_S = 180.0
WARM_UP_S = 30.0  # at most, for the 4 unrecorded requests a server gets first
LLAMA_1B = dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, architecture="llama")
SMOKE = dict(rates=(2.0, 8.0), requests=(4, 4), prompt_words=(3, 12), output_tokens=(2, 4), shared_prefix_words=16,
             arrival_s=2.0, drain_s=60.0)
FULL = dict(rates=RATES, requests=REQUESTS, prompt_words=PROMPT_WORDS, output_tokens=OUTPUT_TOKENS,
            shared_prefix_words=SHARED_PREFIX_WORDS, arrival_s=ARRIVAL_S, drain_s=DRAIN_S)
# issue 26's serving targets (the chunked-prefill latency target is bench_chunked_prefill.py's)
# vllm bench serve's --goodput: a request is good if its TTFT and TPOT are both within these (issue 26's TTFT knee;
# a TPOT of 100 ms, 10 tokens/s, is about reading speed for a user watching a stream)
GOODPUT_SLO_MS = {"ttft": TTFT_KNEE_S * 1e3, "tpot": 100.0}
TARGETS = dict(knee_rate_over_peer=2.0, latency_over_peer_at_its_knee=0.5, saturation_chunked_over_prefill_first=0.95)


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


def request_count(rate: float, sizes: dict) -> int:
    low, high = sizes["requests"]
    return max(low, min(high, round(rate * sizes["arrival_s"])))


def percentiles(values: list[float]) -> dict:
    """Seconds to milliseconds: mean, median (also as p50) and p90, p99 by nearest rank."""
    if not values:
        return {"mean": None, "median": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(math.ceil(q * len(ordered))) - 1)]  # nearest rank
    ranks = {f"p{int(q * 100)}": round(pick(q) * 1e3, 3) for q in (0.5, 0.9, 0.99)}
    return {"mean": round(sum(values) / len(values) * 1e3, 3), "median": ranks["p50"], **ranks}


def tpot(result: dict) -> float | None:
    """A finished request's time per output token after the first (vllm bench serve's TPOT), in seconds."""
    if result["ttft"] is None or result["tokens"] < 2:
        return None
    return (result["e2e"] - result["ttft"]) / (result["tokens"] - 1)


def peak_tokens_per_s(chunk_times: list[float]) -> int:
    """The most chunks (a token each, streamed one per engine step) that arrived within one second of the run."""
    if not chunk_times:
        return 0
    seconds = [math.floor(t - min(chunk_times)) for t in chunk_times]
    return max(seconds.count(s) for s in set(seconds))


def goodput(finished: list[dict], span: float) -> float | None:
    """Requests per second that met every SLO of GOODPUT_SLO_MS (vllm bench serve's --goodput)."""
    if not finished or span <= 0:
        return None
    good = [r for r in finished if r["ttft"] is not None and r["ttft"] * 1e3 <= GOODPUT_SLO_MS["ttft"]
            and (tpot(r) is None or tpot(r) * 1e3 <= GOODPUT_SLO_MS["tpot"])]
    return round(len(good) / span, 3)


async def one_request(client, model: str, request: Request, start: float, extra: dict, seen: dict) -> dict:
    """Send one streamed request at its arrival time; ``seen`` holds when it was sent and when each chunk with text
    came, for a request the deadline cuts short."""
    await asyncio.sleep(max(0.0, start + request.arrival - time.perf_counter()))
    seen["sent"] = sent = time.perf_counter()
    chunks, tokens = seen.setdefault("chunks", []), None
    stream = await client.completions.create(model=model, prompt=request.prompt, max_tokens=request.max_tokens,
                                             temperature=0.0, stream=True, stream_options={"include_usage": True},
                                             extra_body=extra)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            chunks.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    seen["done"] = done = time.perf_counter()
    return {"ttft": chunks[0] - sent if chunks else None, "e2e": done - sent,
            "tokens": tokens if tokens is not None else len(chunks), "done": done}


async def run_rate(base_url: str, model: str, requests: list[Request], deadline_s: float, extra: dict) -> dict:
    """Send every request at its arrival time, streamed; the measurements, bounded by ``deadline_s``. A request
    without its first token at the deadline counts with its wait so far as its TTFT (a lower bound:
    ``ttft_censored`` says how many), so a server that falls behind shows it in the TTFT tail."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=deadline_s)
    start = time.perf_counter()
    seen = [{} for _ in requests]
    tasks = [asyncio.ensure_future(one_request(client, model, r, start, extra, s)) for r, s in zip(requests, seen)]
    await asyncio.wait(tasks, timeout=deadline_s)
    cut = time.perf_counter()
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
    sent = [s for s in seen if "sent" in s]
    cut_short = [s for s in sent if not s["chunks"] and "done" not in s]  # no first token by the deadline (or error)
    ttfts = [s["chunks"][0] - s["sent"] for s in sent if s["chunks"]] + [cut - s["sent"] for s in cut_short]
    tokens = sum(r["tokens"] for r in finished)
    span = max((r["done"] for r in finished), default=start) - start - min(r.arrival for r in requests)
    return {"ttft_ms": percentiles(ttfts), "ttft_censored": len(cut_short),
            "tpot_ms": percentiles([t for t in map(tpot, finished) if t is not None]),
            "itl_ms": percentiles([b - a for s in sent for a, b in zip(s["chunks"], s["chunks"][1:])]),
            "e2e_ms": percentiles([r["e2e"] for r in finished]),
            "output_tokens_per_s": round(tokens / span, 2) if finished and span > 0 else None, "output_tokens": tokens,
            "peak_output_tokens_per_s": peak_tokens_per_s([t for s in sent for t in s["chunks"]]),
            "request_goodput": goodput(finished, span), "goodput_slo_ms": GOODPUT_SLO_MS,
            "completed": len(finished), "failed": len(errors), "cut_by_deadline": errors.count("deadline"),
            "first_error": errors[0] if errors else None, "ignore_eos": bool(extra.get("ignore_eos"))}


def past_knee(measured: dict) -> bool:
    """Whether a rate is past the server's knee: a p99 TTFT of TTFT_KNEE_S or more, or a request the server failed
    (an error). A request this benchmark's deadline cut short is not a failure of the server's: the knee is a TTFT
    rule, and a cut request's TTFT is counted (its wait so far, if it had no first token). On the H200 transformers'
    server answered every request at 2 requests/s with a p99 TTFT of 0.25 s, but one answer of 256 tokens at ~0.1 s
    each outlasted the 10 s drain: counted as a failure, it ended that server's rates at its lowest."""
    p99 = measured["ttft_ms"]["p99"]
    errors = measured["failed"] - measured.get("cut_by_deadline", 0)
    return errors > 0 or p99 is None or p99 >= TTFT_KNEE_S * 1e3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free loopback port, up once /health answers; stopped on exit (always)."""

    def __init__(self, command: list[str], log: Path, startup_s: float = STARTUP_S):
        self.command, self.log, self.port, self.startup_s = command, log, free_port(), startup_s
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        import httpx

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.began = time.monotonic()
        self.process = subprocess.Popen([*self.command, "--port", str(self.port)], cwd=ROOT, env=env,
                                        stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        try:
            self._wait_for_health(httpx)
        except BaseException:  # an interrupt too: the process is not left running
            self.__exit__()
            raise
        return self

    def _wait_for_health(self, httpx) -> None:
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"exited with {self.process.returncode}: {self.log.read_text()[-400:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.startup_s = round(time.monotonic() - self.began, 1)  # what it took
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"no answer on /health within {self.startup_s:.0f} s: {self.log.read_text()[-300:]}")

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
    # transformers' server first: it is the slowest, and the targets need its knee (a rate past it) more than
    # they need our servers' highest rates
    table = {Impl.HF_SERVE: None}
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


def serve_and_load(run: bench.Run, impl: str, command, extra: dict, model_name: str, sizes: dict, log: Path,
                   until: float) -> None:
    """Start one server, then each workload at rising rates until a rate is past the server's knee or the server's
    time (``until``, a time.monotonic() instant) runs out; each rate recorded. A failure is recorded with its
    error."""
    kinds = (("random", 0), ("shared prefix", sizes["shared_prefix_words"]))
    try:
        with Server(command, log, startup_s=min(STARTUP_S, until - time.monotonic())) as server:
            run.notes.setdefault("startup_s", {})[impl] = server.startup_s
            # Warm-up, not recorded: a server's first requests pay for compilation and lazy loading (transformers'
            # first streamed answers on CPU took seconds longer than the later ones).
            # Short answers: transformers' server streams about 10 tokens/s here, and the warm-up is time taken from
            # the rates.
            warm = workload(100.0, 4, sizes["prompt_words"], (2, 8), 0, seed="warm-up")
            asyncio.run(run_rate(server.url, model_name, warm, min(WARM_UP_S, until - time.monotonic()), extra))
            for kind, prefix in kinds:
                for rate in sizes["rates"]:
                    count = request_count(rate, sizes)
                    needed = count / rate + sizes["drain_s"]
                    if time.monotonic() + min(needed, 2 * count / rate + 1) > until:
                        print(f"{impl}, {kind}: no time left for {rate} requests/s", flush=True)
                        break
                    requests = workload(rate, count, sizes["prompt_words"], sizes["output_tokens"], prefix,
                                        seed=f"{kind} {rate}")
                    deadline = min(needed, until - time.monotonic())
                    measured = asyncio.run(run_rate(server.url, model_name, requests, deadline, extra))
                    if not measured["completed"]:  # the server's own account of it, for the record
                        measured["server_log_tail"] = log.read_text(errors="replace")[-600:]
                    run.add(Op.SERVING, impl, {"rate": rate, "requests": len(requests), "workload": kind},
                            **measured)
                    if past_knee(measured):  # the higher rates would only queue longer
                        break
    except Exception as error:  # the peer may not start or not answer here: recorded, the run goes on
        run.add(Op.SERVING, impl, {"workload": "random"}, error=bench._error(error))


def knee_rate(rows: list[dict]) -> float | None:
    """A server's highest rate whose p99 TTFT stays under TTFT_KNEE_S (every rate up to it too); None if even the
    lowest is past it. Only a lower bound if no rate was past the knee (``knee_reached``): the server's time ran out
    first."""
    best = None
    for row in sorted(rows, key=lambda r: r["shape"]["rate"]):
        if past_knee(row):
            break
        best = row["shape"]["rate"]
    return best


def knee_reached(rows: list[dict]) -> bool | None:
    """Whether a rate was past the server's knee; None if the server measured no rate."""
    return any(past_knee(row) for row in rows) if rows else None


def targets(records: list[dict]) -> dict:
    """Issue 26's serving targets, computed from the run's random-workload records: each of this server's two
    schedules against transformers' (the highest rate under the knee, and the p99 TTFT and ITL at transformers'
    highest such rate), and chunked prefill's throughput at saturation (the most output tokens/s over the rates)
    against prefill-first's."""
    rows = {impl: [r for r in records if r["impl"] == impl and r["shape"].get("workload") == "random"
                   and "error" not in r] for impl in (Impl.HF_SERVE, Impl.SERVER_CHUNKED_PREFILL,
                                                      Impl.SERVER_NO_CHUNKED_PREFILL)}
    peer_knee = knee_rate(rows[Impl.HF_SERVE])
    out = {"ttft_knee_s": TTFT_KNEE_S, "targets": TARGETS, "knee_rate": {i: knee_rate(r) for i, r in rows.items()},
           "knee_reached": {i: knee_reached(r) for i, r in rows.items()}}
    peer_reached = out["knee_reached"][Impl.HF_SERVE] is True
    for impl in (Impl.SERVER_CHUNKED_PREFILL, Impl.SERVER_NO_CHUNKED_PREFILL):
        ours, knee = {r["shape"]["rate"]: r for r in rows[impl]}, out["knee_rate"][impl]
        peer_at = next((r for r in rows[Impl.HF_SERVE] if r["shape"]["rate"] == peer_knee), None)
        verdict = {"knee_rate_over_peer": None, "met_knee": None, "met_latency_at_peer_knee": None}
        if peer_knee is not None and knee is not None:
            # An unreached knee is a lower bound: the ratio is then at most this (the peer's) or at least (ours),
            # and a verdict it cannot decide stays None.
            verdict["knee_rate_over_peer"] = knee / peer_knee
            if knee >= TARGETS["knee_rate_over_peer"] * peer_knee:
                verdict["met_knee"] = True if peer_reached else None
            else:
                verdict["met_knee"] = False if out["knee_reached"][impl] is True else None
        if peer_at is not None and peer_knee in ours:
            ratios = {k: ours[peer_knee][k]["p99"] / peer_at[k]["p99"] for k in ("ttft_ms", "itl_ms")
                      if ours[peer_knee][k]["p99"] is not None and peer_at[k]["p99"]}
            verdict["p99_over_peer_at_peer_knee"] = {k: round(v, 3) for k, v in ratios.items()}
            if peer_reached:  # else the peer's knee rate, where the target compares, is not known
                verdict["met_latency_at_peer_knee"] = len(ratios) == 2 and all(
                    v <= TARGETS["latency_over_peer_at_its_knee"] for v in ratios.values())
        out[impl] = verdict
    saturation = {impl: max((r["output_tokens_per_s"] or 0 for r in rows[impl]), default=0)
                  for impl in (Impl.SERVER_CHUNKED_PREFILL, Impl.SERVER_NO_CHUNKED_PREFILL)}
    out["saturation_output_tokens_per_s"] = saturation
    first = saturation[Impl.SERVER_NO_CHUNKED_PREFILL]
    ratio = saturation[Impl.SERVER_CHUNKED_PREFILL] / first if first else None
    out["saturation_chunked_over_prefill_first"] = round(ratio, 3) if ratio is not None else None
    out["met_saturation"] = None if ratio is None else ratio >= TARGETS["saturation_chunked_over_prefill_first"]
    return out


def build_model(smoke: bool) -> Path:
    """The course's tiny model (--smoke), or the Llama-3.2-1B-shaped one with the tiny tokenizer, its random weights
    drawn on the GPU (seconds, against a minute on the CPU), written in float32 and served in bfloat16."""
    if smoke:
        return tiny_model.build()
    import torch

    with torch.device("cuda"):
        path = tiny_model.build(tiny_model.default_path("llama").parent / "llama-1b-shaped", **LLAMA_1B)
    torch.cuda.empty_cache()  # the servers are other processes: this one keeps nothing on the GPU
    return path


def main() -> None:
    args = bench.parse_args(__doc__, "bench_serving.py", checkable=False,
                            flags={"--smoke-peer": "with --smoke: start transformers serve too"},
                            values={"--budget-s": (BUDGET_S, "seconds for the whole run, start-ups included"),
                                    "--logs": (None, "folder for the servers' logs (default: a temporary one)")})
    began = time.monotonic()
    run = bench.Run(Benchmark.SERVING, smoke=args.smoke)
    sizes = SMOKE if args.smoke else FULL
    model = build_model(args.smoke)
    run.notes.update(sizes=sizes, model=str(model), budget_s=args.budget_s, model_build_s=round(time.monotonic() -
                                                                                                 began, 1))
    logs = Path(args.logs or tempfile.mkdtemp(prefix="bench_serving-"))  # a failure's tail is also recorded
    logs.mkdir(parents=True, exist_ok=True)
    print("server logs in", logs, flush=True)
    table = list(servers(model, args.smoke, peer=not args.smoke or args.smoke_peer).items())
    try:
        for i, (impl, (command, extra, why)) in enumerate(table):
            if why is not None:
                run.add(Op.SERVING, impl, {}, error=why)
                continue
            # its share of the time left (transformers' the larger: each of its rates takes its whole drain)
            weights = [PEER_SHARE if later == Impl.HF_SERVE else 1.0 for later, (_, _, skip) in table[i:]
                       if skip is None]
            until = time.monotonic() + (began + args.budget_s - time.monotonic()) * weights[0] / sum(weights)
            name = str(model) if impl == Impl.HF_SERVE else "model"  # transformers serves a model by its path
            log = logs / f"{re.sub(r'[^a-z0-9]+', '_', impl)}.log"
            serve_and_load(run, impl, command, extra, name, sizes, log, until)
    finally:  # an interrupt (timeout -s INT) still writes what was measured
        run.notes["targets"] = targets(run.records)
        run.notes["seconds"] = round(time.monotonic() - began, 1)
        print("issue 26's serving targets:", json.dumps(run.notes["targets"], indent=1), flush=True)
        run.save(args.out, {"bandwidth_gbs": None, "matmul_tflops": None})


if __name__ == "__main__":
    main()
