"""Small datasets shaped like the public SFT sets, written for the tests (no downloads).

* ``glaive``: LLaMA-Factory's glaive_toolcall layout: ShareGPT ``conversations`` with
  ``human`` / ``function_call`` (JSON ``{"name", "arguments"}``) / ``observation`` / ``gpt`` turns
  and ``tools`` as a JSON string of bare function schemas;
* ``xlam``: xLAM / APIGen style: a tools list and parallel calls (a JSON list of calls in one
  ``function_call`` turn), no final answer;
* ``toolace``: ToolACE style: a system prompt, several tool rounds, then an answer;
* ``openai``: OpenAI function calling: ``tool_calls`` with string ``arguments`` and ids,
  ``tool`` messages with ``tool_call_id``, a top-level ``tools`` list, ``content: null``;
* ``reasoning``: ``<think>`` inline and ``reasoning_content``, one or two turns;
* ``alpaca``: with and without ``input``, with ``system`` and ``history``;
* ``parts``: OpenAI content as a list of text parts.
"""

from __future__ import annotations

import json
import random

CITIES = ["Paris", "Lagos", "Lima", "Oslo", "Pune", "Kyoto", "Quito", "Graz"]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["city"]}}
CONVERT = {"name": "convert_currency", "description": "Convert an amount between currencies",
           "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "to": {"type": "string"}},
                          "required": ["amount", "to"]}}


def glaive(i: int) -> dict:
    city = CITIES[i % len(CITIES)]
    call = {"name": "get_weather", "arguments": {"city": city, "unit": "c"}}
    return {"conversations": [
        {"from": "human", "value": f"What is the weather like in {city} today?"},
        {"from": "function_call", "value": json.dumps(call)},
        {"from": "observation", "value": json.dumps({"temperature": 10 + i % 15, "sky": "clear"})},
        {"from": "gpt", "value": f"It is {10 + i % 15} degrees and clear in {city}."},
    ], "system": "You can look up the weather.", "tools": json.dumps([WEATHER])}


def glaive_reasoning(i: int) -> dict:
    """LLaMA-Factory's reasoning-with-tools layout: thought blocks open the function_call and gpt values."""
    record = glaive(i)
    turns = record["conversations"]
    turns[1]["value"] = f"<think>\nThe user wants the weather in {CITIES[i % len(CITIES)]}.\n</think>\n\n" + turns[1]["value"]
    turns[3]["value"] = "<think>\nI report the observation.\n</think>\n\n" + turns[3]["value"]
    return record


def xlam(i: int) -> dict:
    a, b = CITIES[i % len(CITIES)], CITIES[(i + 3) % len(CITIES)]
    calls = [{"name": "get_weather", "arguments": {"city": a}}, {"name": "get_weather", "arguments": {"city": b}}]
    return {"conversations": [{"from": "human", "value": f"Compare the weather in {a} and {b}."},
                              {"from": "function_call", "value": json.dumps(calls)}],
            "tools": json.dumps([WEATHER, CONVERT])}


#: xLAM's published tool schemas: parameters as {name: {"type", "description", "default"?}}, not JSON Schema
XLAM_WEATHER = {"name": "get_weather", "description": "Current weather in a city",
                "parameters": {"city": {"description": "The city", "type": "str", "default": "Paris"},
                               "unit": {"description": "c or f", "type": "str, optional", "default": "c"}}}


def xlam_raw(i: int) -> dict:
    """A row of Salesforce's xlam-function-calling-60k as published: answers and tools as JSON strings."""
    a, b = CITIES[i % len(CITIES)], CITIES[(i + 3) % len(CITIES)]
    calls = [{"name": "get_weather", "arguments": {"city": a}},
             {"name": "get_weather", "arguments": {"city": b, "unit": "f"}}]
    return {"id": i, "query": f"What is the weather in {a}, and in {b} in Fahrenheit?",
            "answers": json.dumps(calls), "tools": json.dumps([XLAM_WEATHER])}


def toolace(i: int) -> dict:
    city = CITIES[i % len(CITIES)]
    amount = 10 * (i + 1)
    return {"conversations": [
        {"from": "human", "value": f"Weather in {city}, and {amount} EUR in USD?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": city}})},
        {"from": "observation", "value": '{"temperature": 18}'},
        {"from": "function_call", "value": json.dumps({"name": "convert_currency",
                                                       "arguments": {"amount": amount, "to": "USD"}})},
        {"from": "observation", "value": json.dumps({"result": round(amount * 1.1, 2)})},
        {"from": "gpt", "value": f"{city} is at 18 degrees; {amount} EUR is {round(amount * 1.1, 2)} USD."},
    ], "system": "You are a travel assistant with tools.", "tools": json.dumps([WEATHER, CONVERT])}


def openai(i: int, with_system: bool = True) -> dict:
    city = CITIES[i % len(CITIES)]
    call_id = f"call{i:05d}"[-9:].rjust(9, "0")
    messages = [{"role": "system", "content": "Use tools when they help."}] if with_system else []
    messages += [
        {"role": "user", "content": f"Is it raining in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "c"})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"rain": i % 2 == 0})},
        {"role": "assistant", "content": "Yes, bring an umbrella." if i % 2 == 0 else "No, it is dry."},
    ]
    return {"messages": messages, "tools": [{"type": "function", "function": WEATHER}]}


def reasoning(i: int, inline: bool = True, turns: int = 1) -> dict:
    messages = [{"role": "system", "content": "Think step by step."}]
    for t in range(turns):
        a, b = i + t, 2 * i + 1
        messages.append({"role": "user", "content": f"What is {a} plus {b}?"})
        thought = f"I add {a} and {b} to get {a + b}."
        answer = f"The sum is {a + b}."
        if inline:
            messages.append({"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{answer}"})
        else:
            messages.append({"role": "assistant", "content": answer, "reasoning_content": thought})
    return {"messages": messages}


def alpaca(i: int, with_input: bool, system: bool = False, history: bool = False) -> dict:
    record = {"instruction": f"Translate sentence {i} to French.",
              "input": f"The cat number {i} sleeps." if with_input else "",
              "output": f"Le chat numero {i} dort."}
    if system:
        record["system"] = "You are a translator."
    if history:
        record["history"] = [[f"Say hello {i}.", "Bonjour."]]
    return record


def parts(i: int) -> dict:
    return {"messages": [
        {"role": "user", "content": [{"type": "text", "text": f"Part one of question {i}."},
                                     {"type": "text", "text": "Part two."}]},
        {"role": "assistant", "content": [{"type": "text", "text": f"Answer {i}."}]}]}


def mixed(count: int, seed: int = 5) -> list:
    """A shuffled mix of every shape above (all valid)."""
    rng = random.Random(seed)
    makers = [glaive, xlam, toolace, openai, lambda i: reasoning(i, inline=i % 2 == 0),
              lambda i: alpaca(i, i % 2 == 0), parts]
    out = [makers[i % len(makers)](i) for i in range(count)]
    rng.shuffle(out)
    return out


def write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return str(path)
