"""`--help` of every `graft` command lists every verb it takes.

The parser tree of `graft` (graft.cli.build_parser) is walked down every sub-command; `graft
rollout` parses its own arguments (graft.cli.PASSTHROUGH), so its own parser stands in for the
placeholder in the tree. argparse drops a sub-command from the help when it is given
`help=argparse.SUPPRESS`, and from the usage when the sub-parsers carry a metavar of their own;
and the one-line help of a command with verbs names them by hand, which goes stale when a verb
is added."""
import argparse
import re

import pytest

from graft.cli import PASSTHROUGH, build_parser
from graft.operator.cli import _parser as rollout_parser

# the parser each PASSTHROUGH command hands its arguments to; `graft operator` takes flags only
DELEGATES = {("graft", "rollout"): rollout_parser}
FLAGS_ONLY = {("graft", "operator")}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def tree() -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of the CLI by its command path, the delegated parsers in place of their stand-ins."""
    found = []

    def walk(path: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
        found.append((path, parser))
        for name, sub in subcommands(parser).items():
            child = path + (name,)
            walk(child, DELEGATES[child]() if child in DELEGATES else sub)
    walk(("graft",), build_parser())
    return found


def listed(help_text: str, name: str) -> bool:
    """`name` opens a line of the help: an entry of its list of sub-commands, with its own help."""
    return re.search(rf"^\s+{re.escape(name)}(\s|$)", help_text, re.MULTILINE) is not None


def entry(help_text: str, name: str) -> str:
    """The help of the sub-command `name` as its parent lists it, its continuation lines joined."""
    match = re.search(rf"^ +{re.escape(name)}\s+(.*?)(?=^ {{0,4}}\S|\Z)", help_text, re.MULTILINE | re.DOTALL)
    assert match, f"no entry for {name}"
    return " ".join(match.group(1).split())


def test_every_command_that_parses_its_own_arguments_is_walked():
    assert {("graft", name) for name in PASSTHROUGH} == set(DELEGATES) | FLAGS_ONLY


def cases(rows, keep=lambda *row: True) -> list:
    """Test parameters named by their command."""
    return [pytest.param(*row, id=" ".join(row[0])) for row in rows if keep(*row)]


def positional_choices(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if a.choices and not a.option_strings and not isinstance(a, argparse._SubParsersAction)]


@pytest.mark.parametrize("path,parser", cases(tree(), lambda path, parser: bool(subcommands(parser))))
def test_help_lists_every_verb(path, parser):
    text = parser.format_help()
    usage = parser.format_usage()
    for name in subcommands(parser):
        assert listed(text, name), f"`{' '.join(path)} --help` does not list `{name}`:\n{text}"
        assert re.search(rf"[{{,]{re.escape(name)}[,}}]", usage), f"the usage of `{' '.join(path)}` omits {name}"


@pytest.mark.parametrize("path,parser", cases(tree(), lambda path, parser: bool(positional_choices(parser))))
def test_help_lists_every_choice_of_a_positional_argument(path, parser):
    """A positional argument with choices (`graft bench SUITE`) is a verb too."""
    text = parser.format_help()
    for action in positional_choices(parser):
        assert action.metavar is None, f"`{' '.join(path)}`: a metavar hides the choices of {action.dest}"
        for choice in action.choices:
            assert re.search(rf"[{{,]{re.escape(choice)}[,}}]", text), f"`{' '.join(path)} --help` omits {choice}"


def summaries() -> list[tuple[tuple[str, ...], str, list[str]]]:
    """(path, its one-line help in its parent's --help, its own verbs) of every command with verbs."""
    parsers = dict(tree())
    return [(path, entry(parsers[path[:-1]].format_help(), path[-1]), list(subcommands(parser)))
            for path, parser in parsers.items() if len(path) > 1 and subcommands(parser)]


def named(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


@pytest.mark.parametrize("path,summary,verbs", cases(summaries()))
def test_the_one_line_help_of_a_command_names_all_its_verbs(path, summary, verbs):
    """`graft --help` says what `graft rollout` and `graft patch` do by naming their verbs: all of them."""
    missing = [v for v in verbs if not named(summary, v)]
    assert missing == [], f"`{' '.join(path[:-1])} --help` on {path[-1]}: {summary!r} leaves out {missing}"


def test_the_walk_reaches_the_verbs_under_the_passthrough_commands():
    paths = {path for path, _ in tree()}
    assert {("graft", "rollout", v) for v in ("status", "retry", "simulate")} <= paths
    assert {("graft", "patch", "keygen"), ("graft", "demo"), ("graft", "dev-cluster")} <= paths
