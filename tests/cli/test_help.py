"""Every jax3d command's --help explains each flag and shows its default.

The rule, for every option of every command (and subcommand): its help is not empty, and the line `--help`
prints for it says "default" (jax3d.cli.common.HelpFormatter adds "(default: X)"; a help that already speaks
of its default keeps its own words), once, and never "default: None". Exempt from the default, where none
makes sense: a flag that takes no value and is off unless given (store_true and the like; a
--x/--no-x pair still shows which is the default), a required option, a positional argument, and -h.
"""
import argparse

import pytest


def help_problems(parser: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    """'FLAG: why' for each option of `parser` (and its subcommands) that breaks the rule above."""
    fmt = parser._get_formatter()
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                out += help_problems(sub, f"{prefix}{name} ")
            continue
        if isinstance(a, argparse._HelpAction) or a.help == argparse.SUPPRESS:
            continue
        name = prefix + next((o for o in a.option_strings if o.startswith("--")), a.dest)
        if not (a.help or "").strip():
            out.append(f"{name}: no help")
            continue
        text = fmt._expand_help(a)
        if text.count("default") > 1:
            out.append(f"{name}: says 'default' {text.count('default')} times: {text}")
        if not a.option_strings or a.required or (a.nargs == 0 and not isinstance(a, argparse.BooleanOptionalAction)):
            continue
        if "default" not in text or "default: None" in text:
            out.append(f"{name}: no default shown: {text}")
    return out


def _tool_parsers():
    from jax3d.cli import convert_hf as convert
    from jax3d.cli import data as data_cli
    from jax3d.cli import export
    from jax3d.cli import generate as generate_cli
    from jax3d.cli import schedules
    return {"launch/preprocess_data.py": data_cli.preprocess_parser, "launch/train_tokenizer.py":
            data_cli.train_tokenizer_parser, "launch/export.py": export.build_parser,
            "launch/generate.py": generate_cli.build_parser, "launch/convert_hf.py": convert.build_parser,
            "python -m jax3d.cli.schedules": schedules.build_parser}


@pytest.mark.parametrize("tool", ["launch/preprocess_data.py", "launch/train_tokenizer.py", "launch/export.py",
                                  "launch/generate.py", "launch/convert_hf.py", "python -m jax3d.cli.schedules"])
def test_every_flag_has_help_and_a_default(tool):
    parser = _tool_parsers()[tool]()
    assert help_problems(parser) == []
    parser.format_help()  # every %-expansion in the help works


def test_the_rule_catches_what_it_should():
    p = argparse.ArgumentParser()
    p.add_argument("--a", default=3)
    p.add_argument("--b", default=None, help="b")
    p.add_argument("--c", default=None, help="c (default: none)")
    p.add_argument("--d", action="store_true", help="d")
    p.add_argument("--e", required=True, help="e")
    p.add_argument("--f", action=argparse.BooleanOptionalAction, default=None, help="f")
    p.add_argument("--g", default="x", help="g (default: %(default)s); default")
    assert help_problems(p) == ["--a: no help", "--b: no default shown: b", "--f: no default shown: f",
                                "--g: says 'default' 2 times: g (default: x); default"]


def test_train_flags_have_help_and_a_default():
    from jax3d.cli.train_flags import build_parser
    assert help_problems(build_parser()) == []


def test_evaluate_flags_have_help_and_a_default():
    from jax3d.cli import evaluate
    assert help_problems(evaluate.build_parser()) == []
