"""The engine tests' shared checkpoint and engine: the course's tiny model, and one LLM over it per test module
(module scope: each module importing these gets its own)."""

import pytest
import torch

from lessonlib import runtime, tiny_model
from lessonlib.engine import LLM

DTYPE = runtime.dtype(cpu=torch.float32)  # float32 in the interpreter; the GPU runs 16-bit


@pytest.fixture(scope="module")
def path():
    return tiny_model.build()


@pytest.fixture(scope="module")
def llm(path):
    return LLM(model=str(path), dtype=DTYPE, max_num_seqs=8, num_blocks=32, max_model_len=256)
