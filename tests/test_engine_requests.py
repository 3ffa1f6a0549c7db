"""What a vLLM user asks of a request (issue 25): every SamplingParams checked before anything is queued; a request
whose probabilities are NaN/inf ends alone; top-k, min-p, stop strings and stop tokens, logprobs, n > 1, chat;
``check_kernels=True``. Against transformers where a number is involved, else hand-checked cases. Kept small: in
the interpreter a step of the tiny model costs about a second, so the cases share one engine and few steps."""

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from lessonlib import ops, runtime, tiny_model
from lessonlib.engine import LLM, SamplingParams, min_p_filter, top_k_filter
from lessonlib.engine import llm as llm_module
from lessonlib.engine.chat import chat_prompts
from lessonlib.engine.sampler import Sampler
from lessonlib.kv_cache import block_digest
from lessonlib.testing import check_close
from tests.engine_fixtures import llm, path  # noqa: F401 (fixtures)

DTYPE = runtime.dtype(cpu=torch.float32)
PROMPT = "The quick brown fox jumps over the lazy dog. Hello, my name is"


def greedy(max_tokens, **options):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **options)


def test_bad_requests_and_configs_are_refused_before_anything_is_queued(path, llm, monkeypatch):
    for bad, error, message in [
        (dict(seed=2**70), ValueError, "seed"), (dict(seed="abc"), TypeError, "seed"),
        (dict(seed=1.5), TypeError, "seed"), (dict(temperature=-1e-9), ValueError, "temperature"),
        (dict(temperature=float("nan")), TypeError, "temperature"), (dict(top_k=-2), ValueError, "top_k"),
        (dict(min_p=1.01), ValueError, "min_p"), (dict(n=0), ValueError, "n must"),
        (dict(max_tokens=0), ValueError, "max_tokens"), (dict(stop=["ok", 3]), TypeError, "stop"),
        (dict(stop=""), TypeError, "stop"), (dict(stop_token_ids=[2.0]), TypeError, "stop_token_ids"),
        (dict(logprobs=-1), ValueError, "logprobs"), (dict(ignore_eos=1), TypeError, "ignore_eos"),
    ]:
        with pytest.raises(error, match=message):
            SamplingParams(**bad)
    # vLLM's threshold: below 1e-5 a temperature is greedy (1e-45 would overflow the logits / temperature).
    assert SamplingParams(temperature=1e-45).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    # One bad request in a batch: nothing queued, the engine usable.
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate([PROMPT, PROMPT], [greedy(1), {"seed": 2**70}])
    with pytest.raises(ValueError, match="n > 1"):
        llm.add_request(PROMPT, greedy(1, n=2))
    assert not llm.has_unfinished_requests() and llm.num_blocks_in_use() == 0
    for option in (dict(max_model_len=0), dict(max_model_len=-3), dict(num_blocks=-1), dict(num_blocks=0)):
        with pytest.raises(ValueError, match=next(iter(option))):
            LLM(model=str(path), dtype=DTYPE, **option)
    # llm.steps keeps the latest records only: an add_request/step loop does not grow it without bound.
    monkeypatch.setattr(llm_module, "MAX_STEP_RECORDS", 2)
    for _ in range(3):
        llm.add_request([5, 6, 7], greedy(1))
        while llm.has_unfinished_requests():
            llm.step()
    assert len(llm.steps) == 2


def test_paged_attention_of_an_empty_batch_is_empty():
    heads, kv_heads, head_dim = 4, 2, 32
    device = runtime.device()  # the kernels' device: on a GPU, CPU tensors are refused before the batch is looked at
    cache = torch.randn(3, 16, kv_heads, head_dim, device=device)
    out = ops.paged_attention(torch.randn(0, heads, head_dim, device=device), cache, cache.clone(),
                              torch.zeros(0, 2, dtype=torch.int32, device=device),
                              torch.zeros(0, dtype=torch.int32, device=device))
    assert out.shape == (0, heads, head_dim)


def test_top_k_and_min_p_filters_on_hand_checked_rows():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, -1.0], [0.0, 5.0, 1.0, 4.0, 2.0]])
    kept = top_k_filter(logits, torch.tensor([3, 0])) > float("-inf")
    assert kept.tolist() == [[True, False, True, True, False], [True] * 5]  # a tie at the k-th kept; 0: all
    assert (top_k_filter(logits, torch.tensor([1, -1])) > float("-inf")).sum(dim=-1).tolist() == [1, 5]
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04], [0.2, 0.2, 0.2, 0.2, 0.2]])
    filtered = min_p_filter(probs, torch.tensor([0.2, 1.0]))  # thresholds 0.1 and 0.2
    torch.testing.assert_close(filtered[0], torch.tensor([0.5, 0.3, 0.1, 0, 0]) / 0.9)
    torch.testing.assert_close(filtered[1], probs[1])  # min_p 1 keeps the tokens tied at the top
    # A row whose logits (greedy) or probabilities (sampled) are not finite gets ABORTED; check_all checks every row
    # again, even where the step handed its greedy tokens in.
    sampler, rows = Sampler(torch.device("cpu")), torch.randn(3, 11)
    rows[1, random.randrange(11)] = float("nan")
    for i in range(3):
        sampler.start(i, seed=i)
    params = [SamplingParams(temperature=0.7, seed=i) for i in range(2)] + [SamplingParams(temperature=0)]
    assert sampler(rows, [0, 1, 2], params)[1] == -2
    rows[2, random.randrange(11)] = random.choice([float("inf"), float("-inf"), float("nan")])
    assert sampler(rows, [0, 1, 2], params).tolist()[1:] == [-2, -2]
    handed_in = torch.zeros(3, dtype=torch.int64)  # as if the step's greedy tokens had missed the bad row
    assert sampler(rows, [0, 1, 2], params, greedy=handed_in).tolist()[1:] == [-2, 0]
    assert sampler(rows, [0, 1, 2], params, greedy=handed_in, check_all=True).tolist()[1:] == [-2, -2]


def transformers_greedy_and_logprobs(path, prompt: list[int], max_tokens: int):
    """transformers' greedy continuation of ``prompt``, and the log_softmax of its full-forward logits over the
    prompt and that continuation in float64 (the truth) and in float32; row i predicts generated token i."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        low = torch.log_softmax(model(ids).logits[0], dim=-1)
        truth = torch.log_softmax(model.double()(ids).logits[0], dim=-1)
    rows = slice(len(prompt) - 1, -1)
    return ids[0, len(prompt):].tolist(), truth[rows], low[rows]


@pytest.mark.skipif(runtime.on_gpu(), reason="float32 token-for-token and logprob parity: an interpreter check")
def test_logprobs_stops_top_k_and_tiny_temperatures(path, llm):
    prompt = llm.tokenizer.encode(PROMPT)
    tokens, truth, low = transformers_greedy_and_logprobs(path, prompt, 3)
    text = llm.tokenizer.decode(tokens, skip_special_tokens=True)
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].isprintable())
    ended = [n for n in range(1, 4) if stop in llm.tokenizer.decode(tokens[:n], skip_special_tokens=True)][0]
    outs = llm.generate([prompt] * 6, [greedy(3, logprobs=3), greedy(3, stop=[stop, "never there"]),
                                       greedy(3, stop=stop, include_stop_str_in_output=True),
                                       greedy(3, stop_token_ids=[tokens[1]]),
                                       SamplingParams(temperature=1e-45, max_tokens=3, ignore_eos=True),
                                       SamplingParams(temperature=1.5, top_k=1, seed=7, max_tokens=3, ignore_eos=True)])
    out, cut, kept, by_token, tiny, top1 = (o.outputs[0] for o in outs)
    assert out.token_ids == tiny.token_ids == top1.token_ids == tokens  # tiny temperature and top-k 1: greedy

    assert len(out.logprobs) == 3
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        best = truth[step].topk(3).indices.tolist()
        assert list(entry) == [token, *[t for t in best if t != token]] and [entry[t].rank for t in best] == [1, 2, 3]
        assert entry[token].decoded_token == llm.tokenizer.decode([token])
        keys = list(entry)
        check_close("logprobs", torch.tensor([entry[t].logprob for t in keys]), truth[step, keys], low[step, keys])

    start = text.find(stop)  # vLLM's rule: the ids keep the token that completed the stop string, the text does not
    assert (cut.text, cut.finish_reason, cut.stop_reason, cut.token_ids) == (text[:start], "stop", stop, tokens[:ended])
    assert (kept.text, kept.token_ids) == (text[:start + len(stop)], tokens[:ended])
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", tokens[1])
    assert by_token.token_ids == tokens[:tokens.index(tokens[1]) + 1]
    assert llm.num_blocks_in_use() == 0


def test_a_request_with_nan_probabilities_ends_alone_and_the_prefix_cache_stays(llm, monkeypatch):
    rng = random.Random()
    prompts = [[rng.randrange(3, llm.config.vocab_size) for _ in range(rng.randrange(17, 30))] for _ in range(2)]
    real_prefill = llm.runner.prefill

    def poisoned_prefill(seqs):
        out = real_prefill(seqs)
        logits = out.logits.clone()
        logits[[i for i, s in enumerate(seqs) if s.token_ids == prompts[0]]] = float("nan")
        return dataclasses.replace(out, logits=logits)

    monkeypatch.setattr(llm.runner, "prefill", poisoned_prefill)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=2, ignore_eos=True)
    bad, good = llm.generate(prompts, sampled)
    assert (bad.outputs[0].finish_reason, bad.outputs[0].token_ids) == ("abort", [])
    assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].token_ids) == 2
    first_block = [llm.block_manager.allocator.lookup(block_digest([], p[:llm.block_size])) for p in prompts]
    assert first_block[0] is None and first_block[1] is not None  # the good request's blocks are still cached
    assert llm.num_blocks_in_use() == 0 and not llm.has_unfinished_requests()


def test_a_greedy_request_whose_logits_turn_nan_ends_alone_without_check_kernels(llm):
    """NaN planted in one request's cached keys after its prefill: its first decode step's logits are NaN, through
    the step the engine really runs (captured graphs and the fused argmax on a GPU, asynchronous scheduling: the next
    step is launched before the host sees the bad row). That request ends with "abort" and its prefill's token; the
    other's tokens are those of the same batch unpoisoned (the NaN stays in its row); the bad request's blocks leave
    the prefix cache, so its prompt is then computed afresh, not read from the poisoned blocks."""
    assert not llm.check_kernels and llm.features.async_scheduling
    rng = random.Random()
    prompts = [[rng.randrange(3, llm.config.vocab_size) for _ in range(llm.block_size + rng.randrange(1, 9))]
               for _ in range(2)]
    alone = llm.generate(prompts[:1], greedy(2))[0].outputs[0].token_ids  # its first block not cached yet
    for _ in range(2):  # the second run's prefills start from cached first blocks, as the poisoned run's will
        together = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy(2))]
    bad, good = [llm.add_request(p, greedy(2)) for p in prompts]
    llm.step()  # the prefill of both (a prefill never runs on behind the host)
    assert (bad.output_token_ids, good.output_token_ids) == (together[0][:1], together[1][:1])
    assert not set(bad.block_table) & set(good.block_table)
    llm.runner.k_caches[:, bad.block_table] = float("nan")
    while llm.has_unfinished_requests():
        llm.step()
    assert (bad.finish_reason, bad.output_token_ids) == ("abort", together[0][:1])
    assert (good.finish_reason, good.output_token_ids) == ("length", together[1])
    assert llm.block_manager.allocator.lookup(block_digest([], prompts[0][:llm.block_size])) is None
    assert llm.num_blocks_in_use() == 0
    assert llm.generate(prompts[:1], greedy(2))[0].outputs[0].token_ids == alone


def test_n_samples_share_the_prompt_blocks(llm, monkeypatch):
    prompt = [random.randrange(3, llm.config.vocab_size) for _ in range(llm.block_size + random.randrange(1, 9))]
    seen, real_prefill = [], llm.runner.prefill

    def watching_prefill(seqs):
        seen.append(([list(s.block_table) for s in seqs], llm.block_manager.num_used,
                     [llm.block_manager.allocator.ref_counts[b] for b in seqs[0].block_table]))
        return real_prefill(seqs)

    monkeypatch.setattr(llm.runner, "prefill", watching_prefill)
    out = llm.generate([prompt], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=1, ignore_eos=True))[0]
    (tables, used, refs), = seen
    assert len(tables) == 2 and tables[0][0] == tables[1][0] and tables[0][1] != tables[1][1]
    assert refs == [2, 1] and used == 3  # the full prompt block counted once, a last block each
    assert [c.index for c in out.outputs] == [0, 1] and all(len(c.token_ids) == 1 for c in out.outputs)
    assert llm.num_blocks_in_use() == 0


def test_chat_applies_the_chat_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, my name is Ada."}]
    out = llm.chat(messages, greedy(1), chat_template=tiny_model.CHAT_TEMPLATE)[0]
    expected = llm.tokenizer.apply_chat_template(messages, chat_template=tiny_model.CHAT_TEMPLATE, tokenize=False,
                                                 add_generation_prompt=True)
    assert out.prompt == expected and expected.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)
    start_id = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert out.prompt_token_ids.count(start_id) == 3  # one special token per message and the assistant's turn
    assert len(out.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}], greedy(1), chat_template=tiny_model.CHAT_TEMPLATE)
    with pytest.raises(ValueError, match="no chat template"):
        chat_prompts(SimpleNamespace(chat_template=None), messages, None, True)
    assert not llm.has_unfinished_requests()


def test_check_kernels_turns_a_planted_bad_block_id_into_an_error(path, monkeypatch):
    llm = LLM(model=str(path), dtype=DTYPE, max_num_seqs=2, num_blocks=8, max_model_len=64, check_kernels=True)
    assert not llm.features.cuda_graphs and not llm.cuda_graphs
    real_allocate = llm.block_manager.allocate

    def buggy_allocate(seq):  # a scheduler bug: a block id past the pool
        real_allocate(seq)
        seq.block_table.append(llm.block_manager.num_blocks + 3)

    monkeypatch.setattr(llm.block_manager, "allocate", buggy_allocate)
    with pytest.raises(ValueError, match="outside the pool of 8 blocks"):
        llm.generate([[5, 6, 7]], greedy(2))
    monkeypatch.undo()
    assert llm.num_blocks_in_use() == 0 and not llm.has_unfinished_requests()
    assert len(llm.generate([[5, 6, 7]], greedy(2))[0].outputs[0].token_ids) == 2
