"""Import-graph rules between the packages (tests/project/test_code_shape.py reads the graph from the source with
`ast`, function-level imports included)."""
import os

import pytest

from tests.project.test_code_shape import import_graph

# package -> the packages it must not import. The checkpoint schema and generation take what they need of the
# train state from their caller (the layer-order conversion, the built steps), so they stay below train/.
RULES = {
    "jax3d.checkpoint": ("jax3d.train",),
    "jax3d.inference": ("jax3d.train",),
}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def broken_rules(graph: dict) -> list[str]:
    """"A imports B" for every edge of `graph` that RULES forbids."""
    return sorted(f"{n} imports {m}" for n, deps in graph.items() for low, high in RULES.items() if _within(n, low)
                  for m in deps if any(_within(m, h) for h in high))


@pytest.mark.parametrize("package", sorted(RULES))
def test_lower_packages_do_not_import_train(package):
    graph = import_graph()
    assert any(_within(n, package) for n in graph)
    assert broken_rules({n: deps for n, deps in graph.items() if _within(n, package)}) == []


def test_the_rules_see_function_level_and_from_imports(tmp_path):
    """The reference: each way of importing train/ from checkpoint/ is caught; an import of another package
    is not."""
    for f, text in {"checkpoint/__init__.py": "", "train/__init__.py": "", "train/state.py": "",
                    "train/step.py": "", "train/loop.py": "", "parallel/__init__.py": "",
                    "checkpoint/a.py": "import os\nfrom jax3d import train, parallel\n",
                    "checkpoint/b.py": "def f():\n    from jax3d.train.state import TrainState\n",
                    "checkpoint/c.py": "def f():\n    import jax3d.train.loop\n",
                    "checkpoint/d.py": "from ..train import step\n"}.items():
        os.makedirs(tmp_path / "jax3d" / os.path.dirname(f), exist_ok=True)
        (tmp_path / "jax3d" / f).write_text(text)
    assert broken_rules(import_graph(str(tmp_path))) == [
        "jax3d.checkpoint.a imports jax3d.train", "jax3d.checkpoint.b imports jax3d.train.state",
        "jax3d.checkpoint.c imports jax3d.train.loop", "jax3d.checkpoint.d imports jax3d.train",
        "jax3d.checkpoint.d imports jax3d.train.step"]
