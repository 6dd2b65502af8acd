"""A tiny deterministic Llama-architecture model for the test suite, built offline in seconds.

:func:`build_tiny_model` writes a complete Hugging Face model folder
(``config.json``, ``model.safetensors``, ``generation_config.json``, tokenizer
files with a ChatML chat template): a byte-level BPE tokenizer trained with
``tokenizers`` on the English text below, and a 4-layer Llama with grouped-query
attention whose random weights come from ``torch.manual_seed(0)``. Building it
twice gives identical files, so a failing test is reproducible bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Final

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE: Final = 640
NUM_LAYERS: Final = 4
HIDDEN_SIZE: Final = 64
NUM_HEADS: Final = 4
NUM_KV_HEADS: Final = 2
INTERMEDIATE_SIZE: Final = 128
MAX_POSITIONS: Final = 4096
INIT_STD: Final = 0.2
"""Larger than Llama's 0.02 so the random model's logits are well separated (no near-ties for argmax)."""
SEED: Final = 0

IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"
END_OF_TEXT: Final = "<|endoftext|>"
SPECIAL_TOKENS: Final = (END_OF_TEXT, IM_START, IM_END)

CHAT_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TOOL_CHAT_TEMPLATE: Final = (
    # The Hermes / Qwen2.5 way of showing a model its tools and its past calls, cut down to what the tests use.
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions. Their signatures, within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] in ('user', 'developer') or (message['role'] == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{- call['function']['arguments'] | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""A chat template that renders tools, assistant tool calls and tool results (Hermes / Qwen2.5 style)."""

CORPUS: Final = """\
The river runs past the old mill and under the stone bridge before it reaches the sea.
In the morning the fishermen push their boats into the water and sail out beyond the harbour wall.
Children walk to school along the river path, counting the ducks and throwing small stones.
The baker opens her shop before sunrise; the smell of fresh bread drifts down the narrow street.
A mesh of ordinary machines can serve one large language model when each machine holds a few layers.
Every node runs its layers and passes the hidden states to the next node in the route.
The tracker knows which node holds which layers, and it hands every request a complete route.
When a node fails, the head asks for a new route, replays the history, and continues the stream.
Tokens travel back to the client one at a time, so the answer appears as soon as it is ready.
What is the capital of France? The capital of France is Paris, a city on the river Seine.
How many legs does a spider have? A spider has eight legs, while an insect has six.
Why is the sky blue? Sunlight is scattered by the air, and blue light is scattered the most.
Water boils at one hundred degrees Celsius at sea level and freezes at zero degrees.
The library keeps books about history, science, music, cooking, travel and the stars.
Please write a short poem about the autumn wind and the falling leaves.
The wind came over the hill at night and carried the red leaves into the valley.
Hello! How can I help you today? I can answer questions, write text, and explain ideas.
Thank you for your question. Here is a short answer, followed by a longer explanation.
First, open the box. Second, take out the parts. Third, read the instructions carefully.
The train leaves the station at seven o'clock and arrives in the city two hours later.
Numbers: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.
Days: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.
Colours: red, orange, yellow, green, blue, indigo and violet make up the rainbow.
A good teacher listens to questions, explains clearly, and encourages students to think.
The cat sleeps on the warm windowsill while the dog waits by the door for a walk.
Mathematics studies numbers, shapes and patterns; physics studies matter, energy and motion.
Cooking rice is simple: rinse the grains, add water, bring it to a boil, then let it simmer.
The mountain road climbs through pine forests to a lake that reflects the snowy peaks.
Computers store information as bits, and a byte is a group of eight bits.
The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.
"""


def build_tiny_model(dest: Path, seed: int = SEED) -> Path:
    """Write the tiny model into folder ``dest`` (created if needed) and return ``dest``.

    Another ``seed`` gives another model with the same tokenizer (a draft model that drafts badly)."""
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_STD,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def build_tool_model(tiny: Path, dest: Path) -> Path:
    """A copy of the tiny model in ``tiny`` whose chat template supports tools (:data:`TOOL_CHAT_TEMPLATE`);
    the folder ``dest`` is created and returned (its name is the model's name on a mesh)."""
    shutil.copytree(tiny, dest)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(dest)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.save_pretrained(dest)
    return dest


CALLER_LOGIT: Final = 10.0
"""How far a :func:`build_caller_model` successor's logit stands out, per unit of the normalised hidden state
(the model's other logits are its random ``INIT_STD`` weights times about one)."""


def build_caller_model(tools: Path, dest: Path, chain: list[tuple[int, int]]) -> Path:
    """A copy of the tool model in ``tools`` rewired to answer each ``(token, successor)`` of ``chain``
    with ``successor``, whatever came before: the weights that make a call as a trained model would.

    Every layer's attention and MLP output projections are zero, so the last hidden state is the input
    token's own embedding; each chain token's embedding is a unit vector of its own, and the language
    model head's row of its successor reads that vector :data:`CALLER_LOGIT` strong. Other tokens keep
    their random embeddings (so a grammar still has choices to make after the chain)."""
    shutil.copytree(tools, dest)
    model = LlamaForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    if len(chain) > HIDDEN_SIZE:
        raise ValueError(f"a chain of {len(chain)} tokens needs more than {HIDDEN_SIZE} dimensions")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for dim, (token, successor) in enumerate(chain):
            model.model.embed_tokens.weight[token] = 0.0
            model.model.embed_tokens.weight[token, dim] = 1.0
            model.lm_head.weight[successor, dim] = CALLER_LOGIT
    model.save_pretrained(dest)
    return dest


def _build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on :data:`CORPUS`, with ChatML special tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
    )


if __name__ == "__main__":  # pragma: no cover - a convenience for looking at the model by hand
    import sys

    folder = build_tiny_model(Path(sys.argv[1]))
    print(json.dumps(sorted(p.name for p in folder.iterdir())))
