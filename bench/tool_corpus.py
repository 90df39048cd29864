"""A seeded tool-calling and reasoning corpus of real text, in the shapes public sets ship in.

Built from the same standard-library text as :mod:`bench.chat_corpus`: a third OpenAI function
calling (``tools``, ``tool_calls`` with string arguments and ids, ``tool`` results, one to three
rounds before the answer), a third ShareGPT in LLaMA-Factory's glaive layout (``function_call`` /
``observation`` turns, ``tools`` as a JSON string, sometimes parallel calls), a third reasoning
(``<think>`` inline or ``reasoning_content``, one to three turns). The template is a hermes-style
tool template on Llama 3's turn tokens, written for the benchmark (``<tools>`` in the system
message, ``<tool_call>`` blocks, ``<tool_response>`` turns under ``ipython``), which renders
reasoning inline; the tokenizer is :func:`bench.chat_corpus.production_tokenizer`'s.

    python -m bench.tool_corpus --count 20000 --out /tmp/tools.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Dict, List, Optional, Tuple

from bench.chat_corpus import _paragraphs, _words, production_tokenizer

_H, _E = "'<|start_header_id|>", "<|end_header_id|>\\n\\n'"  # Llama 3 headers; <|eot_id|> ends a turn
HERMES_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}{{ " + _H + "system" + _E + " }}{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{{ '\\n\\n# Tools\\n<tools>' }}{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}"
    "{{ '\\n</tools><|eot_id|>' }}"
    "{%- elif messages[0].role == 'system' %}{{ " + _H + "system" + _E + " + messages[0].content + '<|eot_id|>' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ " + _H + "user" + _E + " + m.content + '<|eot_id|>' }}"
    "{%- elif m.role == 'assistant' %}{{ " + _H + "assistant" + _E + " + m.content }}"
    "{%- for c in m.tool_calls or [] %}{{ '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": '"
    " + c.function.arguments | tojson + '}\\n</tool_call>' }}{% endfor %}{{ '<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}{{ " + _H + "ipython" + _E + " + '<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|eot_id|>' }}"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ " + _H + "assistant" + _E + " }}{% endif %}"
)


def _tool(rng: random.Random, prose: List[str]) -> dict:
    words = _words(rng.choice(prose))
    name = "_".join(rng.sample(words, min(2, len(words)))).lower()[:40]
    params = {w.lower(): {"type": rng.choice(["string", "integer"]), "description": rng.choice(prose)[:80]}
              for w in rng.sample(words, min(3, len(words)))}
    return {"name": name, "description": rng.choice(prose)[:200],
            "parameters": {"type": "object", "properties": params, "required": list(params)[:1]}}


def _arguments(rng: random.Random, tool: dict, prose: List[str]) -> dict:
    return {k: (rng.randint(0, 10_000) if v["type"] == "integer" else rng.choice(_words(rng.choice(prose))))
            for k, v in tool["parameters"]["properties"].items()}


def _answer(rng: random.Random, prose: List[str]) -> str:
    return "\n\n".join(rng.choice(prose) for _ in range(max(1, min(6, int(rng.lognormvariate(0.7, 0.7))))))


def _tools(rng: random.Random, prose: List[str], pool: Optional[List[dict]]) -> List[dict]:
    """One to three tools: made for the record, or drawn from ``pool`` (as public sets do: xLAM's
    60k records call 3,673 APIs, glaive's and ToolACE's draw from catalogues likewise)."""
    k = rng.randint(1, 3)
    return [_tool(rng, prose) for _ in range(k)] if pool is None else rng.sample(pool, k)


def openai_record(rng: random.Random, prose: List[str], n: int, pool: Optional[List[dict]] = None) -> dict:
    tools = _tools(rng, prose, pool)
    messages = [{"role": "system", "content": "You can call tools."}] if rng.random() < 0.5 else []
    messages.append({"role": "user", "content": rng.choice(prose)[:300]})
    for r in range(rng.randint(1, 3)):
        tool = rng.choice(tools)
        call_id = f"call_{n}_{r}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": tool["name"], "arguments": json.dumps(_arguments(rng, tool, prose))}}]})
        messages.append({"role": "tool", "tool_call_id": call_id,
                         "content": json.dumps({"result": rng.choice(prose)[:300]})})
    messages.append({"role": "assistant", "content": _answer(rng, prose)})
    return {"messages": messages, "tools": [{"type": "function", "function": t} for t in tools]}


def glaive_record(rng: random.Random, prose: List[str], pool: Optional[List[dict]] = None) -> dict:
    tools = _tools(rng, prose, pool)
    turns = [{"from": "human", "value": rng.choice(prose)[:300]}]
    calls = [{"name": t["name"], "arguments": _arguments(rng, t, prose)}
             for t in rng.sample(tools, rng.randint(1, len(tools)))]
    turns.append({"from": "function_call", "value": json.dumps(calls if len(calls) > 1 else calls[0])})
    turns.append({"from": "observation", "value": json.dumps({"result": rng.choice(prose)[:300]})})
    turns.append({"from": "gpt", "value": _answer(rng, prose)})
    return {"conversations": turns, "tools": json.dumps(tools)}


def reasoning_record(rng: random.Random, prose: List[str]) -> dict:
    messages = []
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": rng.choice(prose)[:300]})
        thought, answer = _answer(rng, prose), _answer(rng, prose)
        if rng.random() < 0.5:
            messages.append({"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{answer}"})
        else:
            messages.append({"role": "assistant", "content": answer, "reasoning_content": thought})
    return {"messages": messages}


def write_tool_corpus(path: str, count: int, seed: int = 11, pool: Optional[int] = None) -> str:
    """``count`` records, a third of each shape; ``pool``: every record's tools drawn from that
    many (None: each record's own, never repeated: the accounting's worst case)."""
    prose = [p for p in _paragraphs()[0] if p.strip()]  # (a comment block can strip to nothing)
    rng = random.Random(seed)
    tools = None if pool is None else _pool(rng, prose, pool)
    makers = (lambda n: openai_record(rng, prose, n, tools), lambda n: glaive_record(rng, prose, tools),
              lambda n: reasoning_record(rng, prose))
    with open(path, "w", encoding="utf-8") as f:
        for n in range(count):
            f.write(json.dumps(makers[n % 3](n)) + "\n")
    return path


def _pool(rng: random.Random, prose: List[str], size: int) -> List[dict]:
    out: Dict[str, dict] = {}
    while len(out) < size:   # (names made of two words can meet: one tool per name)
        tool = _tool(rng, prose)
        out.setdefault(tool["name"], tool)
    return list(out.values())


def tool_tokenizer(out_dir: str) -> Tuple[str, str]:
    """(tokenizer directory, description): the production tokenizer with the hermes tool template."""
    tok, desc = production_tokenizer(out_dir)
    if tok == out_dir:
        path = os.path.join(out_dir, "tokenizer_config.json")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    else:  # the bundled example tokenizer: a copy with the template
        import shutil

        os.makedirs(out_dir, exist_ok=True)
        shutil.copyfile(os.path.join(tok, "tokenizer.json"), os.path.join(out_dir, "tokenizer.json"))
        with open(os.path.join(tok, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    config["chat_template"] = HERMES_TEMPLATE
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return out_dir, desc.replace("Llama-3-style", "hermes tool") if "Llama-3-style" in desc else desc


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=20000, help="conversations (default: 20000)")
    p.add_argument("--out", required=True, help="output JSONL path")
    p.add_argument("--seed", type=int, default=11, help="seed (default: 11)")
    p.add_argument("--pool", type=int, default=None,
                   help="draw every record's tools from this many (default: each record its own)")
    args = p.parse_args(argv)
    write_tool_corpus(args.out, args.count, args.seed, args.pool)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
