"""Log-probabilities as OpenAI answers them: the chat form and the legacy completions form.

The tail reports, per sampled token, its log-probability and the likeliest
alternatives as token ids (:class:`~meshwire.sampling_params.TokenLogprobs`,
computed from the model's logits after ``logit_bias``, before temperature,
top-k and top-p). Here the head turns ids into what a client reads: each
token's text and its bytes (a byte-level piece may be part of a character; its
text then shows the incomplete bytes as ``\\xNN`` escapes, and ``bytes`` holds
them exactly).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshwire import openai as oa
from services.node.head.events import Echo, TokenInfo
from services.node.head.tokens import HeadTokenizer


def token_text(tokenizer: HeadTokenizer, token: int) -> tuple[str, bytes]:
    """The text and the bytes of ``token``."""
    raw = tokenizer.token_bytes(token)
    return raw.decode("utf-8", errors="backslashreplace"), raw


def chat_logprobs(tokenizer: HeadTokenizer, tokens: Sequence[TokenInfo]) -> oa.ChatLogprobs:
    """``choices[].logprobs`` of a chat answer (or chunk) made of ``tokens``."""
    content = []
    for info in tokens:
        text, raw = token_text(tokenizer, info.token)
        top = []
        for alternative, logprob in info.logprobs.top:
            alt_text, alt_raw = token_text(tokenizer, alternative)
            top.append(oa.TopLogprob(token=alt_text, logprob=logprob, bytes=tuple(alt_raw)))
        content.append(oa.TokenLogprob(token=text, logprob=info.logprobs.logprob, bytes=tuple(raw),
                                       top_logprobs=tuple(top)))
    return oa.ChatLogprobs(content=tuple(content))


def completion_logprobs(tokenizer: HeadTokenizer, tokens: Sequence[TokenInfo], offset: int) -> oa.CompletionLogprobs:
    """``choices[].logprobs`` of a completion made of ``tokens`` whose text starts at character ``offset``."""
    texts, offsets, top = [], [], []
    for info in tokens:
        text, _ = token_text(tokenizer, info.token)
        texts.append(text)
        offsets.append(offset)
        offset += len(text)
        top.append({token_text(tokenizer, alternative)[0]: logprob for alternative, logprob in info.logprobs.top})
    return oa.CompletionLogprobs(tokens=tuple(texts), token_logprobs=tuple(i.logprobs.logprob for i in tokens),
                                 top_logprobs=tuple(top), text_offset=tuple(offsets))


def echo_logprobs(tokenizer: HeadTokenizer, echo: Echo) -> oa.CompletionLogprobs:
    """The legacy log-probabilities of an echoed prompt: its tokens from character 0, the first with ``null``."""
    texts, offsets, values, top = [], [], [], []
    offset = 0
    for token, logprobs in zip(echo.ids, echo.logprobs or (), strict=True):
        text, _ = token_text(tokenizer, token)
        texts.append(text)
        offsets.append(offset)
        offset += len(text)
        values.append(None if logprobs is None else logprobs.logprob)
        top.append(None if logprobs is None else
                   {token_text(tokenizer, alternative)[0]: value for alternative, value in logprobs.top})
    return oa.CompletionLogprobs(tokens=tuple(texts), token_logprobs=tuple(values), top_logprobs=tuple(top),
                                 text_offset=tuple(offsets))


def joined(first: oa.CompletionLogprobs, second: oa.CompletionLogprobs | None) -> oa.CompletionLogprobs:
    """Two runs of legacy log-probabilities, one after the other."""
    if second is None:
        return first
    return oa.CompletionLogprobs(tokens=first.tokens + second.tokens,
                                 token_logprobs=first.token_logprobs + second.token_logprobs,
                                 top_logprobs=first.top_logprobs + second.top_logprobs,
                                 text_offset=first.text_offset + second.text_offset)
