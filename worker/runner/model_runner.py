"""The continuous-batching model runner: owns the KV tensors, runs one `SchedulerOutput`.

One forward pass per step over the packed tokens of every scheduled chunk (decodes first,
then prefill chunks), with our paged attention (`paged_attention.py`) and `logits_to_keep`
set to the last position of each chunk that samples, so the LM head runs only there. On a
GPU, a step of decodes alone replays a captured CUDA graph instead (`decode_graphs.py`).
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import Any

import torch

from shared.protocol import SamplingParams
from worker.runner import cpu_attention, host_memory, sampler
from worker.runner.decode_graphs import DecodeGraphs, DecodeInputs, GraphBuckets
from worker.runner.guard import check
from worker.runner.kv_blocks import KVLayout, read_blocks, write_blocks
from worker.runner.llama import LlamaForward
from worker.runner.loader import LoadedModel
from worker.runner.paged_attention import (
    ATTENTION_NAME,
    STEP_KWARG,
    DecodeGroup,
    PagedKVCache,
    PrefillBatch,
    PrefillSpan,
    StepMetadata,
    decode_group,
    pool_rows,
    prefill_batch,
)
from worker.step_batch import ChunkInput, SamplingFailure, StepBatch

log = logging.getLogger("llmfleet.worker")
# One forward of our own per loaded model, for as long as the model lives: fusing and
# reordering its weights is most of building a runner (2.2 s of 2.3 for the default model
# on the CPU), which a standby worker's activation must not pay again (`worker/weights.py`
# prepares it with the load). The forward holds the model's tensors, never the model.
_OWN_FORWARDS: weakref.WeakKeyDictionary[Any, LlamaForward] = weakref.WeakKeyDictionary()


def own_forward(model: Any) -> LlamaForward:
    """The model's forward of our own (`llama.py`), made on first use."""
    forward = _OWN_FORWARDS.get(model)
    if forward is None:
        forward = _OWN_FORWARDS[model] = LlamaForward(model)
    return forward


def uses_own_forward(model: Any, forward: str) -> bool:
    return forward == "own" or (forward == "auto" and LlamaForward.supports(model))


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    config = loaded.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element_bytes = torch.empty((), dtype=loaded.model.dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element_bytes


DEFAULT_CPU_KV_CACHE_GB = 2.0


def kv_cache_budget_bytes(
    loaded: LoadedModel, kv_cache_gb: float | None, gpu_memory_fraction: float
) -> int:
    """The KV pool's size: as configured, else a fraction of the GPU's free memory (after the
    weights are loaded), else a fixed default on the CPU."""
    if kv_cache_gb is not None:
        return int(kv_cache_gb * 2**30)
    if loaded.device.type == "cuda":
        # Blocks the caching allocator holds but no tensor uses (loading's temporaries) are
        # free for the pool; the fraction left over is for the steps' activations and the
        # decode graphs' memory pool.
        torch.cuda.empty_cache()
        free_bytes, _total = torch.cuda.mem_get_info(loaded.device)
        return int(free_bytes * gpu_memory_fraction)
    return int(DEFAULT_CPU_KV_CACHE_GB * 2**30)


def num_blocks_for_budget(loaded: LoadedModel, kv_cache_bytes: int, block_size: int) -> int:
    return max(1, kv_cache_bytes // (kv_bytes_per_token(loaded) * block_size))


# Padding (key positions) a group of decodes may take on to share the next group's attention
# call. On this CPU with the default model an attention call per layer costs about what
# 2-4k padded positions do: two short sequences among twelve long ones ran 5% faster in one
# call, and 10 rows of 60 beside 2 of 4,000 8x slower (docs/benchmarks.md, session 9).
MAX_MERGE_PADDING = 4096
# On a GPU a call costs its ~12 launches a layer (~0.1 ms eager) where 128k padded positions
# cost ~0.03 ms of gathering (this model's 768 bytes of KV a position, at 3 TB/s).
MAX_MERGE_PADDING_GPU = 1 << 17


def decode_group_bounds(
    ends: list[int], block_size: int, max_merge_padding: int = MAX_MERGE_PADDING
) -> list[tuple[int, int]]:
    """[start, end) of each group of decodes, given their contexts in ascending order: split
    where the context more than doubles, so no row is padded to more than twice its length;
    then a group joins the next one up when padding its rows to that one's longest context
    adds at most `max_merge_padding` positions (one call fewer costs less than that)."""
    if not ends:
        return []
    splits = [0]
    for i in range(1, len(ends)):
        if ends[i] > 2 * max(ends[splits[-1]], block_size):
            splits.append(i)
    groups = [(start, end) for start, end in zip(splits, [*splits[1:], len(ends)], strict=True)]
    merged = [groups[0]]
    for start, end in groups[1:]:
        low_start, low_end = merged[-1]
        added = (low_end - low_start) * (ends[end - 1] - ends[low_end - 1])
        if added <= max_merge_padding:
            merged[-1] = (low_start, end)
        else:
            merged.append((start, end))
    return merged


GRAPH_MODES = ("auto", "on", "off")
WARM_UP_ID = "warm-up"  # `ModelRunner.warm_up`'s requests: no API request id looks like it


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        forward: str = "auto",
        *,
        graphs: str = "auto",
        max_num_seqs: int = 64,
        graph_buckets: GraphBuckets | None = None,
        pad_attention: bool | None = None,
    ) -> None:
        """`forward`: "own" (`llama.py`), "hf" (the HF forward with our attention plugged
        in), or "auto": our own where the architecture has one.

        `graphs`, for decode-only steps of our own forward: "auto" (CUDA graphs on a GPU,
        none on the CPU), "off", or "on" (the padded static path on any device: on the CPU
        it is called, not replayed; for the tests). `graph_buckets`: the captured shapes
        (default: `GraphBuckets.default` up to `max_num_seqs`).

        `pad_attention`: attend an eager step's prompt chunks in one padded call and its
        decodes in as few groups as 128k padded positions allow (`paged_attention.py`),
        where a call's launches cost more than the padding's arithmetic: None (the
        default) does so on a GPU."""
        if graphs not in GRAPH_MODES:
            raise ValueError(f"graphs must be one of {GRAPH_MODES}, not {graphs!r}")
        self._loaded = loaded
        self._model = loaded.model
        self._device = loaded.device
        self.block_size = block_size
        self._model.set_attn_implementation(ATTENTION_NAME)
        use_own = uses_own_forward(self._model, forward)
        if forward == "own" and not LlamaForward.supports(self._model):
            raise ValueError(f"no own forward for {self._model.config.model_type!r} models")
        self._forward = own_forward(self._model) if use_own else None
        self._pad_attention = (
            self._device.type == "cuda" if pad_attention is None else pad_attention
        )
        use_graphs = _uses_graphs(graphs, self._forward, self._device)
        # The decode graphs' padding rows write to a block of their own, past the KV
        # manager's `num_blocks`, so no sequence's keys are ever overwritten.
        self._k_pool, self._v_pool = self._make_pools(num_blocks + int(use_graphs))
        if self._device.type == "cpu":
            cpu_attention.load()  # built (once per machine) now, not in a request's first step
            host_memory.keep_freed_memory()  # a step's activations, not faulted in each step
        self._graphs: DecodeGraphs | None = None
        self.graphs_error: str | None = None  # why a GPU's decode graphs failed to capture
        if use_graphs:
            max_context_tokens = min(
                getattr(self._model.config, "max_position_embeddings", None) or 1 << 30,
                num_blocks * block_size,
            )
            buckets = graph_buckets or GraphBuckets.default(
                max_num_seqs, block_size, max_context_tokens
            )
            self._graphs = self._make_graphs(buckets, scratch_block=num_blocks)
        self._generators: dict[str, torch.Generator | None] = {}
        self.fault_token_id: int | None = None  # chaos tests: a step holding it fails

    def _make_pools(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        config = self._model.config
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        # By KV head, then block (see paged_attention.py): a head's gathered blocks are one
        # contiguous [sequences, context, head_dim] tensor, ready for a batched matmul.
        shape = (
            config.num_hidden_layers,
            config.num_key_value_heads,
            num_blocks,
            self.block_size,
            head_dim,
        )
        return _zeros(shape, self._model.dtype, self._device), _zeros(
            shape, self._model.dtype, self._device
        )

    @torch.inference_mode()
    def _make_graphs(self, buckets: GraphBuckets, scratch_block: int) -> DecodeGraphs | None:
        assert self._forward is not None
        vocab = self._forward.lm_head.weight.shape[0]
        # The step holds the forward and the pools, not the runner: with no reference cycle a
        # dropped runner frees its KV pool (and graphs) at once, not at the next collection.
        step = functools.partial(_graph_step, self._forward, self._k_pool, self._v_pool)
        graphs = DecodeGraphs(
            step,
            buckets,
            self.block_size,
            scratch_block,
            (vocab, self._model.dtype),
            self._device,
        )
        if self._device.type == "cuda":
            try:
                graphs.capture_all()
            except RuntimeError as exc:  # an op of this model or torch that cannot be captured
                log.warning("no decode graphs (%s): decode steps run eager", exc)
                self.graphs_error = f"{type(exc).__name__}: {exc}"
                return None
        return graphs

    @property
    def num_graph_replays(self) -> int:
        """Steps that ran through a decode graph (0 without graphs)."""
        return self._graphs.num_replays if self._graphs is not None else 0

    @property
    def graph_capture_s(self) -> float:
        """Seconds the decode graphs took to capture at start (0 without, or on the CPU)."""
        return self._graphs.capture_s if self._graphs is not None else 0.0

    @property
    def vocab_size(self) -> int:
        return self._loaded.vocab_size

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> list[int | SamplingFailure]:
        """Run the step; one sampled token per sampling chunk, in `batch.chunks` order, or
        that chunk's `SamplingFailure` (the forward pass is shared, sampling fails per
        sequence)."""
        chunks = batch.chunks
        if self.fault_token_id is not None and any(
            self.fault_token_id in c.token_ids for c in chunks
        ):
            raise RuntimeError("injected fault: the step's input holds the fault token")
        if self._forward is not None and self._graphs is None and not batch.prefills:
            sampled = self._decode_at(batch.decodes)
            if sampled is not None:
                return sampled
        bucket = None
        if self._graphs is not None and batch.decodes and not batch.prefills:
            bucket = self._graphs.pick(batch.decodes)
        if self._graphs is not None and bucket is not None:
            logits = self._graphs.run(batch.decodes, bucket)
        else:
            logits = self._eager(batch)
        params = [c.sampling for c in chunks if c.sampling is not None]
        generators = [self._generator(c.request_id, c.sampling) for c in chunks if c.sampling]
        return sampler.sample(logits, params, generators)

    def _decode_at(self, decodes: list[ChunkInput]) -> list[int | SamplingFailure] | None:
        """A decode-only step through `LlamaForward.decode_at`: the step's inputs go to C as
        the host's lists, not as tensors, and greedy rows are sampled there too. None where
        it cannot take the step; `execute` then takes the tensors' path."""
        assert self._forward is not None
        params = [c.sampling for c in decodes if c.sampling is not None]
        if not decodes or len(params) < len(decodes):
            return None  # every row of a decode step samples
        greedy = all(p.is_greedy and check(p) is None for p in params)
        size = self.block_size
        ends = [c.end for c in decodes]
        stepped = self._forward.decode_at(
            [c.token_ids[0] for c in decodes],
            [c.start for c in decodes],
            [c.block_ids[c.start // size] * size + c.start % size for c in decodes],
            [c.block_ids for c in decodes],
            ends,
            decode_group_bounds(ends, size),
            self._k_pool,
            self._v_pool,
            greedy,
        )
        if stepped is None:
            return None
        logits, tokens = stepped
        if greedy:
            return list(tokens)
        generators = [
            self._generator(c.request_id, p) for c, p in zip(decodes, params, strict=True)
        ]
        return sampler.sample(logits, params, generators)

    def _eager(self, batch: StepBatch) -> torch.Tensor:
        """Logits of the step's sampling chunks, by the forward called op by op."""
        input_ids, positions, slot_mapping, keep = self._pack(batch.chunks)
        step = self._metadata(batch, slot_mapping)
        keep_rows = torch.tensor(keep, dtype=torch.long, device=self._device)
        if self._forward is not None:
            return self._forward(input_ids, positions, self._k_pool, self._v_pool, step, keep_rows)
        return self._model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            cache=PagedKVCache(self._k_pool, self._v_pool, slot_mapping),
            use_cache=True,
            logits_to_keep=keep_rows,
            **{STEP_KWARG: step},
        ).logits[0]

    @torch.inference_mode()
    def warm_up(self, max_num_batched_tokens: int, max_num_decodes: int) -> float:
        """Run the eager step's shapes once before any request does; returns the seconds.

        A GPU loads each kernel at its first launch (CUDA's lazy module loading) and cuBLAS
        picks one per matrix shape: paid inside a request's step, that is a stall of up to
        hundreds of milliseconds on every stream at once (the GPU check's first runs). So,
        as vLLM's profile run does, one prompt chunk of 1, 2, 4, ... and
        `max_num_batched_tokens` tokens, then up to `max_num_decodes` decodes beside a
        chunk. The KV goes to the pool's first blocks, which no sequence holds yet and each
        sequence writes before it reads; nothing else is kept."""
        started_s = time.perf_counter()
        size = self.block_size
        capacity = (self._k_pool.shape[2] - int(self._graphs is not None)) * size
        max_tokens = min(max_num_batched_tokens, capacity)
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        blocks = list(range(-(-max_tokens // size)))
        lengths = sorted({1 << i for i in range(max_tokens.bit_length())} | {max_tokens})
        lengths = [n for n in lengths if n <= max_tokens]
        steps = [
            StepBatch([], [ChunkInput(WARM_UP_ID, [0] * n, 0, blocks, greedy)]) for n in lengths
        ]
        num_decodes = max(0, min(max_num_decodes, max_tokens - 1, len(blocks)))
        if num_decodes:
            decodes = [
                ChunkInput(f"{WARM_UP_ID}-{i}", [0], size - 1, [i], greedy)
                for i in range(num_decodes)
            ]
            chunk = ChunkInput(WARM_UP_ID, [0] * (max_tokens - num_decodes), 0, blocks, greedy)
            steps.append(StepBatch(decodes, [chunk]))
        for step in steps:
            self.execute(step)
        for request_id in {c.request_id for step in steps for c in step.chunks}:
            self.release(request_id)
        return time.perf_counter() - started_s

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout.of_pool(self._k_pool)

    def export_kv(self, block_ids: list[int]) -> memoryview:
        """A sequence's KV blocks (its block table's ids, in order) as bytes: the payload of
        a hand-off to another worker (`kv_blocks.py`)."""
        return read_blocks(self._k_pool, self._v_pool, block_ids)

    def import_kv(
        self, block_ids: list[int], layout: KVLayout | dict[str, Any], payload: memoryview | bytes
    ) -> None:
        """Blocks exported by a runner of `layout` (or its `as_dict`, as a hand-off's header
        carries it), into this pool at `block_ids`."""
        if isinstance(layout, dict):
            layout = KVLayout.from_dict(layout)
        write_blocks(self._k_pool, self._v_pool, block_ids, layout, payload)

    def export_sampling_state(self, request_id: str) -> bytes | None:
        """The request's sampler state (its random generator's, after the draws made here),
        for a hand-off: the receiving runner then draws what this one would have. None for
        greedy requests, or before its first sample."""
        generator = self._generators.get(request_id)
        return None if generator is None else bytes(generator.get_state().numpy().data)

    def import_sampling_state(
        self, request_id: str, params: SamplingParams, state: bytes | None
    ) -> None:
        """Continue the request's draws from `state` (`export_sampling_state`'s)."""
        generator = sampler.make_generator(params, self._device)
        if generator is not None and state is not None:
            generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        self._generators[request_id] = generator

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        if request_id not in self._generators:
            self._generators[request_id] = sampler.make_generator(params, self._device)
        return self._generators[request_id]

    def _pack(self, chunks: list[ChunkInput]):
        token_ids: list[int] = []
        positions: list[int] = []
        keep: list[int] = []
        for chunk in chunks:
            token_ids += chunk.token_ids
            positions += range(chunk.start, chunk.end)
            if chunk.is_sampling:
                keep.append(len(token_ids) - 1)
        # Flat pool slot of each new token: block_ids[position // block_size] plus offset.
        size = self.block_size
        slots = [
            chunk.block_ids[p // size] * size + p % size
            for chunk in chunks
            for p in range(chunk.start, chunk.end)
        ]
        device = self._device
        return (
            torch.tensor(token_ids, device=device),
            torch.tensor(positions, device=device),
            torch.tensor(slots, device=device),
            keep,
        )

    def _metadata(self, batch: StepBatch, slot_mapping: torch.Tensor) -> StepMetadata:
        prefills = []
        query_start = len(batch.decodes)
        for chunk in batch.prefills:
            query_end = query_start + len(chunk.token_ids)
            num_blocks = -(-chunk.end // self.block_size)
            block_ids = torch.tensor(chunk.block_ids[:num_blocks], device=self._device)
            rows = self._pool_rows(block_ids)
            span = PrefillSpan(query_start, query_end, rows, chunk.end, self._chunk_mask(chunk))
            if self._device.type == "cpu":
                span.table = block_ids.to(torch.int32)
            prefills.append(span)
            query_start = query_end
        step = StepMetadata(slot_mapping, self._decode_groups(batch.decodes), prefills)
        if self._pad_attention and batch.prefills:
            step.prefill_batch = self._prefill_batch(batch)
        return step

    def _prefill_batch(self, batch: StepBatch) -> PrefillBatch | None:
        chunks = batch.prefills
        return prefill_batch(
            len(batch.decodes),
            [len(c.token_ids) for c in chunks],
            [c.end for c in chunks],
            [c.block_ids[: -(-c.end // self.block_size)] for c in chunks],
            self._k_pool[0],
            self._model.dtype,
        )

    def _decode_groups(self, decodes: list[ChunkInput]) -> list[DecodeGroup]:
        """Decodes (by ascending context, as the batch has them) in groups that share one
        attention call each (`decode_group_bounds`)."""
        max_padding = MAX_MERGE_PADDING_GPU if self._pad_attention else MAX_MERGE_PADDING
        bounds = decode_group_bounds([c.end for c in decodes], self.block_size, max_padding)
        return [self._decode_group(decodes[start:end], start) for start, end in bounds]

    def _decode_group(self, decodes: list[ChunkInput], query_start: int) -> DecodeGroup:
        max_blocks = max(len(c.block_ids) for c in decodes)
        # Pad block tables with block 0: those keys are masked out.
        tables = [c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in decodes]
        return decode_group(
            query_start,
            torch.tensor(tables, dtype=torch.int32, device=self._device),
            torch.tensor([c.end for c in decodes], dtype=torch.int32, device=self._device),
        )

    def _pool_rows(self, block_ids: torch.Tensor) -> torch.Tensor:
        num_kv_heads, num_blocks = self._k_pool.shape[1:3]
        return pool_rows(block_ids, num_kv_heads, num_blocks)

    def _chunk_mask(self, chunk: ChunkInput) -> torch.Tensor | None:
        if chunk.start == 0:
            return None  # a whole causal block: SDPA's is_causal is exact here
        query_positions = torch.arange(chunk.start, chunk.end, device=self._device)
        key_positions = torch.arange(chunk.end, device=self._device)
        return (key_positions[None, :] <= query_positions[:, None])[None, None]


def _uses_graphs(graphs: str, forward: LlamaForward | None, device: torch.device) -> bool:
    """Whether decode-only steps take the static path (`ModelRunner`'s `graphs`)."""
    if graphs == "off" or (graphs == "auto" and device.type != "cuda"):
        return False
    if forward is None:
        if graphs == "on":
            raise ValueError("decode graphs need our own forward (--forward auto or own)")
        return False
    rope_type = getattr(forward.rotary, "rope_type", "default")
    if "dynamic" in str(rope_type) or rope_type == "longrope":
        # These RoPE types read the longest position on the host every step.
        log.info("no decode graphs: %s RoPE is not graph-safe", rope_type)
        return False
    return True


def _graph_step(
    forward: LlamaForward, k_pool: torch.Tensor, v_pool: torch.Tensor, inputs: DecodeInputs
) -> torch.Tensor:
    """A padded decode-only step as one decode group: shapes fixed by the bucket, no host
    reads, so it can be captured (`decode_graphs.py`)."""
    # The inputs are columns of the static buffer (strided): copied out inside the graph,
    # so every index op gets the contiguous index tensor it is written for.
    slot_mapping = inputs.slot_mapping.contiguous()
    group = decode_group(0, inputs.block_tables, inputs.context_lens.contiguous())
    step = StepMetadata(slot_mapping, [group], [])
    input_ids, positions = inputs.input_ids.contiguous(), inputs.positions.contiguous()
    return forward(input_ids, positions, k_pool, v_pool, step, inputs.keep)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool; on the CPU mapped as first written (`host_memory`; 4 KB pages)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return host_memory.zeros(shape, dtype, huge_pages=False)
