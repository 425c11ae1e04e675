"""graft.rollout is plain decision code: its configuration is passed in (graft.operator.settings
reads the environment), so the same spec means the same thing in the operator, the simulator and
tests."""
import ast
from pathlib import Path

import graft.rollout

PACKAGE = Path(graft.rollout.__file__).parent


def test_no_module_of_graft_rollout_reads_the_environment():
    readers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = (node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name)
                    else None)
            if name in ("environ", "getenv", "environb"):
                readers.append(f"{path.name}:{node.lineno}")
    assert readers == []
