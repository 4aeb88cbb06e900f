"""Load a deployment's weights onto the best device: CUDA with bf16 when present, else the CPU."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from shared.model_source import ModelSource

log = logging.getLogger("llmfleet.worker")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: PreTrainedModel
    device: torch.device
    eos_token_ids: frozenset[int]
    pad_token_id: int


def pick_device(requested: str = "auto") -> tuple[torch.device, torch.dtype]:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    return device, (torch.bfloat16 if device.type == "cuda" else torch.float32)


def load(source: ModelSource, device: str = "auto") -> LoadedModel:
    torch_device, dtype = pick_device(device)
    log.info("loading %s on %s (%s)", source, torch_device, dtype)
    model = AutoModelForCausalLM.from_pretrained(
        source.directory, dtype=dtype, **source.load_kwargs
    ).to(torch_device)
    model.eval()
    return LoadedModel(model, torch_device, _eos_ids(model), _pad_id(model))


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
