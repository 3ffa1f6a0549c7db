"""``python -m lessonlib.engine.serve --model PATH``: the engine behind an OpenAI-compatible HTTP server (uvicorn).

The flags are vLLM's (``vllm serve``) where the engine has the setting. Loopback by default, as vLLM's docs advise
for a server with no authentication.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from lessonlib.engine.features import PLAIN_PYTORCH, Features

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lessonlib.engine.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="a local checkpoint folder (Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None, dest="num_blocks",
                        help="the KV pool's size in blocks (default: what memory allows)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (Features.cuda_graphs off)")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--plain-pytorch", action="store_true",
                        help="every course kernel off (the ladder's first rung): the CPU tests' fast server")
    parser.add_argument("--uvicorn-log-level", default="warning")
    args = parser.parse_args(argv)
    if not Path(args.model).is_dir():
        parser.error(f"--model {args.model}: not a folder (the server loads local checkpoints only)")
    args.features = features(args.enable_chunked_prefill, args.plain_pytorch, cuda_graphs=not args.enforce_eager)
    return args


def features(chunked_prefill: bool | None, plain_pytorch: bool = False, cuda_graphs: bool = True) -> Features:
    """The engine's switches for this server: the defaults (or every kernel off), with chunked prefill as asked and
    CUDA graphs off if asked (vLLM's ``--enforce-eager``)."""
    base = PLAIN_PYTORCH if plain_pytorch else Features()
    base = dataclasses.replace(base, cuda_graphs=base.cuda_graphs and cuda_graphs)
    if chunked_prefill is None:
        return base
    return dataclasses.replace(base, chunked_prefill=chunked_prefill)


def main(argv=None) -> None:
    args = parse_args(argv)
    from lessonlib.engine import LLM
    from lessonlib.engine.async_llm import AsyncLLM
    from lessonlib.engine.serve.app import build_app

    llm = LLM(model=args.model, dtype=args.dtype, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, num_blocks=args.num_blocks,
              max_num_batched_tokens=args.max_num_batched_tokens, features=args.features)
    engine = AsyncLLM(llm)
    app = build_app(engine, args.served_model_name or args.model)
    print(f"serving {args.model} on http://{args.host}:{args.port}/v1", flush=True)
    server(engine, app, host=args.host, port=args.port, log_level=args.uvicorn_log_level).run()


def server(engine, app, **config):
    """A uvicorn server for ``app`` whose shutdown first aborts every request: each stream ends at once with an error
    event and [DONE], instead of being cut when uvicorn's grace period (5 s) runs out."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            engine.abort_all("the server is shutting down")
            await super().shutdown(sockets)

    return Server(uvicorn.Config(app, timeout_graceful_shutdown=5, **config))


if __name__ == "__main__":
    main()
