"""What single-process transformers generates: the reference every exactness test compares against."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from meshwire.sampling_params import SamplingParams


def reference_generate(
    model: PreTrainedModel, prompt: torch.Tensor, params: SamplingParams, limit: int
) -> list[int]:
    """The new tokens ``model.generate`` makes for ``prompt`` with ``params`` (greedy or seeded sampling)."""
    torch.manual_seed(params.seed)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=not params.greedy,
        temperature=params.temperature if not params.greedy else None,
        top_k=params.top_k,
        top_p=params.top_p,
        max_new_tokens=limit,
    )
    return out[0, prompt.shape[1] :].tolist()
