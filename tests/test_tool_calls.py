"""Tool calls: ``tools`` and ``tool_choice`` give OpenAI ``tool_calls`` whose arguments the grammar holds to.

The parser tests need no processes. The mesh tests run a tracker with two
nodes splitting a copy of the tiny model whose chat template renders tools
(Hermes / Qwen2.5 style, :data:`tests.tiny_model.TOOL_CHAT_TEMPLATE`), and one
node holding every layer, serving alone; all are asked through the official
client. The tiny model is random, so every call that parses and validates
against its function's schema is the grammar's doing. With ``auto`` the random
model never writes the tag, so a third mesh serves a copy whose weights make it
open a call (:func:`tests.tiny_model.build_caller_model`): ``auto`` then
answers with a call the client must validate.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

import jsonschema
import openai
import orjson
import pytest
from transformers import AutoTokenizer

from meshwire import openai as oa
from meshwire.resume import PROGRESS_KEY
from meshwire.tool_calls import TAG_OPEN, ToolCallAssembler, ToolCallParser
from services.node.api.streams import ChatStream
from services.node.head.events import Finished, TextDelta
from services.node.head.tokens import HeadTokenizer
from services.node.sampling.grammar import GrammarEngine, GrammarError
from services.node.sampling.tool_grammar import tool_grammar
from services.tracker.collect import collect
from tests.procs import TEST_SECRET, Service, start_service
from tests.tiny_mesh import tiny_mesh
from tests.tiny_model import VOCAB_SIZE, build_caller_model, build_tool_model

PROMPT: Final = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_PARAMETERS: Final = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS: Final = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"],
    "additionalProperties": False,
}
WEATHER: Final = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                   "parameters": WEATHER_PARAMETERS}}
TIME: Final = {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}}
PING: Final = {"type": "function", "function": {"name": "ping", "description": "Takes no arguments."}}
TOOLS: Final = [WEATHER, TIME, PING]
SCHEMAS: Final = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS,
                  "ping": {"type": "object", "additionalProperties": False}}
"""Every string is bounded, so one call ends well within :data:`MAX_TOKENS` whatever the model says."""
MAX_TOKENS: Final = 120
EOS: Final = 2
"""The tiny model's ``<|im_end|>``."""
SEEDS: Final = range(6)
NAMED: Final = {"type": "function", "function": {"name": "get_time"}}
HISTORY: Final = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


# --- the parser (no processes) ----------------------------------------------------------------------

CALLS_TEXT: Final = ('Let me look. <b>tags</b> stay text.<tool_call>\n{"name": "get_weather", "arguments": '
                     '{"city":"P}a\\"ris","unit":"c"}}\n</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}'
                     '\n</tool_call>')


def parse_in_pieces(text: str, cuts: list[int]) -> tuple[str, list[dict[str, Any]] | None, list[list[Any]]]:
    """``text`` fed to a parser cut at ``cuts``: the content, the assembled calls, each piece's deltas."""
    parser = ToolCallParser()
    assembler = ToolCallAssembler()
    content, pieces = [], []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        parsed = parser.feed(text[start:end])
        content.append(parsed.content)
        assembler.add(parsed.deltas())
        pieces.append(parsed.deltas())
    content.append(parser.flush().content)
    return "".join(content), assembler.result(), pieces


def test_the_parser_reads_content_then_calls_however_the_text_is_cut() -> None:
    expected = ("Let me look. <b>tags</b> stay text.",
                [("get_weather", '{"city":"P}a\\"ris","unit":"c"}'), ("ping", "{}")])
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(CALLS_TEXT)), rng.randint(0, 30)))
        content, calls, _ = parse_in_pieces(CALLS_TEXT, cuts)
        assert calls is not None
        assert (content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]) == expected
        assert all(call["id"].startswith("call_") and call["type"] == "function" for call in calls)


def test_no_markup_reaches_the_client_and_each_call_opens_with_its_id_and_name() -> None:
    _, _, pieces = parse_in_pieces(CALLS_TEXT, list(range(1, len(CALLS_TEXT))))  # one character at a time
    deltas = [delta for piece in pieces for delta in piece]
    openings = [delta for delta in deltas if "id" in delta]
    assert [(d["index"], d["function"]) for d in openings] == [(0, {"name": "get_weather", "arguments": ""}),
                                                               (1, {"name": "ping", "arguments": ""})]
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
               for d in deltas if "id" not in d)


def test_text_that_only_looks_like_a_tag_is_content_at_the_end() -> None:
    for text in ("a <tool_call", "<tool_c", "<tool_call> is a tag", "<tool_call>\n[1]"):
        parser = ToolCallParser()
        held = parser.feed(text)
        assert held.content + parser.flush().content == text and not parser.called
        assert text.startswith(held.content)


def test_a_parser_primed_with_the_text_sent_goes_on_where_the_client_is() -> None:
    for cut in range(len(CALLS_TEXT)):
        whole, _, _ = parse_in_pieces(CALLS_TEXT, [cut] if cut else [])
        primed = ToolCallParser()
        primed.feed(CALLS_TEXT[:cut])
        rest = primed.feed(CALLS_TEXT[cut:])
        first = ToolCallParser().feed(CALLS_TEXT[:cut])
        assert first.content + rest.content + primed.flush().content == whole
        names = [d["function"]["name"] for d in first.deltas() + rest.deltas() if "id" in d]
        assert names == ["get_weather", "ping"]


def test_history_tool_calls_and_results_render_through_the_template(tool_model_dir: Path) -> None:
    tokenizer = HeadTokenizer(AutoTokenizer.from_pretrained(tool_model_dir), (2,))
    assert tokenizer.supports_tools
    request = oa.ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY, "tools": TOOLS})
    text = AutoTokenizer.from_pretrained(tool_model_dir).decode(
        tokenizer.encode_chat([m.template_dict() for m in request.messages], TOOLS))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    assert '"name": "get_time"' in text and text.endswith("<|im_start|>assistant\n")


async def _events(*items: Any) -> AsyncIterator[Any]:
    for item in items:
        yield item


def head_stream(pieces: list[str], *, progress: bool) -> list[dict[str, Any]]:
    """The head's chat stream (parsed events) of an answer whose text comes in ``pieces`` and ends by itself."""
    stream = ChatStream("chatcmpl-1", "m", False, seed=7 if progress else None, tools=ToolCallParser())
    deltas = [TextDelta(piece, ids=(index,)) for index, piece in enumerate(pieces)]

    async def run() -> list[bytes]:
        rest = _events(*deltas[1:], Finished(finish_reason="stop", prompt_tokens=3, completion_tokens=len(pieces)))
        return [event async for event in stream.events(deltas[0], rest)]

    lines = [line for event in asyncio.run(run()) for line in event.decode().splitlines() if line]
    return [orjson.loads(line[len("data: "):]) for line in lines if line != "data: [DONE]"]


def test_the_head_streams_text_then_a_call_and_the_tracker_adds_them_up() -> None:
    pieces = ["Sure. <tool_", 'call>\n{"name": "pi', 'ng", "argu', 'ments": {', "}}\n</tool_call>"]
    events = head_stream(pieces, progress=False)
    deltas = [event["choices"][0]["delta"] for event in events]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "Sure. "}
    calls = [delta["tool_calls"][0] for delta in deltas if "tool_calls" in delta]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {"name": "ping", "arguments": ""}
    assert "".join(call["function"].get("arguments", "") for call in calls) == "{}"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls" and len(events) == 6  # a held piece: no event
    tracked = head_stream(pieces, progress=True)  # every piece's ids go to the tracker, held or not
    assert len(tracked) == len(pieces) + 2 and [e[PROGRESS_KEY]["ids"] for e in tracked[1:-1]] == [[0], [1], [2], [3], [4]]
    answer = orjson.loads(asyncio.run(collect(_events(*tracked, None), chat=True)))
    assert answer["choices"][0]["message"]["content"] == "Sure. "
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    assert [(c["type"], c["function"]) for c in answer["choices"][0]["message"]["tool_calls"]] == [
        ("function", {"name": "ping", "arguments": "{}"})]


# --- the grammar (no processes) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> GrammarEngine:
    return GrammarEngine(tiny_model_dir, VOCAB_SIZE, eos_ids=(EOS,))


def follows(engine: GrammarEngine, tokenizer: Any, choice: Any, text: str, *, parallel: bool = True) -> bool:
    """Whether the tool grammar of :data:`TOOLS` and ``choice`` lets the model write ``text``."""
    request = oa.ChatCompletionRequest.model_validate({"model": "m", "messages": PROMPT, "tools": TOOLS,
                                                       "tool_choice": choice})
    grammar = tool_grammar(request.tools or (), request.tool_choice, parallel=parallel)
    try:
        engine.constraint(grammar, tokenizer(text, add_special_tokens=False).input_ids)
    except GrammarError:
        return False
    return True


CALL: Final = '<tool_call>\n{"name": "get_time", "arguments": {"zone":3}}\n</tool_call>'


def test_the_grammar_holds_each_choice_to_its_calls(engine: GrammarEngine, tokenizer: Any) -> None:
    def ok(choice: Any, text: str, *, parallel: bool = True) -> bool:
        return follows(engine, tokenizer, choice, text, parallel=parallel)

    assert ok("auto", "Sure. " + CALL) and ok("auto", "Just text, <b>no</b> calls.")
    assert not ok("auto", "Sure. <tool_call> is a word")  # once the tag is written, a call follows
    assert not ok("auto", CALL.replace('{"zone":3}', '{"zone": 3}'))  # compact JSON
    assert not ok("auto", CALL.replace("3", "99"))  # the schema's maximum
    assert ok("required", CALL + "\n" + CALL) and not ok("required", "Sure. " + CALL)
    assert not ok("required", CALL + "\n" + CALL, parallel=False)
    assert ok(NAMED, CALL) and not ok(NAMED, CALL.replace("get_time", "ping"))
    assert ok("required", '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')


# --- through the mesh ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tool_model(tiny_model_dir, tmp_path_factory.mktemp("tools") / "tiny-tools")


@pytest.fixture(scope="module")
def mesh(tool_model_dir: Path) -> Iterator[tuple[Service, str]]:
    with tiny_mesh(tool_model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def client(mesh: tuple[Service, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh[0].url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def solo(tool_model_dir: Path) -> Iterator[openai.OpenAI]:
    """One node holding every layer, serving alone: its own OpenAI API assembles the tool calls."""
    node = start_service("node", {"MESHNET_MODEL": str(tool_model_dir), "MESHNET_DTYPE": "float32",
                                  "MESHNET_DEVICE": "cpu"})
    try:
        yield openai.OpenAI(base_url=f"{node.url}/v1", api_key=TEST_SECRET, max_retries=0, timeout=120)
    finally:
        node.stop()


def ask(client: openai.OpenAI, model: str, **extra: Any) -> Any:
    body = {"messages": PROMPT, "max_tokens": MAX_TOKENS, "tools": TOOLS, "temperature": 1.0, **extra}
    return client.chat.completions.create(model=model, **body)


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or ()]


def assert_valid_calls(choice: Any) -> list[tuple[str, str]]:
    """Every call of a choice that finished with ``tool_calls``: a known function, arguments that validate."""
    assert choice.finish_reason == "tool_calls", choice
    calls = calls_of(choice.message)
    assert calls and choice.message.content is None, choice
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def streamed(client: openai.OpenAI, model: str, **extra: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    """A streamed answer added up as the OpenAI client would: content, calls, finish reason; checking each
    call's first delta carries its id, type and name and the later ones only arguments."""
    content, finish = "", None
    calls: dict[int, dict[str, Any]] = {}
    for chunk in ask(client, model, stream=True, **extra):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls:
                    assert delta.id.startswith("call_") and delta.type == "function", delta
                    assert delta.function.name and delta.function.arguments == "", delta
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None, delta
                    calls[delta.index]["arguments"] += delta.function.arguments
    assert "<tool_call" not in content and "</tool_call>" not in content
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], finish


def test_required_gives_valid_calls_for_every_seed(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    answers = [ask(client, mesh[1], tool_choice="required", parallel_tool_calls=False, seed=seed) for seed in SEEDS]
    calls = [assert_valid_calls(answer.choices[0]) for answer in answers]
    assert all(len(one) == 1 for one in calls)
    assert len({tuple(one) for one in calls}) > 1, "different seeds draw different calls"


def test_parallel_calls_each_validate(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    for seed in SEEDS:
        choice = ask(client, mesh[1], tool_choice="required", seed=seed, max_tokens=300).choices[0]
        if choice.finish_reason == "length":  # the model chained calls past max_tokens: all but the last are whole
            for call in choice.message.tool_calls[:-1]:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        else:
            assert_valid_calls(choice)


def test_a_named_function_is_the_one_called(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    for seed in SEEDS:
        calls = assert_valid_calls(ask(client, mesh[1], tool_choice=NAMED, seed=seed).choices[0])
        assert [name for name, _ in calls] == ["get_time"]


def test_auto_answers_text_or_valid_calls(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    for seed in SEEDS:
        choice = ask(client, mesh[1], seed=seed, max_tokens=60).choices[0]
        if choice.finish_reason == "tool_calls":
            choice.message.content = None  # text before the calls is allowed in auto
            assert_valid_calls(choice)
        else:
            assert choice.message.tool_calls is None or choice.finish_reason == "length", choice
            assert "<tool_call>\n" not in (choice.message.content or "")


@pytest.fixture(scope="module")
def caller(tool_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, str]]:
    """A tracker and two nodes serving the tool model rewired to open a call as soon as it answers."""
    tokenizer = AutoTokenizer.from_pretrained(tool_model_dir)
    last = HeadTokenizer(tokenizer, (EOS,)).encode_chat(PROMPT, TOOLS)[-1]  # the template's ``assistant\n``
    tag = tokenizer(TAG_OPEN, add_special_tokens=False).input_ids
    assert last not in tag and len(set(tag)) == len(tag), "each chain token has one successor"
    chain = list(zip([last, *tag[:-1]], tag, strict=True))
    model_dir = build_caller_model(tool_model_dir, tmp_path_factory.mktemp("caller") / "tiny-caller", chain)
    with tiny_mesh(model_dir) as (tracker, model):
        yield openai.OpenAI(base_url=f"{tracker.url}/v1", api_key="unused", max_retries=0, timeout=120), model


def test_auto_makes_the_call_a_model_opens_and_the_call_validates(caller: tuple[openai.OpenAI, str]) -> None:
    """``auto`` with a model that writes ``<tool_call>``: the grammar holds the rest to a call of a declared
    function whose arguments follow its schema, whole and streamed, greedy and seeded."""
    client, model = caller
    for extra in ({"temperature": 0}, *({"seed": seed} for seed in SEEDS)):
        whole = ask(client, model, parallel_tool_calls=False, **extra).choices[0]
        calls = assert_valid_calls(whole)
        assert len(calls) == 1 and calls[0][0] in SCHEMAS, calls
        content, streamed_calls, finish = streamed(client, model, parallel_tool_calls=False, **extra)
        assert (content or None, streamed_calls, finish) == (None, calls, "tool_calls")


def test_streamed_and_whole_answers_agree(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    for extra in ({"tool_choice": "required", "seed": 3}, {"tool_choice": NAMED, "temperature": 0},
                  {"seed": 1, "max_tokens": 60}, {"tool_choice": "required", "temperature": 0.8, "seed": 2,
                                                  "parallel_tool_calls": False, "logprobs": True}):
        whole = ask(client, mesh[1], **extra).choices[0]
        content, calls, finish = streamed(client, mesh[1], **extra)
        assert (content or None, calls, finish) == (whole.message.content or None, calls_of(whole.message),
                                                    whole.finish_reason)


def test_a_node_alone_answers_as_the_mesh_does(client: openai.OpenAI, mesh: tuple[Service, str],
                                               solo: openai.OpenAI) -> None:
    for extra in ({"tool_choice": "required", "seed": 4}, {"seed": 5, "max_tokens": 60}):
        two = ask(client, mesh[1], **extra).choices[0]
        one = ask(solo, mesh[1], **extra).choices[0]
        assert (one.message.content, calls_of(one.message), one.finish_reason) == \
            (two.message.content, calls_of(two.message), two.finish_reason)
        content, calls, finish = streamed(solo, mesh[1], **extra)
        assert (content or None, calls, finish) == (two.message.content or None, calls_of(two.message),
                                                    two.finish_reason)


def test_a_conversation_with_a_call_and_its_result_renders_and_answers(
        client: openai.OpenAI, mesh: tuple[Service, str], tool_model_dir: Path) -> None:
    answer = client.chat.completions.create(model=mesh[1], messages=HISTORY, tools=TOOLS, max_tokens=8,
                                            temperature=0)  # type: ignore[arg-type]
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tokenizer = HeadTokenizer(AutoTokenizer.from_pretrained(tool_model_dir), (2,))
    request = oa.ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY})
    prompt = tokenizer.encode_chat([m.template_dict() for m in request.messages], TOOLS)
    assert answer.usage.prompt_tokens == len(prompt)


def test_n_choices_with_tools_are_each_the_one_choice_answer(client: openai.OpenAI,
                                                             mesh: tuple[Service, str]) -> None:
    several = ask(client, mesh[1], tool_choice="required", parallel_tool_calls=False, seed=7, n=2)
    singles = [ask(client, mesh[1], tool_choice="required", parallel_tool_calls=False, seed=7 + i) for i in range(2)]
    assert [calls_of(choice.message) for choice in several.choices] == \
        [calls_of(single.choices[0].message) for single in singles]


@pytest.mark.parametrize(("extra", "param", "problem"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "'nope'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]}}}]}, "tools[0].function.parameters",
     "unsatisfiable"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {
        "a": {"not": {"type": "string"}}}}}}]}, "tools[1].function.parameters", "function 'g'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "JSON schema of an object"),
    ({"tools": [WEATHER, WEATHER]}, None, "more than once"),
    ({"response_format": {"type": "json_object"}}, None, "response_format"),
    ({"messages": [*HISTORY[:1], {**HISTORY[1], "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    ({"messages": [*HISTORY[:2], {"role": "tool", "content": "21"}]}, None, "tool_call_id"),
])
def test_bad_tools_are_a_400_naming_the_problem(client: openai.OpenAI, mesh: tuple[Service, str],
                                                extra: dict[str, Any], param: str | None, problem: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, mesh[1], **extra)
    error = refused.value.body
    assert isinstance(error, dict) and problem in error["message"], error
    if param is not None:
        assert error["param"] == param, error


def test_raw_completions_and_the_responses_api_take_no_tools(client: openai.OpenAI,
                                                             mesh: tuple[Service, str]) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=mesh[1], prompt="hi", max_tokens=2,
                                  extra_body={"tools": TOOLS})
    assert "/v1/chat/completions" in str(refused.value.body)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=mesh[1], input="hi", max_output_tokens=4,
                                tools=[{"type": "function", "name": "ping", "parameters": {}}])  # type: ignore[list-item]
    assert "/v1/chat/completions" in str(refused.value.body)
