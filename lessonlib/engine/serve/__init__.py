"""An OpenAI-compatible server over the engine (lesson 07), on FastAPI and uvicorn (the optional ``serve`` extra:
``pip install lessonlib[serve]``), started with vLLM's flags:

    python -m lessonlib.engine.serve --model PATH [--host 127.0.0.1] [--port 8000] [--served-model-name NAME]

    protocol.py   the request bodies (every OpenAI/vLLM field implemented or refused), OpenAI's error body, the
                  mapping onto SamplingParams
    metrics.py    /metrics under vLLM's names: requests running and waiting, KV-cache use, preemptions, prefix-cache
                  queries and hits, TTFT, ITL, TPOT, end-to-end and queue time, requests ended by reason
    app.py        the routes: /v1/completions, /v1/chat/completions (streamed as server-sent events or whole),
                  /v1/models, /health, /metrics
    __main__.py   the command line: the engine, the app, uvicorn

The engine never imports this package; this package imports the engine.
"""

from lessonlib.engine.serve.app import build_app

__all__ = ["build_app"]
