"""The template compiled without its inert ``{% generation %}`` blocks renders the same text.

``chat.without_inert_generation`` drops a generation block whose body is output alone (a macro
call per assistant turn that only returns its body's text); these tests render the result
against transformers' own compiled template on real conversations, for the templates that
carry such blocks (the example tokenizer's, the benchmark's Llama-3-style one, whitespace
control around the tags) and for blocks it must keep (an assignment the block's scope bounds,
a body that names ``caller``).
"""

import json
import os

import pytest
from transformers.utils.chat_template_utils import _compile_jinja_template

from megatron_sft_idx.preprocess.records.chat import ChatTokenizer, without_inert_generation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE_TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")

LLAMA3_STYLE = (   # (bench/chat_corpus.py's)
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# whitespace control and trim_blocks/lstrip_blocks around the tags: the parser's tree already has them
SPACED = (
    "{% for m in messages %}\n"
    "  {% if m.role == 'assistant' %}\n"
    "    {%- generation -%}\n"
    "      {{ m.content }} done\n"
    "    {%- endgeneration %}\n"
    "  {% generation %}\n"
    "  {{ '[' ~ loop.index ~ ']' }}\n"
    "  {% endgeneration %}\n"
    "  {% else %}{{ m.role }}: {{ m.content }}\n{% endif %}\n"
    "{% endfor %}")
# blocks that stay: an assignment scoped by the block's macro, a body naming caller
SCOPED = ("{% set x = 'outer' %}{% for m in messages %}{% if m.role == 'assistant' %}"
          "{% generation %}{% set x = 'inner' %}{{ m.content }}{% endgeneration %}{{ x }}"
          "{% else %}{{ m.content }}{% endif %}{% endfor %}")
CALLER = ("{% for m in messages %}{% generation %}{{ m.content }}{{ caller is defined }}{% endgeneration %}"
          "{% endfor %}")


def conversations(n=60):
    with open(os.path.join(ROOT, "examples", "conversations.jsonl"), encoding="utf-8") as f:
        out = [json.loads(next(f))["messages"] for _ in range(n)]
    out.append([{"role": "user", "content": " padded "}, {"role": "assistant", "content": "  \n"}])
    return out


def _example_template():
    with open(os.path.join(EXAMPLE_TOKENIZER, "tokenizer_config.json"), encoding="utf-8") as f:
        return json.load(f)["chat_template"]


@pytest.mark.parametrize("name", ["example", "llama3_style", "spaced"])
def test_inert_blocks_go_and_the_text_stays(name):
    source = {"example": _example_template(), "llama3_style": LLAMA3_STYLE, "spaced": SPACED}[name]
    compiled = _compile_jinja_template(source)
    fast = without_inert_generation(compiled, source)
    assert fast is not compiled   # (something was inlined: the test exercises the new tree)
    for messages in conversations():
        for prompt in (False, True):
            kwargs = {"messages": messages, "add_generation_prompt": prompt, "bos_token": "<s>"}
            assert fast.render(**kwargs) == compiled.render(**kwargs)


@pytest.mark.parametrize("source", [SCOPED, CALLER], ids=["scoped_set", "caller"])
def test_blocks_with_scope_or_caller_are_kept(source):
    compiled = _compile_jinja_template(source)
    assert without_inert_generation(compiled, source) is compiled
    assert "inner" not in compiled.render(messages=conversations(3)[0])   # (the scope the block bounds)


def test_a_template_without_blocks_is_the_same_object():
    source = "{% for m in messages %}{{ m.content }}{% endfor %}"
    compiled = _compile_jinja_template(source)
    assert without_inert_generation(compiled, source) is compiled


def test_the_tokenizer_renders_with_it_and_keeps_the_tracked_mask():
    """ChatTokenizer renders through the inlined template, while transformers' public path (its
    own compiled template, cached by source) still tracks the blocks for its assistant mask."""
    tok = ChatTokenizer(EXAMPLE_TOKENIZER)
    assert tok.compiled is not _compile_jinja_template(tok.chat_template)
    messages = conversations(1)[0]
    hf = tok.hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert any(hf["assistant_masks"])
    assert tok.render(messages) == tok.hf.apply_chat_template(messages, tokenize=False)
