"""Lesson 07's engine on each checkpoint family it loads (Llama 3, Qwen2, Qwen3, Mistral), against transformers'
FULL forward (no KV cache, one forward per new token, float64): ``generate`` is no oracle (benchmarks/experiments/generate_oracle.py,
"generate is not the oracle"). Then what it refuses: every config field whose math it does not implement, and
every checkpoint tensor that does not match the model by name and shape, each with its own clear error.

Tiny models with wide logit margins (lessonlib.tiny_model): greedy tokens must match exactly, in float32 in the
interpreter, and in the GPU's 16-bit dtype on a GPU (a difference there names the tokens: a near tie or a bug).
Cost: in the interpreter every kernel launch costs tens of milliseconds, and a flash_attention prefill of 2,000
tokens did not end in 10 minutes. So there the short prompts run every kernel (one layer, two new tokens), and the
long prompts (one per length class, across the families) the plain-PyTorch rung: what they test is the positions,
RoPE tables and scaling past 256, 1,024 and 2,048 tokens, and the prefix cache over a long cached prefix. On a GPU
the long prompts run every kernel.
"""

import json
import random

import pytest
import torch

from lessonlib import runtime, serving, tiny_model
from lessonlib.engine import LLM, ModelConfig
from lessonlib.engine.features import PLAIN_PYTORCH
from tests.conftest import with_random_biases

DTYPE = runtime.dtype(cpu=torch.float32)  # float32 in the interpreter; a GPU's 16-bit dtype (float32 would be TF32)
LONG_PROMPT_FEATURES = None if runtime.on_gpu() else PLAIN_PYTORCH  # every kernel on a GPU (module docstring)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One-layer tiny checkpoints, built once per test session; qwen2's q/k/v biases drawn (tests.conftest)."""
    root = tmp_path_factory.mktemp("families")
    built = {family: tiny_model.build(root / family, architecture=family, num_layers=1)
             for family in ("qwen2", "llama3", "qwen3", "mistral")}
    return {**built, "qwen2": with_random_biases(built["qwen2"])}


def random_prompt(length: int) -> list[int]:
    """Token ids drawn fresh each run, never the pad/eos id 0."""
    return [random.randrange(1, 512) for _ in range(length)]


def engine(path, max_model_len: int, features=None) -> LLM:
    return LLM(str(path), dtype=DTYPE, max_num_seqs=2, max_model_len=max_model_len,
               num_blocks=2 * -(-max_model_len // 16), features=features)


@pytest.mark.parametrize("family", ["llama3", "qwen3", "mistral"])
def test_each_family_on_every_kernel_gives_the_full_forward_tokens(checkpoints, family):
    path = checkpoints[family]
    serving.check_engine_greedy(engine(path, 64), path, [random_prompt(random.randrange(9, 40))], max_tokens=2)


@pytest.mark.parametrize("family, length", [("qwen2", 300), ("qwen3", 1031), ("llama3", 2061)])
def test_long_prompts_give_the_full_forward_tokens(checkpoints, family, length):
    path = checkpoints[family]
    llm = engine(path, length + 8, LONG_PROMPT_FEATURES)
    serving.check_engine_greedy(llm, path, [random_prompt(length)], max_tokens=2)


def test_a_long_cached_prefix_gives_the_full_forward_tokens(checkpoints):
    path = checkpoints["mistral"]
    llm = engine(path, 1200, LONG_PROMPT_FEATURES)
    prefix = random_prompt(1100)
    serving.check_engine_greedy(llm, path, [prefix], max_tokens=2)
    later = prefix + random_prompt(23)
    serving.check_engine_greedy(llm, path, [later], max_tokens=2)
    assert llm.steps[0].cached_tokens == 1100 // 16 * 16, "the second prompt did not reuse the cached prefix"


def test_llama3_rope_scaling_is_transformers_formula():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    theirs = LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_parameters=rope)
    ours = ModelConfig.from_dict({**theirs.to_dict(), "architectures": ["LlamaForCausalLM"]})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](theirs, "cpu")
    got = ours.rope_inverse_frequencies()
    plain = ModelConfig.from_dict({**theirs.to_dict(), "architectures": ["LlamaForCausalLM"],
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    assert not torch.allclose(got, plain.rope_inverse_frequencies()), "llama3 scaling changed no frequency"
    # transformers computes in float32: agreement to float32 rounding of each frequency
    torch.testing.assert_close(got.float(), want, rtol=4 * torch.finfo(torch.float32).eps, atol=0)


def test_a_llama_with_attention_bias_and_tied_embeddings_gives_the_full_forward_tokens(tmp_path):
    from transformers import AutoModelForCausalLM

    source = tiny_model.build(tmp_path / "plain", architecture="llama", num_layers=1)
    model = AutoModelForCausalLM.from_pretrained(source)
    config = model.config
    config.attention_bias = config.tie_word_embeddings = True
    torch.manual_seed(random.randrange(1000))
    biased = type(model)(config)
    biased.save_pretrained(tmp_path / "biased")
    with_random_biases(tmp_path / "biased")  # transformers' zero biases would test none
    saved = json.loads((tmp_path / "biased" / "config.json").read_text())
    assert saved["attention_bias"] is True and saved["tie_word_embeddings"] is True
    serving.check_engine_greedy(engine(tmp_path / "biased", 64, PLAIN_PYTORCH), tmp_path / "biased",
                                [random_prompt(13)], max_tokens=2)


BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 128, "intermediate_size": 512,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GemmaForCausalLM"]}, "unsupported architecture 'GemmaForCausalLM'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor=0.25"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported RoPE type 'yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "unsupported RoPE type 'linear'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor, high_freq_factor, original_max"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True}, "sliding-window"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
])
def test_config_fields_the_engine_does_not_implement_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ModelConfig.from_dict({**BASE, **change})


def test_mistral_sliding_window_shorter_than_max_model_len_is_refused(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints["mistral"], tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "sliding_window": 64}))
    with pytest.raises(ValueError, match="sliding_window=64 is smaller than max_model_len=128"):
        engine(folder, 128)
    assert engine(folder, 64).max_model_len == 64  # a window covering every position is served


def copy_checkpoint(source, folder):
    import shutil

    shutil.copytree(source, folder / "copy")
    return folder / "copy"


@pytest.mark.parametrize("damage, message", [
    ("drop", r"1 missing tensors: model\.layers\.0\.self_attn\.k_norm\.weight"),
    ("add", r"1 unexpected tensors: model\.layers\.0\.mlp\.gate_proj\.bias"),
    ("reshape", r"1 mis-shaped tensors: model\.layers\.0\.self_attn\.k_proj\.weight \[64, 128\]"),
])
def test_checkpoint_tensors_must_match_by_name_and_shape(checkpoints, tmp_path, damage, message):
    from safetensors.torch import load_file, save_file

    folder = copy_checkpoint(checkpoints["qwen3"], tmp_path)
    tensors = load_file(folder / "model.safetensors")
    layer = "model.layers.0."
    if damage == "drop":
        del tensors[layer + "self_attn.k_norm.weight"]
    elif damage == "add":
        tensors[layer + "mlp.gate_proj.bias"] = torch.zeros(512)
    else:  # half the rows: copy_ would have broadcast nothing here, but a (1, 128) row would broadcast silently
        tensors[layer + "self_attn.k_proj.weight"] = tensors[layer + "self_attn.k_proj.weight"][:64].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        engine(folder, 32)
