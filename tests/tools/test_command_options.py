"""One name per setting across every console script (issue 33, item 2; docs/TOOLS.md "One name
per setting").

Builds the parser of every command ``megatron_sft_idx._console.TOOLS`` runs and fails when one
setting (an argparse ``dest``) is spelled two ways -- another first name in another command, or
a second option string -- unless that spelling is an alias declared below AND listed in
TOOLS.md's table; and when a setting known to have had two names comes back under its old one.
"""

import argparse
import os
import re
from importlib import import_module

import pytest

from megatron_sft_idx._console import TOOLS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: (command, alias) -> the one name of its setting. An alias is a second option string of the
#: setting's action, or (for a setting given in parts or other units) its own flag.
ALIASES = {
    ("plan-batches", "--dp"): "--balance-for",
    ("plan-batches", "--micro-batch-size"): "--balance-for",
    ("plan-batches", "--global-batch-size"): "--balance-for",
    ("inspect-idx", "--dp"): "--balance-for",
    ("inspect-idx", "--micro-batch-size"): "--balance-for",
    ("inspect-idx", "--global-batch-size"): "--balance-for",
    ("plan-batches", "--model"): "--cost-model",
    ("plan-batches", "--linear"): "--cost-model",
    ("plan-batches", "--attention"): "--cost-model",
    ("plan-batches", "--seed"): "--balance-seed",
    ("plan-batches", "--epochs"): "--balance-epochs",
    ("plan-batches", "--pad-multiple"): "--pad-seq-to-mult",
    ("check-idx", "--replace"): "--overwrite",
}
#: Settings that had two names: the dest of the old one must not come back as a setting of its own.
RETIRED_DESTS = {"model", "epochs", "pad_multiple", "replace"}


def parsers():
    """{command: its parser}, for every console script."""
    out = {}
    for name, tool in TOOLS.items():
        module, function = tool.target.split(":")
        builder = "build_parser" if function == "main" else "build_" + function.replace("_main", "_parser")
        out[name] = getattr(import_module(module), builder)()
    return out


def options(parser):
    """(setting, option strings) of every optional argument (positionals and --help left out); a
    setting is the dest, and for flags that each store one value into it (``--fast``/``--deep``)
    the dest and that value."""
    return [((a.dest, a.const) if type(a) is argparse._StoreConstAction else a.dest, list(a.option_strings))
            for a in parser._actions
            if a.option_strings and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]


def first_long(strings):
    return next(s for s in strings if s.startswith("--"))


def test_every_console_script_is_audited():
    assert set(parsers()) == set(TOOLS) and len(TOOLS) == 8, sorted(TOOLS)


def test_each_setting_has_one_name_in_every_command():
    names = {}   # dest -> {first name: [commands]}
    aliases = {}
    for command, parser in parsers().items():
        for dest, strings in options(parser):
            long = [s for s in strings if s.startswith("--")]
            declared = [s for s in long if (command, s) in ALIASES]
            canonical = [s for s in long if (command, s) not in ALIASES]
            if not canonical:                       # an alias with a flag of its own (a part of a setting)
                assert len(declared) == 1, (command, strings)
                aliases[(command, declared[0])] = dest
                continue
            assert len(canonical) == 1, f"{command}: {strings} spell one setting {len(canonical)} ways"
            names.setdefault(dest, {}).setdefault(canonical[0], []).append(command)
            for alias in declared:
                assert ALIASES[(command, alias)] == canonical[0], (command, alias)
    twice = {dest: spellings for dest, spellings in names.items() if len(spellings) > 1}
    assert not twice, f"settings spelled differently in different commands: {twice}"
    assert not RETIRED_DESTS & set(names), RETIRED_DESTS & set(names)
    for (command, alias), canonical in ALIASES.items():   # every declared alias exists, and names a setting
        parser = parsers()[command]
        assert any(alias in strings for _, strings in options(parser)), (command, alias)
        assert any(canonical in strings for _, strings in options(parser)), (command, canonical)


def test_the_aliases_are_the_ones_tools_md_lists():
    text = open(os.path.join(ROOT, "docs", "TOOLS.md"), encoding="utf-8").read()
    table = text[text.index("### One name per setting"):]
    table = table[:table.index("\n\n", table.index("| setting |"))]
    for (command, alias), canonical in ALIASES.items():
        row = next((line for line in table.splitlines() if line.startswith("| ") and f"`{canonical}" in line), None)
        assert row is not None, canonical
        assert f"`{alias}" in row and f"`{command}`" in re.split(r"(?<!\\)\|", row)[3], (alias, row)


@pytest.mark.parametrize("command, alias", sorted(ALIASES))
def test_an_alias_says_so_in_its_help(command, alias):
    parser = parsers()[command]
    action = next(a for a in parser._actions if alias in a.option_strings)
    canonical = ALIASES[(command, alias)]
    assert canonical in action.option_strings or (action.help or "").startswith("alias:"), (command, alias)
    if canonical in action.option_strings:
        assert alias in (action.help or ""), f"{command} {canonical}: its help does not name {alias}"


# --------------------------------------------------------------------------- two spellings, two values (issue 41)

#: (command, argv besides the two spellings, first spelling and value, second spelling and value)
CONFLICTS = [
    ("plan-batches", ["s", "--balance-for", "1,1,2"], ("--balance-epochs", "2"), ("--epochs", "5")),
    ("plan-batches", ["s", "--balance-for", "1,1,2"], ("--seed", "7"), ("--balance-seed", "8")),
    ("plan-batches", ["s", "--balance-for", "1,1,2"], ("--cost-model", "llama3-8b"), ("--model", "qwen2.5-7b")),
    ("plan-batches", ["s", "--balance-for", "1,1,2"], ("--pad-multiple", "4"), ("--pad-seq-to-mult", "8")),
]


def run_tool(command, argv):
    module, function = TOOLS[command].target.split(":")
    return getattr(import_module(module), function)(argv)


def test_every_setting_with_two_spellings_refuses_two_values():
    """Structurally: every action with more than one long option string goes through
    ``_cli.add_aliased`` (so a new alias cannot forget it)."""
    from megatron_sft_idx._cli import _Aliased

    for command, parser in parsers().items():
        for action in parser._actions:
            if len([s for s in action.option_strings if s.startswith("--")]) > 1:
                assert isinstance(action, _Aliased), (command, action.option_strings)


@pytest.mark.parametrize("command, argv, first, second", CONFLICTS)
def test_two_spellings_with_two_values_are_refused_naming_both(command, argv, first, second, capsys):
    assert run_tool(command, argv + [*first, *second]) == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "error:" in line)
    assert f"{first[0]} {first[1]} and {second[0]} {second[1]}" in line and "two spellings" in line, err


def test_one_value_under_two_spellings_or_one_spelling_repeated_is_kept(tmp_path, capsys):
    from megatron_sft_idx.tools.plan_batches_cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["s", "--balance-epochs", "3", "--epochs", "3", "--seed", "1", "--seed", "2"])
    assert args.balance_epochs == 3 and args.balance_seed == 2            # last wins within one spelling
    args = parser.parse_args(["s", "--epochs", "5"])
    assert args.balance_epochs == 5
    again = build_parser().parse_args(["s", "--balance-epochs", "2"])     # a fresh parse forgets the last
    assert again.balance_epochs == 2


def test_a_part_given_beside_its_whole_even_at_the_default_is_refused(capsys):
    assert run_tool("plan-batches", ["s", "--balance-for", "1,1,2", "--cost-model", "llama3-8b", "--linear", "1",
                                     "--attention", "2"]) == 2
    assert "another spelling of --cost-model" in capsys.readouterr().err
