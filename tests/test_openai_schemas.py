"""OpenAI schemas: what the API accepts, what it refuses (naming the field), and what we send back."""

from __future__ import annotations

import openai.types as oa
import openai.types.chat as oa_chat
import orjson
import pytest
from pydantic import ValidationError

from meshwire import limits
from meshwire.errors import error_body
from meshwire.openai import (
    SEED_MAX,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
    choice_seed,
    new_id,
    validation_error_message,
    validation_error_param,
)
from meshwire.sse import DONE, parse_sse_line, sse_event

BASE = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]}


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(orjson.dumps({**BASE, **fields}))


def chat_refusal(body: object) -> tuple[str, str | None]:
    """The one-sentence message and the ``param`` of a refused chat request."""
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate_json(orjson.dumps(body))
    return validation_error_message(caught.value), validation_error_param(caught.value)


# --- what is accepted --------------------------------------------------------------------


def test_a_minimal_request_has_openai_defaults():
    request = chat()
    assert request.stream is False and request.temperature is None and request.stop_sequences == ()
    assert request.token_budget(default=64) == 64


def test_an_integer_temperature_is_a_number_as_json_intends():
    assert chat(temperature=1).temperature == 1.0
    assert chat(temperature=0).temperature == 0.0


def test_nothing_is_silently_ignored_an_unknown_parameter_is_refused_as_openai_does():
    message, param = chat_refusal({**BASE, "guided_json": {"type": "object"}})
    assert message == "unrecognized request argument supplied: guided_json" and param == "guided_json"


def test_defaults_of_unsupported_features_and_the_no_effect_parameters_are_accepted():
    request = chat(logit_bias={"50256": -100}, response_format={"type": "text"}, tool_choice="none",
                   metadata={"a": "b"}, store=False, user="u")
    assert request.logit_bias_pairs == ((50256, -100.0),) and request.top_logprobs_wanted is None


def test_response_format_takes_text_json_object_and_json_schema_and_refuses_anything_else():
    assert chat(response_format={"type": "json_object"}).response_format.type == "json_object"
    spec = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object"}, "strict": True}}).response_format.json_schema
    assert (spec.name, spec.json_schema, spec.strict) == ("p", {"type": "object"}, True)
    message, param = chat_refusal({**BASE, "response_format": {"type": "something"}})
    assert param == "response_format" and "json_schema" in message
    message, param = chat_refusal({**BASE, "response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"enum": ["x" * 10_000]}}}})
    assert param == "response_format.json_schema.schema" and "8192 characters" in message


TOOL: dict = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                              "parameters": {"type": "object", "properties": {
                                                  "city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_and_tool_choice_are_read_and_checked_against_each_other():
    request = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert request.wants_tools and request.tools[0].function.name == "get_weather"
    assert not chat(tools=[TOOL], tool_choice="none").wants_tools
    assert chat(tools=[TOOL]).wants_tools and not chat().wants_tools
    message, param = chat_refusal({**BASE, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "other"}}})
    assert "'other'" in message and "not among the tools" in message
    message, _ = chat_refusal({**BASE, "tool_choice": "required"})
    assert "needs tools" in message
    message, param = chat_refusal({**BASE, "tools": [{"type": "function", "function": {"name": "a b"}}]})
    assert param == "tools[0].function.name"


def test_history_tool_calls_and_results_are_read_and_given_to_the_template_with_object_arguments():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    request = chat(messages=[BASE["messages"][0], {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "cold"}])
    assistant, tool = (message.template_dict() for message in request.messages[1:])
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert tool == {"role": "tool", "content": "cold", "tool_call_id": "call_1"}
    bad = {**call, "function": {"name": "f", "arguments": "[1]"}}
    message, param = chat_refusal({**BASE, "messages": [{"role": "assistant", "content": None, "tool_calls": [bad]}]})
    assert param == "messages[0].tool_calls[0].function.arguments" and "JSON object" in message
    message, _ = chat_refusal({**BASE, "messages": [{"role": "user", "content": "x", "tool_calls": [call]}]})
    assert "only an assistant" in message
    message, _ = chat_refusal({**BASE, "messages": [{"role": "tool", "content": "x"}]})
    assert "tool_call_id" in message


def test_tools_are_refused_with_response_format_and_on_raw_completions():
    message, _ = chat_refusal({**BASE, "tools": [TOOL], "response_format": {"type": "json_object"}})
    assert "response_format cannot be combined with tools" in message
    assert chat(tools=[TOOL], tool_choice="none", response_format={"type": "json_object"}).response_format
    with pytest.raises(ValidationError, match="/v1/chat/completions"):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "tools": [TOOL]})


def test_tool_calls_go_out_in_openai_shape():
    from meshwire.openai import FunctionCall, FunctionDelta, ToolCall, ToolCallDelta

    message = AssistantMessage(content=None, tool_calls=(ToolCall(id="call_1", function=FunctionCall(
        name="f", arguments="{}")),))
    assert orjson.loads(message.model_dump_json()) == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert "tool_calls" not in orjson.loads(AssistantMessage(content="hi").model_dump_json())
    delta = Delta(tool_calls=(ToolCallDelta(index=0, function=FunctionDelta(arguments='{"a')),))
    assert orjson.loads(delta.model_dump_json()) == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a'}}]}
    parsed = oa_chat.ChatCompletionChunk.model_validate({"id": "x", "object": "chat.completion.chunk", "created": 0,
                                                         "model": "m", "choices": [{"index": 0, "delta": orjson.loads(
                                                             delta.model_dump_json())}]})
    assert parsed.choices[0].delta.tool_calls[0].function.arguments == '{"a'


@pytest.mark.parametrize("name", ["functions", "function_call",
                                  "service_tier", "modalities", "audio", "prediction", "reasoning_effort",
                                  "web_search_options"])
def test_each_unsupported_feature_is_a_400_naming_it(name):
    message, param = chat_refusal({**BASE, name: {"type": "something"}})
    assert param == name and message.startswith(f"invalid value for {name!r}: not supported: ")


def test_content_may_be_a_string_or_a_list_of_text_parts():
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert chat(messages=[{"role": "user", "content": parts}]).messages[0].text() == "Hello\nworld"
    assert chat().messages[0].text() == "Hello"


def test_every_openai_role_is_accepted_and_an_assistant_may_have_no_content():
    roles = ["system", "developer", "user", "assistant", "tool"]
    request = chat(messages=[{"role": r, "content": r, **({"tool_call_id": "call_1"} if r == "tool" else {})}
                             for r in roles] + [{"role": "assistant", "content": None}])
    assert [m.role for m in request.messages] == [*roles, "assistant"]
    assert request.messages[-1].template_dict() == {"role": "assistant", "content": ""}


def test_stop_may_be_a_string_or_a_list():
    assert chat(stop="\n").stop_sequences == ("\n",)
    assert chat(stop=["a", "b"]).stop_sequences == ("a", "b")


def test_stream_options_ask_for_a_usage_chunk_only_when_streaming():
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage is True
    assert chat(stream=False, stream_options={"include_usage": True}).include_usage is False


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5).token_budget(default=64) == 5
    assert chat(max_tokens=5, max_completion_tokens=7).token_budget(default=64) == 7


def test_penalties_seed_user_and_top_k_are_accepted_in_range():
    request = chat(presence_penalty=0, frequency_penalty=0.0, seed=-5, user="u", top_k=40, n=1)
    assert (request.seed, request.top_k) == (-5, 40)


def test_requests_are_immutable():
    with pytest.raises(ValidationError):
        chat().model = "other"  # type: ignore[misc]


def test_a_completion_prompt_may_be_a_string_or_a_list_of_one_string():
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["Once"]}).prompt == "Once"
    request = CompletionRequest.model_validate({"model": "m", "prompt": "Once", "temperature": 1})
    assert request.token_budget() == 16  # OpenAI's default for /v1/completions


# --- what is refused, with a sentence naming the field ---------------------------------------


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": limits.MAX_TOKENS_LIMIT + 1}, "max_tokens"),
    ({"max_tokens": 5.5}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.01}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 7}, "stop"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"model": 5}, "model"),
])
def test_a_bad_field_is_refused_with_a_sentence_naming_it(fields, param):
    message, got_param = chat_refusal({**BASE, **fields})
    assert got_param == param
    assert f"'{param}'" in message


def test_n_is_bounded_and_each_choice_has_its_own_seed():
    assert chat(n=16).choices == 16 and chat().choices == 1
    message, _ = chat_refusal({**BASE, "n": 17})
    assert "16" in message
    assert [choice_seed(7, index) for index in range(3)] == [7, 8, 9] and choice_seed(None, 2) is None
    assert choice_seed(SEED_MAX, 1) == 0, "past the largest seed it wraps round 2**64, as torch does"


def test_a_missing_field_is_named():
    assert chat_refusal({"messages": BASE["messages"]}) == ("missing required field 'model'", "model")


def test_a_prompt_over_the_character_limit_is_refused():
    message, _ = chat_refusal({**BASE, "messages": [{"role": "user", "content": "x" * (limits.MAX_PROMPT_CHARS + 1)}]})
    assert "characters" in message


def test_more_messages_than_the_limit_are_refused():
    _message, param = chat_refusal({**BASE, "messages": [{"role": "user", "content": "x"}] * (limits.MAX_MESSAGES + 1)})
    assert param == "messages"


def test_a_body_that_is_not_an_object_or_not_json_says_so():
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate_json(b"[1, 2]")
    assert validation_error_message(caught.value) == "request body must be a JSON object"
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate_json(b"{oops")
    assert validation_error_message(caught.value).startswith("request body is not valid JSON")


def test_a_completion_prompt_list_of_several_prompts_or_token_ids_is_refused():
    for prompt in (["a", "b"], [1, 2, 3]):
        with pytest.raises(ValidationError) as caught:
            CompletionRequest.model_validate({"model": "m", "prompt": prompt})
        assert validation_error_param(caught.value) == "prompt"


# --- what we send back parses with the official SDK's own types --------------------------------


def test_a_chat_completion_parses_as_the_sdks_chat_completion():
    answer = ChatCompletion(id=new_id("chatcmpl"), created=1, model="tiny",
                            choices=[ChatChoice(message=AssistantMessage(content="Hi!"), finish_reason="stop")],
                            usage=Usage.of(3, 2))
    parsed = oa_chat.ChatCompletion.model_validate_json(answer.model_dump_json())
    assert parsed.choices[0].message.content == "Hi!" and parsed.usage.total_tokens == 5


def test_stream_chunks_leave_out_absent_delta_fields_and_parse_with_the_sdk():
    first = ChatCompletionChunk(id="c", created=1, model="tiny",
                                choices=[ChunkChoice(delta=Delta(role="assistant", content=""))])
    last = ChatCompletionChunk(id="c", created=1, model="tiny", choices=[ChunkChoice(delta=Delta(), finish_reason="length")])
    usage = ChatCompletionChunk(id="c", created=1, model="tiny", usage=Usage.of(1, 1))
    assert orjson.loads(last.model_dump_json())["choices"][0]["delta"] == {}
    for chunk in (first, last, usage):
        oa_chat.ChatCompletionChunk.model_validate_json(chunk.model_dump_json())


def test_completions_and_model_lists_parse_with_the_sdk():
    completion = Completion(id=new_id("cmpl"), created=1, model="m",
                            choices=[CompletionChoice(text="once", finish_reason="stop")], usage=Usage.of(1, 1))
    assert oa.Completion.model_validate_json(completion.model_dump_json()).choices[0].text == "once"
    models = ModelList(data=[ModelCard(id="tiny")])
    assert orjson.loads(models.model_dump_json())["data"][0] == {"id": "tiny", "object": "model", "created": 0,
                                                                  "owned_by": "meshnet"}


def test_an_error_body_has_the_openai_shape():
    body = error_body("no route covers layers 2-3", "service_unavailable", "no_route", failed_node="b")
    parsed = ErrorResponse.model_validate(body)
    assert parsed.error.code == "no_route" and parsed.error.param is None
    assert body["error"]["failed_node"] == "b"


def test_sse_events_carry_one_json_chunk_each_and_end_with_done():
    chunk = ChatCompletionChunk(id="c", created=1, model="m", choices=[ChunkChoice(delta=Delta(content="x"))])
    event = sse_event(chunk)
    assert event.endswith(b"\n\n") and DONE == b"data: [DONE]\n\n"
    payload = parse_sse_line(event.decode().splitlines()[0])
    assert payload is not None and ChatCompletionChunk.model_validate_json(payload) == chunk
    assert parse_sse_line(": keep-alive") is None


def test_a_message_needs_content_unless_it_is_the_assistants():
    with pytest.raises(ValidationError):
        ChatMessage.model_validate({"role": "user"})
