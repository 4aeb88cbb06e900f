"""The correctness reference for the engines: what `model.generate` gives one request alone."""

from __future__ import annotations

import torch


def greedy_alone(loaded, prompt_ids: list[int], max_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    out = loaded.model.generate(
        input_ids,
        # Explicit: on SmolLM2 the pad token is <|im_end|>, which generate would mask.
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=loaded.pad_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()
