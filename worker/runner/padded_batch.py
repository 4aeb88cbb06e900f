"""A padded static batch over the unmodified Hugging Face forward: the baseline engines' runner.

Prompts are left-padded to one length and decoded together step by step; a finished row
keeps occupying its slot until the whole batch is done, which is exactly the waste that
continuous batching removes.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from shared.protocol import SamplingParams
from worker.runner import sampler
from worker.runner.loader import LoadedModel
from worker.step_batch import SamplingFailure


class PaddedBatch:
    def __init__(
        self,
        loaded: LoadedModel,
        prompts: list[list[int]],
        params: list[SamplingParams],
    ) -> None:
        self._loaded = loaded
        self._params = params
        self._generators = [sampler.make_generator(p, loaded.device) for p in params]
        width = max(len(p) for p in prompts)
        pad = loaded.pad_token_id
        device = loaded.device
        self._input_ids = torch.tensor(
            [[pad] * (width - len(p)) + p for p in prompts], device=device
        )
        self._attention_mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device
        )
        self._cache = DynamicCache(config=loaded.model.config)
        self._next_positions: torch.Tensor | None = None

    @torch.inference_mode()
    def prefill(self) -> list[int | SamplingFailure]:
        positions = (self._attention_mask.cumsum(-1) - 1).clamp(min=0)
        self._next_positions = positions[:, -1:] + 1
        return self._forward(self._input_ids, positions)

    @torch.inference_mode()
    def decode(self, last_token_ids: list[int]) -> list[int | SamplingFailure]:
        assert self._next_positions is not None, "prefill first"
        tokens = torch.tensor(last_token_ids, device=self._loaded.device).unsqueeze(-1)
        ones = torch.ones_like(tokens)
        self._attention_mask = torch.cat([self._attention_mask, ones], dim=-1)
        positions = self._next_positions
        self._next_positions = positions + 1
        return self._forward(tokens, positions)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> list[int | SamplingFailure]:
        out = self._loaded.model(
            input_ids=input_ids,
            attention_mask=self._attention_mask,
            position_ids=positions,
            cache=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return sampler.sample(out.logits[:, -1, :], self._params, self._generators)
