"""One JSON reader: no module of the package parses JSON except ``megatron_sft_idx/jsondoc.py``,
whose ``parse_json`` bounds size, depth and types (docs/FORMAT.md "Limits", docs/INPUTS.md). An
AST scan finds every call that would bypass it -- ``json.loads``/``json.load`` however imported,
and the other JSON libraries' ``loads`` -- and the scan is shown to find one."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "megatron_sft_idx")
READER = os.path.join(PACKAGE, "jsondoc.py")
PARSERS = {"json": {"loads", "load"}, "orjson": {"loads"}, "ujson": {"loads", "load"},
           "simplejson": {"loads", "load"}, "rapidjson": {"loads", "load"}, "msgspec.json": {"decode"}}


def json_parses(source: str, filename: str = "<src>"):
    """``(line, text)`` of every call in ``source`` that parses JSON without the bounded reader."""
    tree = ast.parse(source, filename)
    modules = {}     # local name -> module (import json as j)
    functions = {}   # local name -> "module.function" (from json import loads as l)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in PARSERS:
                    modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module in PARSERS:
            for alias in node.names:
                if alias.name in PARSERS[node.module]:
                    functions[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module == "msgspec":
            for alias in node.names:
                if alias.name == "json":
                    modules[alias.asname or "json"] = "msgspec.json"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules \
                and f.attr in PARSERS[modules[f.value.id]]:
            found.append((node.lineno, f"{modules[f.value.id]}.{f.attr}"))
        elif isinstance(f, ast.Name) and f.id in functions:
            found.append((node.lineno, functions[f.id]))
        elif isinstance(f, ast.Attribute) and f.attr in ("loads", "load") and isinstance(f.value, ast.Name) \
                and f.value.id == "json":   # json shadowed or imported lazily inside a function
            found.append((node.lineno, f"json.{f.attr}"))
    return found


def package_modules():
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(directory, name)


def test_no_module_parses_json_outside_the_bounded_reader():
    offenders = []
    for path in package_modules():
        if path == READER:
            continue
        with open(path, encoding="utf-8") as f:
            for line, call in json_parses(f.read(), path):
                offenders.append(f"{os.path.relpath(path, ROOT)}:{line}: {call}")
    assert not offenders, "parse JSON with megatron_sft_idx.jsondoc (parse_json, load_json, parse_record_json):\n" \
        + "\n".join(offenders)


def test_the_reader_itself_is_what_parses():
    with open(READER, encoding="utf-8") as f:
        assert json_parses(f.read(), READER), "jsondoc.py no longer parses JSON: the scan looks at the wrong file"


@pytest.mark.parametrize("source", [
    "import json\njson.loads(b'{}')\n",
    "import json\nwith open('x') as f:\n    json.load(f)\n",
    "import json as j\nj.loads('1')\n",
    "from json import loads\nloads('1')\n",
    "from json import load as read\nread(open('x'))\n",
    "def f():\n    import json\n    return json.loads('1')\n",
    "import orjson\norjson.loads(b'1')\n",
    "from msgspec import json\njson.decode(b'1')\n",
])
def test_the_scan_finds_a_bypass(source):
    assert len(json_parses(source)) == 1


@pytest.mark.parametrize("source", [
    "import json\njson.dumps({})\n",
    "from megatron_sft_idx.jsondoc import parse_json\nparse_json(b'{}')\n",
    "import pickle\npickle.loads(b'')\n",
])
def test_the_scan_passes_what_does_not_parse_json(source):
    assert json_parses(source) == []
