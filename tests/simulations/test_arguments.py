"""The argument types and the run options the ``ldp-sim`` commands share."""

from __future__ import annotations

import argparse
import re

import pytest

from simulations.arguments import (
    RUN_OPTIONS,
    check_cells,
    list_of,
    one_of,
    probability,
    run_options,
    user_count,
)
from simulations.cli import build_parser


@pytest.mark.parametrize(
    ("zero", "one", "accepted", "refused", "interval"),
    [
        (True, True, ["0", "0.5", "1"], ["-0.1", "1.1", "nan"], "[0, 1]"),
        (False, False, ["0.05", "0.999"], ["0", "1", "nan"], "(0, 1)"),
        (False, True, ["1", "0.5"], ["0", "1.5"], "(0, 1]"),
    ],
)
def test_one_probability_type_for_every_interval(
    zero: bool, one: bool, accepted: list[str], refused: list[str], interval: str
) -> None:
    parse = probability(zero=zero, one=one)
    assert [parse(text) for text in accepted] == [float(text) for text in accepted]
    for text in refused:
        with pytest.raises(ValueError, match=re.escape(f"is not a probability in {interval}")):
            parse(text)


def test_user_counts_in_any_notation() -> None:
    assert [user_count(t) for t in ("1000", "1_000", "1e3", "10**3")] == [1000] * 4
    for text in ("0", "1.5e0", "-3"):
        with pytest.raises(ValueError):
            user_count(text)


def test_lists_name_what_they_refuse() -> None:
    parse = list_of(one_of(["grr", "oue"], "mechanism"), "mechanisms")
    assert parse("grr, oue") == ["grr", "oue"]
    with pytest.raises(argparse.ArgumentTypeError, match="mechanisms: unknown mechanism 'x'"):
        parse("grr,x")
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated list of mechanisms"):
        parse(" , ")


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (choices,) = [a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    found = dict(choices)
    audit = found.pop("audit")
    (audits,) = [a.choices for a in audit._actions if isinstance(a, argparse._SubParsersAction)]
    return found | {f"audit {name}": sub for name, sub in audits.items()}


def test_every_command_takes_the_run_options_from_the_one_parent() -> None:
    """--seed, --out and --quiet everywhere, in the "run options" group; --reps, --workers
    and --scheduler where the command has repetitions or Dask."""
    shared = {option.dest for option in run_options(reps=(1, "r"), dask=True)._actions}
    for name, parser in subcommands().items():
        (group,) = [g for g in parser._action_groups if g.title == RUN_OPTIONS]
        dests = {action.dest for action in group._group_actions}
        assert {"seed", "out", "quiet"} <= dests <= shared, name
        others = [a.dest for g in parser._action_groups if g is not group for a in g._group_actions]
        assert not set(others) & shared, (name, set(others) & shared)


def test_a_grid_cell_that_cannot_be_built_is_a_usage_error_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``check_cells``: the first cell whose mechanism refuses its spec stops the command
    before any work, with the cell's description and the refusal's first problem."""

    class Cell:
        def __init__(self, problem: str | None) -> None:
            self.problem = problem

        def make(self) -> None:
            if self.problem is not None:
                raise ValueError(self.problem)

    parser = argparse.ArgumentParser(prog="ldp-sim multidim")
    check_cells([Cell(None)], parser, lambda cell: "fine")  # nothing to say
    with pytest.raises(SystemExit) as exit_info:
        check_cells([Cell(None), Cell("too small"), Cell("later")], parser, lambda c: "cell")
    assert exit_info.value.code == 2
    assert "cell: too small" in capsys.readouterr().err
