"""Runs a step: turns the scheduled sequences into the model's packed inputs, owns the KV pools, and replays decode
steps, and the prefill of a lone prompt, from CUDA graphs.

The pools hold one extra block past those the block manager hands out: the *padding block*. A decode step replayed
from a graph captured for 8 sequences but run for 5 pads the batch with 3 rows whose K/V go to the padding block
and whose attention reads one token of it; a prompt of 100 tokens prefilled by the graph of 128 gets 28 padding
rows after its own, whose K/V go to the padding block too. No sequence's block is ever written by a padding row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lessonlib import ops, runtime
from lessonlib.engine.features import Features
from lessonlib.engine.model import Model, StepContext
from lessonlib.engine.sampler import greedy_tokens
from lessonlib.engine.sequence import Sequence


@dataclass
class StepOutput:
    """What a step hands the sampler: each row's logits (B, vocab) float32, and the greedy token of each row (B,)
    int64, computed on the GPU with the logits (inside the captured graph at decode)."""

    logits: torch.Tensor
    greedy: torch.Tensor


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a captured graph (nano-vllm's buckets): 1, 2, 4, 8, then every 16, up to max_num_seqs.
    A batch runs in the smallest bucket that holds it; at most 15 padding rows at large batch sizes."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes) | {max_num_seqs})


MAX_PREFILL_GRAPH_TOKENS = 2048  # longer lone prompts prefill eagerly: their launches are a small part of their time


class DecodeBuffers:
    """A decode step's integer inputs, written on the host into a page-locked buffer and sent to the GPU in one copy
    (its int64 part: token ids, positions, cache slots, token sources; its int32 part: sequence lengths, block
    tables; each a view of the same bytes). The device buffer is what the captured graphs read, so a replay needs
    no other input.

    A row's input token is ``token_pool[source]``. The pool is the previous decode step's tokens (rows 0..rows-1,
    written by that step on the GPU) followed by this step's host-known ids (rows..2 rows-1). A sequence whose last
    token is still on its way to the host (the engine scheduled this step ahead) takes its token from the previous
    step's row; every other row from the host. So the next step can be launched before the host has seen a token.

    Rows past the batch are padding: token 0 at position 0, its K/V written to the padding block, attending to
    one token of it. Two host buffers take turns: the host fills one while the copy of the other may be in flight
    (a step scheduled ahead is filled before the previous step, whose inputs were copied from the other one, ends).
    """

    INT64_ROWS = 4  # ids, positions, slots, sources (the host's part); the device has the previous tokens first

    def __init__(self, rows: int, max_blocks: int, pad_block: int, block_size: int, device: torch.device):
        pinned = device.type == "cuda"
        self.rows, self.max_blocks, self.pad_block, self.block_size = rows, max_blocks, pad_block, block_size
        int64_bytes, int32_bytes = self.INT64_ROWS * rows * 8, rows * (1 + max_blocks) * 4
        self.hosts = [torch.zeros(int64_bytes + int32_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        self._arrays = [self._numpy_views(host, int64_bytes) for host in self.hosts]
        self.device_buffer = torch.zeros(rows * 8 + int64_bytes + int32_bytes, dtype=torch.uint8, device=device)
        self.device_sent = self.device_buffer[rows * 8:]  # what a host buffer is copied onto
        device_ints = self.device_buffer[:rows * 8 + int64_bytes].view(torch.int64)
        self.previous_tokens = device_ints[:rows]  # written by each decode step: its tokens, row by row
        self.token_pool = device_ints[:2 * rows]  # previous_tokens, then this step's host-known ids
        self.device_ints = device_ints[rows:].view(self.INT64_ROWS, rows)
        self.device_int32 = self.device_buffer[rows * 8 + int64_bytes:].view(torch.int32)
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        for turn in (1, 0):
            self.turn = turn
            self._pad(rows)
            self._send()

    def _numpy_views(self, host: torch.Tensor, int64_bytes: int) -> tuple:
        """One host buffer's arrays (numpy views of its bytes): ids, positions, slots, sources, lengths, block
        tables."""
        ids, positions, slots, sources = host[:int64_bytes].view(torch.int64).view(self.INT64_ROWS, self.rows).numpy()
        int32 = host[int64_bytes:].view(torch.int32).numpy()
        return ids, positions, slots, sources, int32[:self.rows], int32[self.rows:].reshape(self.rows, self.max_blocks)

    def _host(self) -> tuple:
        """This turn's host arrays."""
        return self._arrays[self.turn]

    def views(self, rows: int) -> dict[str, torch.Tensor]:
        """The first ``rows`` rows of the device buffers, by StepContext's names (and the token sources)."""
        if rows not in self._views:
            ints, int32 = self.device_ints, self.device_int32
            self._views[rows] = {"sources": ints[3, :rows], "positions": ints[1, :rows], "slots": ints[2, :rows],
                                 "seq_lens": int32[:rows],
                                 "block_table": int32[self.rows:].view(self.rows, self.max_blocks)[:rows]}
        return self._views[rows]

    def input_ids(self, rows: int) -> torch.Tensor:
        """Each row's input token, gathered on the device (see the class docstring)."""
        return self.token_pool[self.views(rows)["sources"]]

    def fill(self, seqs: list[Sequence], rows: int, previous_rows: list[int | None]) -> dict[str, torch.Tensor]:
        """Write each sequence's last token (or, where ``previous_rows`` names one, the previous step's row that
        holds it), its position and slot, its length and block table (rows past the batch: padding); send them;
        return the device views of the first ``rows`` rows."""
        self.turn ^= 1
        bs, n = self.block_size, len(seqs)
        ids, positions, slots, sources, lens, table = self._host()
        self._pad(rows)
        lengths = [len(seq.token_ids) for seq in seqs]
        for row, (seq, previous) in enumerate(zip(seqs, previous_rows)):
            if previous is None:
                ids[row] = seq.token_ids[-1]
            else:
                sources[row] = previous
        lens[:n] = lengths
        positions[:n] = [length - 1 for length in lengths]
        slots[:n] = [seq.block_table[(length - 1) // bs] * bs + (length - 1) % bs for seq, length in zip(seqs, lengths)]
        for row, seq in zip(table, seqs):
            row[:len(seq.block_table)] = seq.block_table
        self._send()
        return self.views(rows)

    def _pad(self, rows: int) -> None:
        ids, positions, slots, sources, lens, table = self._host()
        ids[:rows] = 0
        sources[:rows] = range(self.rows, self.rows + rows)  # the host's id of each row
        positions[:rows] = 0
        slots[:rows] = self.pad_block * self.block_size
        lens[:rows] = 1
        table[:rows] = self.pad_block  # entries past a sequence's blocks are never read

    def _send(self) -> None:
        self.device_sent.copy_(self.hosts[self.turn], non_blocking=True)


class HostTokens:
    """A step's tokens on their way to the host: copied into a page-locked buffer behind the step, with an event
    recorded after the copy, so the host can schedule and launch the next step before it reads them. Two buffers
    take turns (the next step's copy may land while the host reads this one's)."""

    def __init__(self, rows: int, device: torch.device):
        self.gpu = device.type == "cuda"
        self.buffers = [torch.zeros(rows, dtype=torch.int64, pin_memory=self.gpu) for _ in range(2)]
        self.turn = 0

    def send(self, tokens: torch.Tensor) -> "PendingTokens":
        self.turn ^= 1
        buffer = self.buffers[self.turn][:tokens.shape[0]]
        buffer.copy_(tokens, non_blocking=True)
        done = None
        if self.gpu:
            done = torch.cuda.Event()
            done.record()
        return PendingTokens(buffer, done)


@dataclass
class PendingTokens:
    buffer: torch.Tensor
    done: "torch.cuda.Event | None"  # None on the CPU, where the copy has already happened

    def wait(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.buffer.tolist()


class PrefillGraphs:
    """The prefill of one prompt with nothing cached, replayed from a CUDA graph per bucket of prompt lengths (16,
    32, 64, ... up to ``max_tokens``), each captured the first time a prompt of its bucket comes. Eager, a prefill
    launches every kernel of every layer from Python (about 180 for a 16-layer model: 23 ms on session 7's device
    host for 128 tokens); replayed, it is one launch.

    A prompt of n tokens runs padded to its bucket. The padding rows come after the prompt's (token 0 at position 0,
    K/V written to the padding block), so under causal attention no prompt token sees one, every layer's other
    kernels work row by row, and only the prompt's last row is read for logits: the prompt's K/V and logits are
    those of the unpadded prefill, up to rounding (a GEMM over more rows may use another cuBLAS kernel). With
    ``capture`` False (no GPU) the same padded step runs eagerly, which is how the interpreter tests it.
    """

    def __init__(self, runner: "ModelRunner", max_tokens: int, capture: bool):
        self.runner, self.capture = runner, capture
        self.buckets = [16]
        while self.buckets[-1] < max_tokens:
            self.buckets.append(2 * self.buckets[-1])
        rows, device = self.buckets[-1], runner.device
        pinned = device.type == "cuda"
        self.host = torch.zeros(3 * rows + 1, dtype=torch.int64, pin_memory=pinned)  # ids, positions, slots, last
        self.device_buffer = torch.zeros_like(self.host, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, StepOutput]] = {}
        self.pool = None

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket that holds ``num_tokens``; None past the largest (that prompt runs eagerly)."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    def run(self, seq: Sequence, bucket: int) -> StepOutput:
        if self.capture and bucket not in self.graphs:
            self._capture(bucket)
        n, bs = len(seq), self.runner.block_size
        self._fill(bucket, seq.token_ids, range(n), [seq.block_table[p // bs] * bs + p % bs for p in range(n)])
        if not self.capture:
            return self._step(bucket)
        graph, out = self.graphs[bucket]
        graph.replay()
        return out

    def _fill(self, bucket: int, ids, positions, slots) -> None:
        """Write the prompt's rows, then padding rows up to ``bucket``, and the last prompt row's index; send."""
        rows, n = self.buckets[-1], len(ids)
        host = self.host.numpy()
        host_ids, host_positions, host_slots = host[:rows], host[rows:2 * rows], host[2 * rows:3 * rows]
        host_ids[:n], host_positions[:n], host_slots[:n] = ids, positions, slots
        host_ids[n:bucket], host_positions[n:bucket] = 0, 0
        host_slots[n:bucket] = self.runner.pad_block * self.runner.block_size
        host[-1] = n - 1
        self.device_buffer.copy_(self.host, non_blocking=True)

    def _step(self, bucket: int) -> StepOutput:
        rows, runner = self.buckets[-1], self.runner
        ids, positions, slots = (self.device_buffer[i * rows:i * rows + bucket] for i in range(3))
        ctx = StepContext(True, slots, max_query_len=bucket, flash_groups=[(None, 1, bucket)])
        hidden = runner.model(ids, positions, ctx, runner.k_caches, runner.v_caches)
        logits = runner.model.logits(hidden[self.device_buffer[-1:]])
        return StepOutput(logits, greedy_tokens(logits, runner.fused))

    def _capture(self, bucket: int) -> None:
        """Capture ``bucket``'s graph with every row padding (the warm-up run compiles its kernels and writes only
        the padding block); its buckets share one memory pool, as the decode graphs do."""
        self._fill(bucket, [0], [0], [self.runner.pad_block * self.runner.block_size])
        self._step(bucket)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._step(bucket)
        self.pool = graph.pool()
        self.graphs[bucket] = (graph, out)


class ModelRunner:
    def __init__(self, model: Model, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 features: Features = Features()):
        config = model.config
        self.model, self.block_size, self.fused = model, block_size, features.fused_ops
        device, dtype = model.norm.device, model.norm.dtype
        self.device = device
        self.pad_block = num_blocks
        shape = (config.num_layers, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        self.k_caches = torch.zeros(shape, dtype=dtype, device=device)
        self.v_caches = torch.zeros(shape, dtype=dtype, device=device)
        self.max_blocks = -(-max_model_len // block_size)  # block-table width of every decode step
        self.inputs = DecodeBuffers(max_num_seqs, self.max_blocks, self.pad_block, block_size, device)
        self.host_tokens = HostTokens(max_num_seqs, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, StepOutput]] = {}
        self.prefill_graphs: PrefillGraphs | None = None
        if features.cuda_graphs and runtime.on_gpu():
            self._capture(max_num_seqs)
            self.prefill_graphs = PrefillGraphs(self, min(max_model_len, MAX_PREFILL_GRAPH_TOKENS), capture=True)

    # --- prefill -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], chunks: list[tuple[int, int]] | None = None) -> StepOutput:
        """Compute every sequence's uncached tokens; return the logits of each one's last token, (B, vocab), and
        its greedy token. ``chunks`` (chunked prefill): each sequence's token range [start, end) instead, the
        tokens before start already in the cache (a decode is the range of its last token); logits and greedy
        tokens only for the sequences whose range ends at their last token, in order."""
        lone = seqs[0] if len(seqs) == 1 and not seqs[0].num_cached_tokens and chunks is None else None
        bucket = lone and self.prefill_graphs and self.prefill_graphs.bucket(len(lone))
        if bucket:
            return self.prefill_graphs.run(lone, bucket)
        bs = self.block_size
        chunks = chunks or [(seq.num_cached_tokens, len(seq)) for seq in seqs]
        ids, positions, slots, starts, lens = [], [], [], [0], []
        for seq, (start, n) in zip(seqs, chunks):
            ids += seq.token_ids[start:n]
            positions += range(start, n)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, n)]
            starts.append(starts[-1] + n - start)
            lens.append(n)
        ctx = StepContext(True, self._tensor(slots, torch.int64), max_query_len=max(b - a for a, b in zip(starts, starts[1:])))
        if any(start for start, _ in chunks):  # a cached prefix to read through the block table
            ctx.block_table = self._table(seqs, width=max(len(seq.block_table) for seq in seqs))
            ctx.seq_lens = self._tensor(lens, torch.int32)
            ctx.query_starts = self._tensor(starts, torch.int32)
        else:
            ctx.flash_groups = self._flash_groups(lens, starts)
        hidden = self.model(self._tensor(ids, torch.int64), self._tensor(positions, torch.int64), ctx,
                            self.k_caches, self.v_caches)
        last = self._tensor([end - 1 for end, seq, (_, n) in zip(starts[1:], seqs, chunks) if n == len(seq)],
                            torch.int64)
        logits = self.model.logits(hidden[last])
        return StepOutput(logits, greedy_tokens(logits, self.fused))

    def _flash_groups(self, lens: list[int], starts: list[int]) -> list:
        """Prompts of equal length batched into one flash_attention call each."""
        by_length: dict[int, list[int]] = {}
        for i, n in enumerate(lens):
            by_length.setdefault(n, []).append(i)
        if len(by_length) == 1:
            return [(None, len(lens), lens[0])]  # the packed rows are already (count, length) in order
        groups = []
        for n, members in by_length.items():
            rows = torch.cat([torch.arange(starts[i], starts[i] + n) for i in members]).to(self.device)
            groups.append((rows, len(members), n))
        return groups

    # --- decode ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], previous_rows: list[int | None] | None = None) -> StepOutput:
        """One new token per sequence: feed each one's last token (from the previous decode step's row
        ``previous_rows[i]`` where it names one: that token has not reached the host yet); return (B, vocab) logits
        and greedy tokens."""
        batch = len(seqs)
        bucket = next((b for b in sorted(self.graphs) if b >= batch), None)
        inputs = self.inputs.fill(seqs, bucket or batch, previous_rows or [None] * batch)
        if bucket is None:
            ctx = StepContext(False, inputs["slots"], inputs["block_table"], inputs["seq_lens"],
                              decode_splits=None if runtime.on_gpu() else 1,
                              max_seq_len=max(len(seq.token_ids) for seq in seqs))
            return self._decode_step(batch, ctx)
        graph, out = self.graphs[bucket]
        graph.replay()
        return StepOutput(out.logits[:batch], out.greedy[:batch])

    def _decode_step(self, rows: int, ctx: StepContext) -> StepOutput:
        """The decode step on the first ``rows`` rows of the inputs; its greedy tokens are also kept on the device
        for the next step (``DecodeBuffers.previous_tokens``)."""
        inputs = self.inputs.views(rows)
        hidden = self.model(self.inputs.input_ids(rows), inputs["positions"], ctx, self.k_caches, self.v_caches)
        logits = self.model.logits(hidden)
        tokens = greedy_tokens(logits, self.fused)
        # The next step may be launched before the host sees these: an ABORTED row feeds it token 0 (its output is
        # dropped, the request having ended), never an index the embedding cannot read.
        torch.clamp(tokens, min=0, out=self.inputs.previous_tokens[:rows])
        return StepOutput(logits, tokens)

    def _capture(self, max_num_seqs: int) -> None:
        """One graph per batch-size bucket, largest first, all sharing one memory pool (the buckets run one at a
        time, so their intermediates can share memory). Each reads its inputs from the first rows of
        ``self.inputs``' device buffers; captured with every row pointing at the padding block."""
        pool = None
        with torch.inference_mode():
            for batch in reversed(graph_batch_sizes(max_num_seqs)):
                inputs = self.inputs.views(batch)
                ctx = StepContext(False, inputs["slots"], inputs["block_table"], inputs["seq_lens"])
                self._decode_step(batch, ctx)  # compiles the kernels for this shape outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._decode_step(batch, ctx)
                pool = graph.pool()
                self.graphs[batch] = (graph, out)
        torch.cuda.synchronize()

    # --- helpers -----------------------------------------------------------------------------------------------
    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _table(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        """(len(seqs), width) int32 block tables for a prefill step; entries past a sequence's blocks (never read)
        point at the padding block."""
        table = torch.full((len(seqs), width), self.pad_block, dtype=torch.int32)
        for i, seq in enumerate(seqs):
            table[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        return table.to(self.device, non_blocking=True)
