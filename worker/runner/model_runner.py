"""The continuous-batching model runner: owns the KV tensors, runs one `SchedulerOutput`.

One forward pass per step over the packed tokens of every scheduled chunk (decodes first,
then prefill chunks), with our paged attention (`paged_attention.py`) and `logits_to_keep`
set to the last position of each chunk that samples, so the LM head runs only there.
"""

from __future__ import annotations

import torch

from shared.protocol import SamplingParams
from worker.runner import sampler
from worker.runner.loader import LoadedModel
from worker.runner.paged_attention import (
    ATTENTION_NAME,
    STEP_KWARG,
    DecodeGroup,
    PagedKVCache,
    PrefillSpan,
    StepMetadata,
    pool_rows,
)
from worker.step_batch import ChunkInput, StepBatch


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


def decode_group_bounds(ends: list[int], block_size: int) -> list[tuple[int, int]]:
    """[start, end) of each group of decodes, given their contexts in ascending order: split
    where the context more than doubles, so no row is padded to more than twice its length;
    then a group joins the next one up when padding its rows to that one's longest context
    adds at most `MAX_MERGE_PADDING` positions (one call fewer costs less than that)."""
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
        if added <= MAX_MERGE_PADDING:
            merged[-1] = (low_start, end)
        else:
            merged.append((start, end))
    return merged


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int) -> None:
        self._loaded = loaded
        self._model = loaded.model
        self._device = loaded.device
        self.block_size = block_size
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
            block_size,
            head_dim,
        )
        self._k_pool = torch.zeros(shape, dtype=self._model.dtype, device=self._device)
        self._v_pool = torch.zeros(shape, dtype=self._model.dtype, device=self._device)
        self._model.set_attn_implementation(ATTENTION_NAME)
        self._generators: dict[str, torch.Generator | None] = {}
        self.fault_token_id: int | None = None  # chaos tests: a step holding it fails

    @property
    def vocab_size(self) -> int:
        return self._loaded.vocab_size

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> list[int | sampler.SamplingFailure]:
        """Run the step; one sampled token per sampling chunk, in `batch.chunks` order, or
        that chunk's `SamplingFailure` (the forward pass is shared, sampling fails per
        sequence)."""
        chunks = batch.chunks
        input_ids, positions, slot_mapping, keep = self._pack(chunks)
        if self.fault_token_id is not None and bool((input_ids == self.fault_token_id).any()):
            raise RuntimeError("injected fault: the step's input holds the fault token")
        step = self._metadata(batch, slot_mapping)
        result = self._model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            cache=PagedKVCache(self._k_pool, self._v_pool, slot_mapping),
            use_cache=True,
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self._device),
            **{STEP_KWARG: step},
        )
        params = [c.sampling for c in chunks if c.sampling is not None]
        generators = [self._generator(c.request_id, c.sampling) for c in chunks if c.sampling]
        return sampler.sample(result.logits[0], params, generators)

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
            mask = self._chunk_mask(chunk)
            prefills.append(PrefillSpan(query_start, query_end, rows, chunk.end, mask))
            query_start = query_end
        return StepMetadata(slot_mapping, self._decode_groups(batch.decodes), prefills)

    def _decode_groups(self, decodes: list[ChunkInput]) -> list[DecodeGroup]:
        """Decodes (by ascending context, as the batch has them) in groups that share one
        attention call each (`decode_group_bounds`)."""
        bounds = decode_group_bounds([c.end for c in decodes], self.block_size)
        return [self._decode_group(decodes[start:end], start) for start, end in bounds]

    def _decode_group(self, decodes: list[ChunkInput], query_start: int) -> DecodeGroup:
        max_blocks = max(len(c.block_ids) for c in decodes)
        # Pad block tables with block 0: those keys are masked out.
        tables = [c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in decodes]
        block_ids = torch.tensor(tables, device=self._device).flatten()
        lengths = torch.tensor([c.end for c in decodes], device=self._device)
        positions = torch.arange(max_blocks * self.block_size, device=self._device)
        is_padding = (positions[None, :] >= lengths[:, None])[:, None, :]
        bias = torch.zeros(is_padding.shape, device=self._device).masked_fill_(
            is_padding, float("-inf")
        )
        rows = self._pool_rows(block_ids)
        return DecodeGroup(query_start, query_start + len(decodes), rows, bias)

    def _pool_rows(self, block_ids: torch.Tensor) -> torch.Tensor:
        num_kv_heads, num_blocks = self._k_pool.shape[1:3]
        return pool_rows(block_ids, num_kv_heads, num_blocks)

    def _chunk_mask(self, chunk: ChunkInput) -> torch.Tensor | None:
        if chunk.start == 0:
            return None  # a whole causal block: SDPA's is_causal is exact here
        query_positions = torch.arange(chunk.start, chunk.end, device=self._device)
        key_positions = torch.arange(chunk.end, device=self._device)
        return (key_positions[None, :] <= query_positions[:, None])[None, None]
