"""An answer's tokens become the text deltas a head sends: nothing lost, nothing sent twice, stop strings and
split characters held back until they resolve, a completion's echo on the first delta only."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from services.node.head.answer_text import AnswerText, sent_text
from services.node.head.events import Echo, TextDelta
from services.node.head.tokens import HeadTokenizer
from services.node.sampling.sampler import Pick

TEXT = "The quick brown fox jumps over the lazy dog. Caf\u00e9 \u2603 done."


def _head(tokenizer: PreTrainedTokenizerBase) -> HeadTokenizer:
    return HeadTokenizer(tokenizer, (tokenizer.eos_token_id or 0,))


def _feed(text: AnswerText, ids: list[int]) -> list[TextDelta]:
    deltas = []
    for token in ids:
        delta = text.push(Pick(token, None))
        if delta is not None:
            deltas.append(delta)
        if text.stopped:
            break
    return deltas


def test_the_deltas_join_to_the_decoded_answer_and_carry_every_id_once(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    text = AnswerText(_head(tokenizer), ())
    deltas = _feed(text, ids)
    last = text.finish()
    if last is not None:
        deltas.append(last)
    assert "".join(d.text for d in deltas) == tokenizer.decode(ids)
    assert [i for d in deltas for i in d.ids] == ids
    assert all(d.echo is None for d in deltas)
    assert not text.stopped


def test_a_stop_string_ends_the_answer_before_it(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    text = AnswerText(_head(tokenizer), ("lazy",))
    deltas = _feed(text, ids)
    assert text.stopped
    assert "".join(d.text for d in deltas) == "The quick brown fox jumps over the "
    assert text.finish() is None


def test_text_that_may_begin_a_stop_string_waits_for_the_end(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("over the laz", add_special_tokens=False)
    text = AnswerText(_head(tokenizer), ("lazy",))
    sent = "".join(d.text for d in _feed(text, ids))
    assert not sent.endswith("laz")
    last = text.finish()
    assert last is not None and sent + last.text == "over the laz"
    assert not text.stopped


def test_the_echo_rides_the_first_delta_only(tokenizer: PreTrainedTokenizerBase) -> None:
    echo = Echo("prompt", (1, 2))
    text = AnswerText(_head(tokenizer), ())
    text.echo = echo
    deltas = _feed(text, tokenizer.encode(TEXT, add_special_tokens=False))
    assert deltas[0].echo is echo
    assert all(d.echo is None for d in deltas[1:])


def test_an_echo_with_no_text_still_goes_out_at_the_end(tokenizer: PreTrainedTokenizerBase) -> None:
    text = AnswerText(_head(tokenizer), ())
    text.echo = Echo("prompt", (1, 2))
    last = text.finish()
    assert last is not None and last.text == "" and last.echo is not None


def test_a_continued_answer_goes_on_after_the_text_already_sent(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    cut = len(ids) // 2
    text = AnswerText(_head(tokenizer), ())
    before = text.replay(ids[:cut])
    assert before == sent_text(_head(tokenizer), (), ids[:cut])
    deltas = _feed(text, ids[cut:])
    last = text.finish()
    rest = "".join(d.text for d in deltas) + ("" if last is None else last.text)
    assert before + rest == tokenizer.decode(ids)
