"""Load a deployment's weights onto the best device: CUDA with bf16 when present, else the CPU."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from shared.model_source import ModelSource
from worker.runner import cpu_kernels
from worker.runner.cpu_kernels import cpu_flags

log = logging.getLogger("llmfleet.worker")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: PreTrainedModel
    device: torch.device
    eos_token_ids: frozenset[int]
    pad_token_id: int

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding table: every input token id must be below it."""
        embeddings = self.model.get_input_embeddings()  # typed as any nn.Module
        assert isinstance(embeddings, torch.nn.Embedding)
        return embeddings.num_embeddings


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(requested: str = "auto", dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """CUDA with bf16 when a GPU is present; the CPU with bf16 where it has bf16 matmul units,
    else fp32 (unless told otherwise)."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if dtype == "auto":
        is_bf16_fast = device.type == "cuda" or _cpu_has_bf16_matmul()
        return device, (torch.bfloat16 if is_bf16_fast else torch.float32)
    return device, DTYPES[dtype]


def _cpu_has_bf16_matmul() -> bool:
    """AMX or AVX512-BF16: there bf16 batched steps measured 1.7-2x faster than fp32
    (docs/benchmarks.md). On a CPU with AVX2 alone, where our C kernels take every bf16
    matmul (`cpu_kernels.pair_matmuls_for_prompts`: oneDNN's is emulated there), bf16 too:
    half the bytes a step reads, a decode step of 1 sequence 4x and of 32 1.5x faster than
    fp32 on an AMD EPYC (Zen 3, session 38). Elsewhere (no C compiler, the kernels off) fp32
    stays."""
    if {"amx_bf16", "avx512_bf16"} & cpu_flags():
        return True
    return cpu_kernels.pair_matmuls_for_prompts()


def load(source: ModelSource, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    torch_device, torch_dtype = pick_device(device, dtype)
    log.info("loading %s on %s (%s)", source, torch_device, torch_dtype)
    model = AutoModelForCausalLM.from_pretrained(
        source.directory, dtype=torch_dtype, **source.load_kwargs
    ).to(torch_device)  # type: ignore[arg-type]  # `@wraps(nn.Module.to)` types it unbound: self first
    model.eval()
    return LoadedModel(model, torch_device, _eos_ids(model), _pad_id(model))


def release_cached_memory(loaded: LoadedModel) -> None:
    """Give the device the memory that torch's caching allocator keeps from freed tensors (a
    dropped engine's KV pool: a standby worker's, `worker/weights.py`). Nothing to do on the
    CPU, where freed tensors go back to the allocator at once."""
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()


def _eos_ids(model: PreTrainedModel) -> frozenset[int]:
    ids: set[int] = set()
    for config in (model.generation_config, model.config):
        eos = getattr(config, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
    return frozenset(ids)


def _pad_id(model: PreTrainedModel) -> int:
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config, "pad_token_id", None)
    return int(pad) if pad is not None else 0
