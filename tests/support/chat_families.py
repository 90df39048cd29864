"""Chat templates of the model families that matter, written for these tests, and small stand-in
tokenizers carrying each family's special tokens.

Each template reproduces the *documented format* of its family (not its upstream text):

* ``llama3``: Llama 3.1/3.2 JSON tool calling. Tools go into the first user message as JSON
  schemas; a tool call is ``{"name": ..., "parameters": {...}}`` (one per turn; more is refused, as
  upstream does); tool results come back under the ``ipython`` header, JSON-encoded (a string
  result renders as a quoted JSON string, as upstream's ``is iterable`` test makes it); contents
  are trimmed; an assistant turn with tool calls renders the call only (its content is dropped).
* ``qwen25``: Qwen2.5 hermes style. ``<tools>`` in the system message, ``<tool_call>`` JSON blocks
  after the content, tool results as ``<tool_response>`` blocks grouped in one user turn, a
  default system prompt when none is given.
* ``qwen3``: Qwen3: the Qwen2.5 tool format plus reasoning: ``reasoning_content`` (or a
  ``</think>`` split of the content) rendered as ``<think>\\n...\\n</think>\\n\\n`` only for
  assistant turns after the last real user query, and an empty ``<think>`` block inserted in
  the final turn when it has none; string arguments are rendered as given.
* ``deepseek``: DeepSeek-V3/R1: ``<｜User｜>``/``<｜Assistant｜>``, tool calls in
  ``<｜tool▁calls▁begin｜>`` blocks with the arguments string inside a ```json fence (the template
  concatenates the arguments, so it needs a string), tool outputs in
  ``<｜tool▁outputs▁begin｜>`` blocks; the reasoning before ``</think>`` is stripped from every
  assistant turn, as R1's template does; tools are listed in the system prompt (V3.1's layout).
* ``mistral``: Mistral v0.3 style: ``[AVAILABLE_TOOLS]`` before the last user message,
  ``[TOOL_CALLS]`` with each function as JSON plus a 9-character id, ``[TOOL_RESULTS]`` with the
  call id, and the system prompt folded into the *last* user message only (so in a training
  conversation, which ends with the assistant, it is rendered nowhere -- as upstream's is).
"""

from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LLAMA3 = r"""
{%- if tools is not defined %}{% set tools = none %}{% endif %}
{{- bos_token }}
{%- if messages[0].role == 'system' %}{% set sys = messages[0].content | trim %}{% set messages = messages[1:] %}
{%- else %}{% set sys = '' %}{% endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\n' }}{% endif %}
{{- 'Cutting Knowledge Date: December 2023\n\n' + sys + '<|eot_id|>' }}
{%- if tools is not none %}
  {%- if messages | length == 0 or messages[0].role != 'user' %}{{ raise_exception('tools go into the first user message, and there is none') }}{% endif %}
  {%- set first = messages[0].content | trim %}{% set messages = messages[1:] %}
  {{- '<|start_header_id|>user<|end_header_id|>\n\nAnswer with a JSON function call {"name": function name, "parameters": arguments} when one of these helps:\n\n' }}
  {%- for t in tools %}{{ t | tojson(indent=4) }}{{ '\n\n' }}{% endfor %}
  {{- first + '<|eot_id|>' }}
{%- endif %}
{%- for m in messages %}
  {%- if m.role in ['tool', 'ipython'] %}
    {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
    {%- if m.content is mapping or m.content is iterable %}{{ m.content | tojson }}{% else %}{{ m.content }}{% endif %}
    {{- '<|eot_id|>' }}
  {%- elif m.tool_calls is defined %}
    {%- if m.tool_calls | length != 1 %}{{ raise_exception('one tool call per turn') }}{% endif %}
    {%- set f = m.tool_calls[0].function %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + f.name + '", "parameters": ' + f.arguments | tojson + '}<|eot_id|>' }}
  {%- else %}
    {{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}
"""

_QWEN_TOOLS = r"""
{{- '\n\n# Tools\n\nFunction signatures are given in <tools></tools>:\n<tools>' }}
{%- for t in tools %}{{ '\n' }}{{ t | tojson }}{% endfor %}
{{- '\n</tools>\n\nAnswer a call as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
"""

QWEN25 = r"""
{%- if tools %}
  {{- '<|im_start|>system\n' }}
  {%- if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}{{ 'You are a helpful assistant.' }}{% endif %}
""" + _QWEN_TOOLS + r"""
{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
  {%- if m.role == 'user' or (m.role == 'system' and not loop.first) or (m.role == 'assistant' and not m.tool_calls) %}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
  {%- elif m.role == 'assistant' %}
    {{- '<|im_start|>assistant' }}
    {%- if m.content %}{{ '\n' + m.content }}{% endif %}
    {%- for c in m.tool_calls %}
      {%- if c.function is defined %}{% set c = c.function %}{% endif %}
      {{- '\n<tool_call>\n{"name": "' + c.name + '", "arguments": ' + c.arguments | tojson + '}\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
  {%- elif m.role == 'tool' %}
    {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}
"""

QWEN3 = r"""
{%- if tools %}
  {{- '<|im_start|>system\n' }}
  {%- if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}
""" + _QWEN_TOOLS + r"""
{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(searching=true, last_query=messages | length - 1) %}
{%- for m in messages[::-1] %}
  {%- set i = (messages | length - 1) - loop.index0 %}
  {%- if ns.searching and m.role == 'user' and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) %}
    {%- set ns.searching = false %}{% set ns.last_query = i %}
  {%- endif %}
{%- endfor %}
{%- for m in messages %}
  {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
  {%- elif m.role == 'assistant' %}
    {%- set answer = m.content %}{% set thought = '' %}
    {%- if m.reasoning_content is string %}{% set thought = m.reasoning_content %}
    {%- elif '</think>' in answer %}
      {%- set thought = answer.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
      {%- set answer = answer.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
    {%- if loop.index0 > ns.last_query and (loop.last or thought) %}
      {{- '<|im_start|>assistant\n<think>\n' + thought.strip('\n') + '\n</think>\n\n' + answer.lstrip('\n') }}
    {%- else %}{{ '<|im_start|>assistant\n' + answer }}{% endif %}
    {%- for c in m.tool_calls or [] %}
      {%- if c.function is defined %}{% set c = c.function %}{% endif %}
      {%- if (loop.first and answer) or not loop.first %}{{ '\n' }}{% endif %}
      {{- '<tool_call>\n{"name": "' + c.name + '", "arguments": ' }}
      {%- if c.arguments is string %}{{ c.arguments }}{% else %}{{ c.arguments | tojson }}{% endif %}
      {{- '}\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
  {%- elif m.role == 'tool' %}
    {%- if loop.first or loop.previtem.role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
    {%- if loop.last or loop.nextitem.role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}
"""

DEEPSEEK = r"""
{%- set ns = namespace(system='', in_outputs=false) %}
{%- for m in messages %}{% if m.role == 'system' %}{% set ns.system = ns.system + ('\n\n' if ns.system else '') + m.content %}{% endif %}{% endfor %}
{{- bos_token + ns.system }}
{%- if tools %}
  {{- '\n\n## Tools\nYou may call these tools:\n' }}
  {%- for t in tools %}{{ '\n### ' + t.function.name + '\nDescription: ' + (t.function.description or '') + '\nParameters: ' + t.function.parameters | tojson + '\n' }}{% endfor %}
{%- endif %}
{%- for m in messages %}
  {%- if m.role == 'user' %}
    {%- if ns.in_outputs %}{{ '<｜tool▁outputs▁end｜>' }}{% set ns.in_outputs = false %}{% endif %}
    {{- '<｜User｜>' + m.content }}
  {%- elif m.role == 'assistant' %}
    {%- if ns.in_outputs %}{{ '<｜tool▁outputs▁end｜>' }}{% set ns.in_outputs = false %}{% else %}{{ '<｜Assistant｜>' }}{% endif %}
    {%- set answer = m.content %}
    {%- if '</think>' in answer %}{% set answer = answer.split('</think>')[-1] %}{% endif %}
    {{- answer }}
    {%- if 'tool_calls' in m %}
      {{- '<｜tool▁calls▁begin｜>' }}
      {%- for c in m.tool_calls %}
        {%- if not loop.first %}{{ '\n' }}{% endif %}
        {{- '<｜tool▁call▁begin｜>' + c.type + '<｜tool▁sep｜>' + c.function.name + '\n```json\n' + c.function.arguments + '\n```<｜tool▁call▁end｜>' }}
      {%- endfor %}
      {{- '<｜tool▁calls▁end｜>' }}
    {%- endif %}
    {{- '<｜end▁of▁sentence｜>' }}
  {%- elif m.role == 'tool' %}
    {%- if not ns.in_outputs %}{{ '<｜tool▁outputs▁begin｜>' }}{% set ns.in_outputs = true %}{% endif %}
    {{- '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}
  {%- endif %}
{%- endfor %}
{%- if ns.in_outputs %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}
{%- if add_generation_prompt and not ns.in_outputs %}{{ '<｜Assistant｜>' }}{% endif %}
"""

MISTRAL = r"""
{%- if messages[0].role == 'system' %}{% set sys = messages[0].content %}{% set loop_messages = messages[1:] %}
{%- else %}{% set loop_messages = messages %}{% endif %}
{%- if tools is not defined %}{% set tools = none %}{% endif %}
{%- set users = loop_messages | selectattr('role', 'equalto', 'user') | list %}
{{- bos_token }}
{%- for m in loop_messages %}
  {%- if m.role == 'user' %}
    {%- if tools is not none and m == users[-1] %}
      {{- '[AVAILABLE_TOOLS] [' }}
      {%- for t in tools %}{{ t | tojson }}{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}
      {{- '][/AVAILABLE_TOOLS]' }}
    {%- endif %}
    {%- if loop.last and sys is defined %}{{ '[INST] ' + sys + '\n\n' + m.content + '[/INST]' }}
    {%- else %}{{ '[INST] ' + m.content + '[/INST]' }}{% endif %}
  {%- elif m.tool_calls is defined %}
    {{- '[TOOL_CALLS] [' }}
    {%- for c in m.tool_calls %}
      {%- if c.id is not defined or c.id | length != 9 %}{{ raise_exception('tool call ids must be 9 alphanumerics') }}{% endif %}
      {%- set out = c.function | tojson %}
      {{- out[:-1] + ', "id": "' + c.id + '"}' }}{% if not loop.last %}{{ ', ' }}{% endif %}
    {%- endfor %}
    {{- ']' + eos_token }}
  {%- elif m.role == 'assistant' %}{{ ' ' + m.content | trim + eos_token }}
  {%- elif m.role == 'tool' %}
    {%- if m.tool_call_id is not defined or m.tool_call_id | length != 9 %}{{ raise_exception('tool results need the 9-character call id') }}{% endif %}
    {{- '[TOOL_RESULTS] {"content": ' + m.content | string + ', "call_id": "' + m.tool_call_id + '"}[/TOOL_RESULTS]' }}
  {%- else %}{{ raise_exception('roles are user, assistant, tool and an initial system') }}
  {%- endif %}
{%- endfor %}
"""

FAMILIES = {
    "llama3": {"template": LLAMA3, "bos": "<|begin_of_text|>", "eos": "<|eot_id|>",
               "pad": "<|finetune_right_pad_id|>",
               "special": ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"],
               "added": []},
    "qwen25": {"template": QWEN25, "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
               "special": ["<|im_start|>"], "added": ["<tool_call>", "</tool_call>", "<tool_response>",
                                                     "</tool_response>"]},
    "qwen3": {"template": QWEN3, "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
              "special": ["<|im_start|>"], "added": ["<tool_call>", "</tool_call>", "<tool_response>",
                                                    "</tool_response>", "<think>", "</think>"]},
    "deepseek": {"template": DEEPSEEK, "bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>",
                 "pad": "<｜▁pad▁｜>",
                 "special": ["<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                             "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>",
                             "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
                             "<｜tool▁sep｜>"], "added": ["<think>", "</think>"]},
    "mistral": {"template": MISTRAL, "bos": "<s>", "eos": "</s>", "pad": "<pad>",
                "special": ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                            "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "added": []},
}


def _corpus():
    """Training text for the stand-in BPE: the example conversations and the fixtures' words."""
    with open(os.path.join(ROOT, "examples", "conversations.jsonl"), encoding="utf-8") as f:
        for line in f:
            for m in json.loads(line)["messages"]:
                yield m["content"]
    yield ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}} function parameters '
           'properties required type object string number description location temperature result')


def make_tokenizer(directory: str, family: str, vocab_size: int = 1200) -> str:
    """A byte-level BPE with ``family``'s special tokens and chat template, in ``directory``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = FAMILIES[family]
    os.makedirs(directory, exist_ok=True)
    specials = [t for t in (spec["pad"], spec["bos"], spec["eos"]) if t] + spec["special"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(_corpus()), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": spec["bos"], "eos_token": spec["eos"],
              "pad_token": spec["pad"], "unk_token": None, "chat_template": spec["template"],
              "additional_special_tokens": spec["special"], "model_max_length": 1 << 20,
              "name_or_path": f"stand-in-{family}"}
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    return directory


def with_template(directory: str, source: str, template: str, **config_items) -> str:
    """A copy of the tokenizer at ``source`` with another chat template (and config items)."""
    import shutil

    if not os.path.isdir(directory):
        shutil.copytree(source, directory)
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(config_items)
    config["chat_template"] = template
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return directory
