"""Decode steps over static, padded buffers: replayed as CUDA graphs on a GPU.

A decode step of our forward launches a few hundred small kernels; at the batch sizes of a
serving GPU the launches, not the math, set its time. Captured once as a CUDA graph, the
whole step is one launch (vLLM's `cudagraph_capture_sizes`, nano-vllm's
`capture_cudagraph`). A graph replays fixed shapes at fixed addresses, so:

- a step's decodes are padded up to the next captured batch size (`GraphBuckets`), and their
  block tables up to the next captured context. A padding row is token 0 at position 0: it
  writes its key and value to a scratch block no sequence owns and attends to that one key;
  a padded table entry is the scratch block too, masked out by the row's context length;
- the inputs live in one static buffer, a row per sequence: token, position, slot, context
  length, then the block table. A step fills it with one host-to-device copy;
- the graph's attention is a single decode group over the padded tables (the caller's
  `step_fn`): no data-dependent control flow, no host reads;
- the logits are copied into a static output buffer and sampled outside the graph.

Steps with prompt chunks, or more decodes or longer contexts than the largest bucket, run
eager. On the CPU the same path runs with "capture" recording the step and "replay" calling
it, so the padding and bucketing are tested token for token without a GPU.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.step_batch import ChunkInput

log = logging.getLogger("llmfleet.worker")

# Each bucket at most 1.5x the one below it from 32 on: a step pads at most a third of its
# rows. Past 512 sequences a step runs eager (vLLM's default capture sizes stop there too).
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Contexts double from 256 tokens: a row gathers at most twice the keys it needs, and a
# model with a 128k window does not capture graphs it could not fill (longer runs eager).
CONTEXT_BUCKET_TOKENS = (256, 512, 1024, 2048, 4096, 8192)
NUM_ROW_FIELDS = 4  # token, position, slot, context length; then the block table


@dataclass(frozen=True, slots=True)
class GraphBuckets:
    """The captured shapes: decodes per step, and block-table entries per decode."""

    batch_sizes: tuple[int, ...]
    context_blocks: tuple[int, ...]

    @classmethod
    def default(cls, max_num_seqs: int, block_size: int, max_context_tokens: int) -> GraphBuckets:
        """Batch sizes up to `max_num_seqs` (itself the last), contexts up to the longest a
        sequence can have (`max_context_tokens`: the model's window or the pool's size)."""
        largest = min(max_num_seqs, BATCH_SIZE_BUCKETS[-1])
        batch_sizes = [b for b in BATCH_SIZE_BUCKETS if b < largest] + [largest]
        longest = min(max_context_tokens, CONTEXT_BUCKET_TOKENS[-1])
        contexts = [t for t in CONTEXT_BUCKET_TOKENS if t < longest] + [longest]
        return cls(tuple(batch_sizes), tuple(-(-t // block_size) for t in contexts))

    def pick(self, num_decodes: int, num_context_blocks: int) -> tuple[int, int] | None:
        """The smallest captured (batch size, context blocks) that holds the step, or None."""
        batch_size = next((b for b in self.batch_sizes if b >= num_decodes), None)
        blocks = next((c for c in self.context_blocks if c >= num_context_blocks), None)
        if batch_size is None or blocks is None:
            return None
        return batch_size, blocks

    def all(self) -> list[tuple[int, int]]:
        """Every bucket, largest first: the first capture sizes the shared memory pool."""
        return [(b, c) for b in reversed(self.batch_sizes) for c in reversed(self.context_blocks)]


@dataclass(frozen=True, slots=True)
class DecodeInputs:
    """Views of the static buffer for one bucket: what the captured step reads."""

    input_ids: torch.Tensor  # [batch]
    positions: torch.Tensor  # [batch]
    slot_mapping: torch.Tensor  # [batch]
    context_lens: torch.Tensor  # [batch]
    block_tables: torch.Tensor  # [batch, context blocks]
    keep: torch.Tensor  # [batch]: every row's logits


StepFn = Callable[[DecodeInputs], torch.Tensor]  # logits [batch, vocab]


class DecodeGraphs:
    """Runs decode-only steps through captured per-bucket graphs over static buffers.

    `step_fn` is the step (our forward with one decode group over the padded tables); it
    must be graph-safe. `scratch_block`: a KV block no sequence is given.
    """

    def __init__(
        self,
        step_fn: StepFn,
        buckets: GraphBuckets,
        block_size: int,
        scratch_block: int,
        logits_shape: tuple[int, torch.dtype],  # (vocab, dtype)
        device: torch.device,
    ) -> None:
        self.buckets = buckets
        self.block_size = block_size
        self.scratch_block = scratch_block
        self._step_fn = step_fn
        self._device = device
        max_batch = buckets.batch_sizes[-1]
        row_width = NUM_ROW_FIELDS + buckets.context_blocks[-1]
        self._rows = torch.zeros(max_batch * row_width, dtype=torch.long, device=device)
        self._keep = torch.arange(max_batch, device=device)
        vocab, dtype = logits_shape
        self._logits = torch.empty(max_batch, vocab, dtype=dtype, device=device)
        self._replays: dict[tuple[int, int], Callable[[], None]] = {}
        # The memory pool the graphs share (CUDA): they never run at once, and each one's
        # output is copied out before the next replays.
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.num_replays = 0
        self.capture_s = 0.0  # capture_all's time

    @property
    def num_captured(self) -> int:
        return len(self._replays)

    def pick(self, decodes: list[ChunkInput]) -> tuple[int, int] | None:
        """The bucket of a decode-only step, or None: the step runs eager."""
        if not all(chunk.is_sampling for chunk in decodes):
            return None
        longest = max(chunk.end for chunk in decodes)
        return self.buckets.pick(len(decodes), -(-longest // self.block_size))

    def capture_all(self) -> None:
        """Capture every bucket now (on a GPU, at start), so that no step of a run pays for
        a capture; elsewhere each is recorded on first use."""
        started = time.perf_counter()
        # Some torch versions collect garbage before each capture: frozen, the objects that
        # exist already are not walked again for each of the dozens of graphs (as vLLM does).
        gc.freeze()
        try:
            for bucket in self.buckets.all():
                self._capture(bucket)
        finally:
            gc.unfreeze()
        self.capture_s = time.perf_counter() - started
        log.info(
            "captured %d decode graphs in %.1f s: batch sizes %s, context blocks %s",
            len(self._replays),
            self.capture_s,
            self.buckets.batch_sizes,
            self.buckets.context_blocks,
        )

    def run(self, decodes: list[ChunkInput], bucket: tuple[int, int]) -> torch.Tensor:
        """Logits [len(decodes), vocab] of a decode-only step, through `bucket`'s graph. A view
        of the static output: read it before the next step."""
        if bucket not in self._replays:
            self._capture(bucket)
        view = self._view(*bucket)
        view.copy_(self._host_rows(decodes, *bucket), non_blocking=True)
        self._replays[bucket]()
        self.num_replays += 1
        return self._logits[: len(decodes)]

    def _host_rows(self, decodes: list[ChunkInput], batch_size: int, blocks: int) -> torch.Tensor:
        size, scratch = self.block_size, self.scratch_block
        rows = []
        for chunk in decodes:
            table = chunk.block_ids[: -(-chunk.end // size)]
            slot = chunk.block_ids[chunk.start // size] * size + chunk.start % size
            padding = [scratch] * (blocks - len(table))
            rows.append([chunk.token_ids[0], chunk.start, slot, chunk.end, *table, *padding])
        rows += [self._padding_row(blocks)] * (batch_size - len(decodes))
        return torch.tensor(rows, dtype=torch.long)

    def _padding_row(self, blocks: int) -> list[int]:
        """Token 0 at position 0, written to the scratch block's first slot: context 1, so
        its softmax has one key and stays finite."""
        return [0, 0, self.scratch_block * self.block_size, 1] + [self.scratch_block] * blocks

    def _view(self, batch_size: int, blocks: int) -> torch.Tensor:
        return self._rows[: batch_size * (NUM_ROW_FIELDS + blocks)].view(batch_size, -1)

    def _inputs(self, batch_size: int, blocks: int) -> DecodeInputs:
        view = self._view(batch_size, blocks)
        return DecodeInputs(
            input_ids=view[:, 0],
            positions=view[:, 1],
            slot_mapping=view[:, 2],
            context_lens=view[:, 3],
            block_tables=view[:, NUM_ROW_FIELDS:],
            keep=self._keep[:batch_size],
        )

    def _capture(self, bucket: tuple[int, int]) -> None:
        batch_size, blocks = bucket
        inputs = self._inputs(batch_size, blocks)
        logits = self._logits[:batch_size]
        step_fn = self._step_fn  # not `self`: no reference cycle keeps a dropped runner alive

        def step() -> None:
            logits.copy_(step_fn(inputs))

        if self._device.type != "cuda":
            self._replays[bucket] = step
            return
        # Warm-up and capture run padding rows only: they touch nothing but the scratch block.
        self._view(batch_size, blocks).copy_(
            torch.tensor([self._padding_row(blocks)] * batch_size, dtype=torch.long)
        )
        self._replays[bucket] = self._cuda_graph(step)

    def _cuda_graph(self, step: Callable[[], None]) -> Callable[[], None]:
        """Warm up on a side stream (lazy initialisation such as cuBLAS workspaces must not
        happen during capture), then capture into the shared pool."""
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self._device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step()
        return graph.replay
