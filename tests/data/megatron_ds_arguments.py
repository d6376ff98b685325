"""Writes megatron_ds_arguments.txt: every option string of Megatron-DeepSpeed's megatron/arguments.py, aliases
included, one a line in the file's order, read from its `add_argument` calls with `ast` (the file is not run).

    git -C MEGATRON_DS show HEAD:megatron/arguments.py > /tmp/arguments.py
    python tests/data/megatron_ds_arguments.py /tmp/arguments.py "microsoft/Megatron-DeepSpeed $(git -C MEGATRON_DS rev-parse HEAD)" \
        > tests/data/megatron_ds_arguments.txt

tests/test_megatron_flags.py checks that train.py decides each of them.
"""
import ast
import sys


def option_strings(source: str) -> tuple[int, list[str]]:
    """(the number of add_argument calls, their option strings in source order)."""
    calls = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"]
    calls.sort(key=lambda c: (c.lineno, c.col_offset))
    names = [a.value for c in calls for a in c.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return len(calls), names


def main(path: str, origin: str) -> None:
    with open(path) as f:
        n, names = option_strings(f.read())
    print(f"# The option strings of megatron/arguments.py at {origin}: {n} add_argument calls, {len(names)} "
          "strings\n# (aliases each on a line). Written by megatron_ds_arguments.py beside this file.")
    print("\n".join(names))


if __name__ == "__main__":
    main(*sys.argv[1:3])
