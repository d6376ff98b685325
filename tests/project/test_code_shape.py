"""Properties of the code itself: no import cycles in jax3d/, a readable --help."""
import argparse
import ast
import os

from jax3d.cli.train_flags import HelpFormatter, build_parser
from tests.helpers import ROOT

PKG = os.path.join(ROOT, "jax3d")


def _module_name(path: str, root: str) -> str:
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def import_graph(root: str = ROOT) -> dict:
    """jax3d module -> the jax3d modules it imports, anywhere in its source (functions included); `root`
    holds the jax3d/ to read."""
    modules = {}
    for dirpath, _, files in os.walk(os.path.join(root, "jax3d")):
        for f in files:
            if f.endswith(".py"):
                modules[_module_name(os.path.join(dirpath, f), root)] = os.path.join(dirpath, f)
    graph = {}
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for t in targets:
                while t and t not in modules:  # `from pkg import name` names a module or something in pkg
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def find_cycle(graph: dict):
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_jax3d_has_no_import_cycle():
    graph = import_graph()
    assert "jax3d.train.step" in graph and "jax3d.config" in graph["jax3d.train.step"]
    # A package's __init__ re-exporting its own modules is not a cycle of ideas; leave those edges out.
    graph = {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph.items()}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_help_has_a_line_for_every_flag_and_each_default_once():
    parser = build_parser()
    fmt = HelpFormatter("launch/train.py")
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or "-h" in action.option_strings:
            continue
        text = fmt._get_help_string(action)
        assert action.help, f"{action.option_strings[0]} has no help line"
        assert text.count("default") <= 1, f"{action.option_strings[0]}: {text}"
        if action.choices and action.metavar:  # argparse prints the choices only without a metavar
            assert all(str(c) in text for c in action.choices if c), action.option_strings[0]
    text = parser.format_help()
    assert "(default: the preset's) (default: None)" not in text and "--tokenizer-type" in text


def test_help_prints_a_default_of_zero_and_says_how_the_automatic_layout_is_chosen():
    from jax3d.parallel.plan import AUTO_LAYOUTS

    actions = {a.dest: a for a in build_parser()._actions}
    fmt = HelpFormatter("launch/train.py")
    assert fmt._get_help_string(actions["lr_warmup_iters"]) == "linear warm-up steps (default: 0)"
    assert fmt._get_help_string(actions["scan_layers"]).count("default") == 1  # None and a flag pair: no second
    tp_help = fmt._get_help_string(actions["tensor_model_parallel_size"])
    assert ", ".join(f"({tp}, {pp})" for tp, pp in AUTO_LAYOUTS) in tp_help and "jax3d.parallel.plan.resolve" in tp_help


def _grep(pattern: str, *paths: str, skip: tuple = ()) -> list[str]:
    """'file:line: text' of every line matching `pattern` in the .py files under `paths` (relative to the
    checkout), except those under `skip`."""
    import re

    found = []
    for top in paths:
        top = os.path.join(ROOT, top)
        files = [top] if top.endswith(".py") else [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs
                                                   if f.endswith(".py")]
        for path in sorted(files):
            rel = os.path.relpath(path, ROOT)
            if rel.startswith(skip):
                continue
            for n, line in enumerate(open(path), 1):
                if re.search(pattern, line):
                    found.append(f"{rel}:{n}: {line.strip()}")
    return found


def test_command_lines_live_only_in_jax3d_cli():
    assert _grep(r"ArgumentParser|add_argument", "jax3d", skip=("jax3d/cli/",)) == []
    assert _grep(r"ArgumentParser|add_argument", "jax3d/cli")  # the grep sees them where they are


def test_model_code_carries_no_benchmark_switches():
    assert _grep(r"optimised\(|ablate|kernel_tunings", "jax3d/models", "jax3d/kernels", "jax3d/config.py") == []


# Decisions of the parallel layout, which only jax3d/parallel/ makes (the config and the command line carry the
# flags): the ZeRO stage compared with a number, or one ZeRO fact taken to imply another; the schedule's name
# compared; virtual stages held to a number; micro-batches or layers held against the stages.
_LAYOUT_DECISIONS = {
    "ZeRO stage compared with a number": r"\bzero(?:_stage)?\s*(?:[<>]=?|[!=]=)\s*\d|\bzero_stage\s+(?:not\s+)?in\b",
    "ZeRO-3 taken to imply ZeRO-2": r"\bshard_grads\s+or\s+gather_stacked\b",
    "the schedule's name compared": r"""[!=]=\s*["'](?:gpipe|1f1b|interleaved|zb-h1)["']"""
                                    r"|\.pipeline_schedule\s*(?:[!=]=|(?:not\s+)?in\b)",
    "virtual stages held to a number": r"\b(?:virtual_stages|v)\s*(?:<=?|!=)\s*\d",
    "micro-batches held against the stages": r"\b(?:m|microbatches|micro|accum)\s*(?:[<>]=?|%)\s*\(?(?:p|pp|stages)\b"
                                             r"|\)\s*(?:<|%)\s*pp\b",
    "layers held against the stages": r"\blayers\s*%\s*\(?(?:p|pp|stages)\b",
}


def test_layout_rules_and_zero_are_decided_only_in_jax3d_parallel():
    """Elsewhere code reads the plan's named facts (`plan.zero.gradients`, `plan.pipeline.virtual_stages`)."""
    outside = {what: _grep(pattern, "jax3d", skip=("jax3d/parallel/", "jax3d/config.py", "jax3d/cli/"))
               for what, pattern in _LAYOUT_DECISIONS.items()}
    assert {what: found for what, found in outside.items() if found} == {}
    for what in ("ZeRO stage compared with a number", "virtual stages held to a number"):
        assert _grep(_LAYOUT_DECISIONS[what], "jax3d/parallel"), what  # the grep sees them where they are


def _pallas_uses(path: str) -> list[str]:
    """'line: what' of each import of jax.experimental.pallas (or a module under it) and each `pallas_call` named
    in the code (not in docstrings or comments) of the module at `path`."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Name) and node.id == "pallas_call" or \
                isinstance(node, ast.Attribute) and node.attr == "pallas_call":
            found.append(f"{node.lineno}: pallas_call")
            continue
        else:
            continue
        pallas = [n for n in names if n.split(".")[:3] == ["jax", "experimental", "pallas"]]
        found += [f"{node.lineno}: import {pallas[0]}"] if pallas else []
    return found


def test_pallas_is_written_only_in_jax3d_kernels():
    """Model, inference and training code call the kernel modules of jax3d/kernels/; none of them writes a
    pallas_call or imports Pallas itself."""
    uses = {}  # 'jax3d/...py' -> its Pallas uses
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                uses[os.path.relpath(path, ROOT).replace(os.sep, "/")] = _pallas_uses(path)
    assert {path: found for path, found in uses.items() if found and not path.startswith("jax3d/kernels/")} == {}
    from jax3d.kernels import DECODE_KERNELS, KERNELS

    for name in KERNELS + DECODE_KERNELS:  # the rule sees the kernels where they are
        found = uses[f"jax3d/kernels/{name}.py"]
        assert any(u.endswith("pallas_call") for u in found) and any(": import " in u for u in found), name


def test_the_kernel_registry_lists_each_kernel_module_once():
    """jax3d.kernels lists its kernels in one place; each listed module is one, with its `Tuning`, `DEFAULT`
    and `supported`, and every module there but the shared helpers is listed."""
    import importlib

    import jax3d.kernels as kernels

    listed = kernels.KERNELS + kernels.DECODE_KERNELS
    assert len(set(listed)) == len(listed)
    here = {f[:-3] for f in os.listdir(os.path.join(PKG, "kernels")) if f.endswith(".py")}
    assert here - set(listed) == {"__init__", "pallas_gpu", "policy"}
    for name in listed:
        module = kernels.module(name)
        assert module is importlib.import_module(f"jax3d.kernels.{name}")
        entry = kernels.kernel(name)
        assert entry.name == name and entry.Tuning is module.Tuning and entry.DEFAULT is module.DEFAULT, name
        assert isinstance(entry.DEFAULT, entry.Tuning), name
        assert all(callable(f) for f in (entry.supported, entry.run, entry.reference)), name


# Mesh-axis names are spelled in jax3d/parallel only (jax3d.parallel.mesh: DATA, STAGE, MODEL). A literal counts as
# an axis name where it places or reduces over an axis: in a PartitionSpec, a sharding or mesh, a collective or
# its axis argument, a mesh's `.shape[...]`, an `*axis*` parameter's default or a `*AXES*`/`*MANUAL*` constant.
# Dict keys and config or JSON records that merely spell "data" or "model" are not.
_AXIS_NAMES = {"data", "stage", "model"}
_AXIS_CALLS = {"P", "PartitionSpec", "NamedSharding", "Mesh", "make_mesh", "shard_map", "with_auto_axes", "psum",
               "pmax", "pmin", "pmean", "all_gather", "psum_scatter", "ppermute", "all_to_all", "axis_index",
               "axis_size", "pshuffle", "pbroadcast"}


def _literals(node) -> list:
    """The axis-name string constants in `node`, through tuples, lists and conditional expressions."""
    if isinstance(node, ast.Constant) and node.value in _AXIS_NAMES:
        return [node]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [c for e in node.elts for c in _literals(e)]
    if isinstance(node, ast.IfExp):
        return _literals(node.body) + _literals(node.orelse)
    if isinstance(node, ast.Starred):
        return _literals(node.value)
    return []


def axis_literals(source: str) -> list[int]:
    """Lines of `source` that use a literal mesh-axis name as one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in _AXIS_CALLS:
                found += _literals(ast.Tuple(elts=list(node.args)))
            found += [c for k in node.keywords if k.arg and "axis" in k.arg or k.arg in ("in_specs", "out_specs")
                      for c in _literals(k.value)]
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
            found += _literals(node.slice)
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and any(
                isinstance(c, ast.Attribute) and c.attr == "shape" for c in node.comparators):
            found += _literals(node.left)  # "stage" in mesh.shape
        elif isinstance(node, ast.arguments):
            named = node.posonlyargs + node.args
            pairs = list(zip(named[len(named) - len(node.defaults):], node.defaults))
            pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
            found += [c for a, d in pairs if "axis" in a.arg or "axes" in a.arg for c in _literals(d)]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if any(n.isupper() and ("AXES" in n or "AXIS" in n or "MANUAL" in n) for n in names):
                found += _literals(node.value)
    return sorted({c.lineno for c in found})


def test_the_axis_name_rule_sees_each_use_and_no_record():
    uses = ('P(None, "data")', 'P(("data", "model"))', 'lax.psum(x, "stage")', 'lax.axis_index("data")',
            'jax.lax.all_gather(a, "data", axis=d)', 'mesh.shape["stage"]', '"stage" in mesh.shape',
            'NamedSharding(mesh, P("model" if tp else None))', 'f(x, axis_name="data")',
            'def load(mesh, data_axis: str = "data"): pass', '_MANUAL = ("stage", "data")')
    records = ('{"data": 1, "model": cfg.model_type}', 'meta["config"]["model"]', 'cfg.get("data")',
               'parser.add_argument_group("model")', 'x = ("model", 2)', 'k != "stage"')
    assert [axis_literals(src) for src in uses] == [[1]] * len(uses)
    assert [axis_literals(src) for src in records] == [[]] * len(records)


def test_mesh_axis_names_are_spelled_only_in_jax3d_parallel():
    found = []
    for d, _, files in os.walk(PKG):
        for f in files:
            path = os.path.join(d, f)
            rel = os.path.relpath(path, ROOT)
            if f.endswith(".py") and not rel.startswith(os.path.join("jax3d", "parallel", "")):
                found += [f"{rel}:{n}" for n in axis_literals(open(path).read())]
    assert found == []
    assert axis_literals(open(os.path.join(PKG, "parallel", "zero.py")).read())  # it sees them where they are


def test_which_kernels_run_is_the_policys_alone():
    """No kernel module, layer or decode module tests the platform or the device count: the run's KernelPolicy
    (jax3d.kernels.policy) decides once which kernels run; a kernel's `supported` tests shapes only. The layers
    build no ShardingRules of their own (jax3d/parallel does)."""
    hits = _grep(r"traced_platform|single_device\(|default_backend|on_one_gpu|kernel_settings|_SETTINGS",
                 "jax3d/models", "jax3d/kernels", "jax3d/inference/cached_attention.py",
                 "jax3d/inference/decode_rows.py", "jax3d/inference/one_row.py")
    assert [hit for hit in hits if not hit.startswith("jax3d/kernels/policy.py:")] == []  # the policy decides
    assert [hit for hit in _grep(r"ShardingRules\(", "jax3d") if not hit.startswith("jax3d/parallel/")] == []


def test_the_tests_mirror_the_packages():
    """Each test file sits in tests/<package>/ for the jax3d package it tests (tests/project/ for rules over the
    whole tree), and no test file is left at the top of tests/."""
    tests = os.path.join(os.path.dirname(PKG), "tests")
    packages = {d for d in os.listdir(PKG) if os.path.isdir(os.path.join(PKG, d)) and not d.startswith("_")}
    folders = {d for d in os.listdir(tests) if os.path.isdir(os.path.join(tests, d)) and not d.startswith((".", "_"))}
    top = sorted(f for f in os.listdir(tests) if f.startswith("test_") and f.endswith(".py"))
    assert top == [], f"test files at the top of tests/: {top}"
    with_tests = {d for d in folders if any(f.startswith("test_") for f in os.listdir(os.path.join(tests, d)))}
    assert with_tests - packages - {"project"} == set(), "a tests/ folder that names no jax3d package"
