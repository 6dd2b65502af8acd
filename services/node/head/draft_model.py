"""A draft model on the head (``--draft-model``): a small causal LM that proposes the next ``k`` tokens.

Prompt lookup (:mod:`services.node.head.drafter`) only guesses where the answer
copies the conversation. A small model of the same family (SmolLM2-135M
drafting for a 1.7B, say) guesses everywhere, at the price of running it. The
head loads it from a local folder, once, and refuses to start when its
tokenizer's vocabulary is not the served model's (its token ids would mean
other tokens, and every draft would be rejected at best).

Each request that drafts gets a :class:`DraftSession`: the draft model's own KV
cache and the ids it holds. Before a draft the session keeps the longest
prefix of its ids that the conversation still has (the verified tokens: a
rejected draft's rows are cropped away), feeds the rest, and then picks ``k``
tokens greedily, one forward each. The session is freed when the request
ends (:meth:`DraftSession.close`); sessions are bounded in number
(:data:`MAX_DRAFT_SESSIONS`) and in length (:data:`MAX_DRAFT_CONTEXT`): a
request beyond either drafts with prompt lookup instead.

Every forward runs on the node's compute worker (:class:`ComputeWorker`), so the
draft model takes turns with the shard's layers instead of fighting them for
the cores. Drafts are guesses: the tail verifies each one against the served
model, so the draft model's number format and rounding never change the answer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from services.node.engine.compute import ComputeWorker

logger = logging.getLogger(__name__)

MAX_DRAFT_SESSIONS: Final = 64
"""Requests drafting with the model at once at most; later ones draft with prompt lookup until one ends."""
MAX_DRAFT_CONTEXT: Final = 4096
"""Longest conversation (tokens) a draft session holds; a longer one drafts with prompt lookup."""
DRAFT_DTYPE: Final = torch.float32
"""The draft model's number format on a CPU (its drafts are verified, so this is about speed, not exactness)."""


class DraftModelError(ValueError):
    """The draft model cannot serve this head (missing folder, not a causal LM, another vocabulary)."""


class DraftModel:
    """A loaded draft model and the sessions drafting with it."""

    def __init__(self, model: PreTrainedModel, worker: ComputeWorker, *, max_sessions: int = MAX_DRAFT_SESSIONS,
                 max_context: int = MAX_DRAFT_CONTEXT) -> None:
        self.model = model
        self._worker = worker
        self.max_sessions = max_sessions
        self.max_context = max_context
        self.open_sessions = 0

    def session(self) -> DraftSession | None:
        """A new draft session, or ``None`` when :attr:`max_sessions` are open."""
        if self.open_sessions >= self.max_sessions:
            return None
        self.open_sessions += 1
        return DraftSession(self)

    def _released(self) -> None:
        self.open_sessions -= 1


class DraftSession:
    """One request's draft state: the draft model's KV cache and the token ids it holds."""

    def __init__(self, owner: DraftModel) -> None:
        self._owner = owner
        self._cache: DynamicCache | None = DynamicCache(config=owner.model.config)
        self._ids: list[int] = []
        """The ids whose KV rows the cache holds, in order."""

    @property
    def held(self) -> int:
        """Positions the draft cache holds."""
        return len(self._ids)

    async def propose(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """``k`` tokens the draft model picks greedily after ``tokens`` (prompt and verified answer so far).

        Nothing when the session is closed or ``tokens`` is longer than the session may hold.
        """
        if self._cache is None or k < 1 or not tokens or len(tokens) + k > self._owner.max_context:
            return ()
        return await self._owner._worker.compute(self._propose_sync, list(tokens), k)

    @torch.inference_mode()
    def _propose_sync(self, tokens: list[int], k: int) -> tuple[int, ...]:
        cache = self._cache
        if cache is None:  # closed while this waited for the worker
            return ()
        keep = _common_prefix(self._ids, tokens)
        keep = min(keep, len(tokens) - 1)  # at least one token is fed: its logits give the first draft
        if keep < len(self._ids):
            cache.crop(keep - len(self._ids))  # a negative count: the rows to drop from the end
            del self._ids[keep:]
        model = self._owner.model
        feed = tokens[keep:]
        drafted: list[int] = []
        while True:
            out = model(input_ids=torch.tensor([feed], dtype=torch.long), cache=cache, use_cache=True)
            self._ids.extend(feed)
            token = int(torch.argmax(out.logits[0, -1]).item())
            drafted.append(token)
            if len(drafted) == k:
                return tuple(drafted)
            feed = [token]

    def close(self) -> None:
        """Free the draft cache (the request ended); idempotent."""
        if self._cache is None:
            return
        self._cache = None
        self._ids = []
        self._owner._released()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for index in range(n):
        if a[index] != b[index]:
            return index
    return n


def vocabulary_problem(draft: PreTrainedTokenizerBase, target_vocab: Mapping[str, int]) -> str | None:
    """Why ``draft``'s tokenizer cannot draft for a model whose vocabulary is ``target_vocab``, or ``None``."""
    draft_vocab = draft.get_vocab()
    if draft_vocab != dict(target_vocab):
        differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda item: item[1])[:3]
        return (f"its vocabulary ({len(draft_vocab)} tokens) is not the served model's ({len(target_vocab)} tokens); "
                f"e.g. {differing}")
    return None


def load_draft_model(folder: Path, target_vocab: Mapping[str, int], worker: ComputeWorker) -> DraftModel:
    """Load the draft model in ``folder`` for a head whose tokenizer's vocabulary is ``target_vocab``
    (synchronous: call it off the event loop).

    Raises :class:`DraftModelError` naming what is wrong: no such folder, no causal LM in it, or a tokenizer
    whose vocabulary is not ``target_vocab``.
    """
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise DraftModelError(f"--draft-model {folder} is not a folder holding a Hugging Face model (config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - whatever the reason, the folder cannot draft for this head
        raise DraftModelError(f"--draft-model {folder}: its tokenizer does not load ({exc})") from None
    problem = vocabulary_problem(tokenizer, target_vocab)
    if problem is not None:
        raise DraftModelError(f"--draft-model {folder} cannot draft for this model: {problem}")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=DRAFT_DTYPE).eval()
    except Exception as exc:  # noqa: BLE001
        raise DraftModelError(f"--draft-model {folder}: not a causal language model transformers can load "
                              f"({exc})") from None
    logger.info("draft model %s: %d layers, %.0f M parameters", folder, model.config.num_hidden_layers,
                sum(p.numel() for p in model.parameters()) / 1e6)
    return DraftModel(model, worker)
