"""Features.fused_decode_layer: the batch-1 decode step in six kernels per layer (ops.decode_gemv), against
transformers' full forward (float32 in the interpreter: token for token; a GPU's 16-bit dtype: the near-tie rule,
with CUDA graphs and PDL as the engine runs them), its kernel count from the profiler, and Qwen3's fallback."""

import random

import pytest
import torch

from lessonlib import ops, runtime, serving, tiny_model
from lessonlib.engine import LLM, Features, SamplingParams
from tests.conftest import with_random_biases

DTYPE = runtime.dtype(cpu=torch.float32)
FUSED = Features(fused_decode_layer=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """qwen2: biases on q, k, v (drawn), two layers; llama3: norm weights around 1, RoPE scaling; qwen3: q/k norm."""
    root = tmp_path_factory.mktemp("fused-decode")
    return {"qwen2": with_random_biases(tiny_model.build(root / "qwen2", architecture="qwen2")),
            **{family: tiny_model.build(root / family, architecture=family, num_layers=1)
               for family in ("llama3", "qwen3")}}


def engine(path, features, max_num_seqs=1):
    return LLM(str(path), dtype=DTYPE, max_num_seqs=max_num_seqs, max_model_len=64, num_blocks=8, features=features)


def count_calls(monkeypatch, name):
    calls = []
    original = getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *a, **k: calls.append(name) or original(*a, **k))
    return calls


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_the_fused_decode_step_gives_the_full_forward_tokens(checkpoints, family, monkeypatch):
    calls = count_calls(monkeypatch, "decode_qkv_rope_store_kv")
    prompt = [random.randrange(1, 512) for _ in range(random.randrange(5, 14))]
    llm = engine(checkpoints[family], FUSED)
    serving.check_engine_greedy(llm, checkpoints[family], [prompt], max_tokens=3)
    if not runtime.on_gpu():  # a GPU replays a captured graph: the Python calls happen once, at capture
        assert len(calls) == 2 * len(llm.model.layers)  # two decode steps, each layer once


def test_qwen3_keeps_the_unfused_path_and_its_tokens(checkpoints, monkeypatch):
    """Qwen3 normalizes each head of q and k between the product and RoPE: the fused kernel cannot, so the switch
    leaves its step alone (Features' rule), and the tokens stay right."""
    calls = count_calls(monkeypatch, "decode_qkv_rope_store_kv")
    path = checkpoints["qwen3"]
    serving.check_engine_greedy(engine(path, FUSED), path, [[random.randrange(1, 512) for _ in range(7)]], 2)
    assert calls == []


def decode_step_launches(llm) -> list[str]:
    """The Triton launches of one batch-1 decode step: a generate of two tokens (a prefill, then one decode step)
    minus a generate of one token (the same prefill), from torch.profiler's ``triton::`` labels (ops._common.launch
    names every launch in the interpreter)."""
    def launches(max_tokens):
        prompt = [random.randrange(1, 512) for _ in range(9)]  # shorter than a block: nothing cached between runs
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return [e.name for e in prof.events() if e.name.startswith("triton::")]

    prefill, both = launches(1), launches(2)
    for name in prefill:
        both.remove(name)
    return both


@pytest.mark.skipif(runtime.on_gpu(), reason="counts the interpreter's launch labels; on a GPU bench_engine.py "
                    "counts the kernels of the batch-1 graph with the profiler")
def test_the_fused_decode_step_takes_three_kernels_fewer_per_layer(checkpoints):
    path = checkpoints["qwen2"]
    layers = 2
    per_step = 2  # the final norm and the output head's gemv, once per step
    fused = decode_step_launches(engine(path, Features(fused_decode_layer=True, cuda_graphs=False)))
    today = decode_step_launches(engine(path, Features(cuda_graphs=False)))
    fused_per_layer, today_per_layer = (len(x) - per_step for x in (fused, today))
    assert fused_per_layer % layers == 0 and today_per_layer % layers == 0, (fused, today)
    assert fused_per_layer // layers <= 6
    assert today_per_layer // layers - fused_per_layer // layers == 3, (fused, today)  # 2 add_rms_norm, rope_store_kv
    assert fused.count("triton::_decode_gemv_kernel") == 4 * layers


@pytest.mark.parametrize("off", ["fused_ops", "gemv"])
def test_the_switch_leaves_the_step_alone_where_the_kernels_it_fuses_are_off(checkpoints, off, monkeypatch):
    """fused_decode_layer fuses the kernels of fused_ops and gemv: with either off, the step keeps that switch's
    plain way (Features' rule), and the tokens stay right."""
    features = Features(fused_decode_layer=True, **{off: False})
    assert not features.fuses_decode_layer and FUSED.fuses_decode_layer
    calls = count_calls(monkeypatch, "decode_qkv_rope_store_kv")
    path = checkpoints["llama3"]
    serving.check_engine_greedy(engine(path, features), path, [[random.randrange(1, 512) for _ in range(7)]], 2)
    assert calls == []
