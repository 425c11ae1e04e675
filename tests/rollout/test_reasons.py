"""Event reasons and status reasons are one vocabulary, `graft.api.Reason`: the code names them by
member, and docs/architecture.md carries the table `reason_table()` makes of them.

Regenerate the table after changing `Reason`: `python tests/rollout/test_reasons.py`.
"""
import ast
import re
import sys
from pathlib import Path

import graft
from graft.api import Phase, Reason, reason_table

ROOT = Path(graft.__file__).parent
PACKAGES = ("rollout", "operator")
DOC = ROOT.parent / "docs" / "architecture.md"
BEGIN, END = "<!-- reasons:begin (generated from graft.api.Reason) -->", "<!-- reasons:end -->"
TABLE = re.compile(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), re.S)

# Callables whose first argument is a reason (Events, Problems, RouteErrors and the state machine's
# plumbing), and those whose second is (`finish(phase, reason, message)`).
FIRST = {"Event", "Problem", "RouteError", "event", "note", "rollback", "pause_for_analysis"}
SECOND = {"finish"}
# Strings that are reasons and also something else (a phase, a condition type): only the reason
# places above are checked for them.
SHARED = {p.value for p in Phase} | {"Converged"}


def _sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def _name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _is_reason_target(node: ast.expr) -> bool:
    """`x.reason` or `x["reason"]`: a place a reason is stored."""
    return ((isinstance(node, ast.Attribute) and node.attr == "reason")
            or (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                and node.slice.value == "reason"))


def _reason_places(tree: ast.AST):
    """Every expression in a place that holds a reason."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _name(node.func)
            if name in FIRST and node.args:
                yield node.args[0]
            if name in SECOND and len(node.args) > 1:
                yield node.args[1]
            yield from (k.value for k in node.keywords if k.arg == "reason")
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if _is_reason_target(target):
                    yield node.value
                elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    yield from (v for t, v in zip(target.elts, node.value.elts) if _is_reason_target(t))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            reading = any(_is_reason_target(s) or (isinstance(s, ast.Call) and isinstance(s.func, ast.Attribute)
                                                   and s.func.attr == "get" and s.args
                                                   and isinstance(s.args[0], ast.Constant)
                                                   and s.args[0].value == "reason") for s in sides)
            if reading:
                yield from sides
        elif isinstance(node, ast.Dict):
            yield from (v for k, v in zip(node.keys, node.values)
                        if isinstance(k, ast.Constant) and k.value == "reason")


def _literals(node: ast.expr):
    """The string literals an expression may evaluate to (through `a if c else b`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node
    elif isinstance(node, ast.IfExp):
        yield from _literals(node.body)
        yield from _literals(node.orelse)


def test_no_reason_is_a_bare_literal():
    bare = [f"{path.relative_to(ROOT.parent)}:{lit.lineno}: {lit.value!r}"
            for path, tree in _sources() for place in _reason_places(tree) for lit in _literals(place)]
    assert bare == [], "name these reasons by their graft.api.Reason member:\n" + "\n".join(bare)


def test_no_reason_is_spelled_out_anywhere():
    """A literal equal to a reason (and to nothing else the API names) anywhere in the operator or
    the rollout code is a reason written by hand."""
    values = {r.value for r in Reason} - SHARED
    found = [f"{path.relative_to(ROOT.parent)}:{node.lineno}: {node.value!r}"
             for path, tree in _sources() for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and node.value in values]
    assert found == [], "name these reasons by their graft.api.Reason member:\n" + "\n".join(found)


def test_every_member_is_described():
    for r in Reason:
        assert r.text and "\n" not in r.text, r
        assert r.type in (None, "Normal", "Warning"), r
        assert r.value == r.value.strip() and " " not in r.value, r   # CamelCase, as the API conventions ask


def test_the_architecture_doc_lists_exactly_the_reasons():
    found = TABLE.search(DOC.read_text())
    assert found, f"docs/architecture.md has no {BEGIN} ... {END} block"
    assert found.group(1) == reason_table(), "regenerate it: python tests/rollout/test_reasons.py"
    listed = re.findall(r"^\| `([A-Za-z]+)` \|", found.group(1), re.M)
    assert listed == [r.value for r in Reason]


def test_the_events_module_points_to_the_enum_and_lists_no_reasons():
    doc = ast.get_docstring(ast.parse((ROOT / "operator" / "events.py").read_text())) or ""
    assert "Reason" in doc
    named = {r.value for r in Reason if re.search(rf"\b{r.value}\b", doc)} - SHARED
    assert named == set()


def regenerate() -> None:
    text = DOC.read_text()
    assert TABLE.search(text), f"docs/architecture.md has no {BEGIN} ... {END} block"
    DOC.write_text(TABLE.sub(lambda _: f"{BEGIN}\n{reason_table()}{END}", text))


if __name__ == "__main__":
    regenerate()
    sys.exit(0)
