"""``python -m lessonlib.serving``: the seed's example as a script, on vLLM's default engine (a separate engine
process, spawned workers)."""

from lessonlib.serving.in_process import attention_backends
from lessonlib.serving.settings import SEED_PROMPTS, choose_model, engine_settings, require_vllm


def run_seed_example(max_tokens: int = 64) -> None:
    """The seed's example as a script: vLLM's default engine (a separate engine process, spawned workers)."""
    require_vllm()
    from vllm import LLM, SamplingParams

    settings = engine_settings(choose_model())
    llm = LLM(**settings)
    outputs = llm.generate(SEED_PROMPTS, SamplingParams(temperature=0.7, top_p=0.95, max_tokens=max_tokens, seed=0))
    for output in outputs:
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
    print("attention backends:", sorted(set(attention_backends(llm).values())))


if __name__ == "__main__":  # vLLM spawns its engine process: scripts need this guard
    run_seed_example()
