"""docs/slime.md against what `agentrl train` accepts: a flag the page calls "not yet" must be
refused (else the page is stale, as it was for flags that worked), one it calls "same" accepted,
one it calls "no effect" accepted with the notice (not one agentrl now honours), one it calls
"refused" refused with a reason, and every slime flag agentrl/slime_args.py handles specially
must be on the page. Every flag of the five launch scripts is accepted."""

import re
from pathlib import Path

import pytest

from slime_scripts import SCRIPTS, checked_in

from agentrl import slime_args
from agentrl.config import build_parser
from agentrl.slime_args import flag_status

DOC = (Path(__file__).resolve().parents[1] / "docs" / "slime.md").read_text()
PARSER_FLAGS = {f for action in build_parser()._actions for f in action.option_strings}


def table_rows() -> list[tuple[list[str], str]]:
    """(slime flags of the first cell, the agentrl cell) of each mapping table row."""
    rows = []
    for line in DOC.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) >= 2 and not set(cells[0]) <= {"-"}:
            flags = [f for f in re.findall(r"`(--[a-z0-9-]+)", cells[0]) if not f.endswith("-")]
            rows.append((flags, cells[1]))
    return rows


def test_not_yet_means_refused_and_the_rest_is_accepted():
    stale, missing = [], []
    for flags, agentrl_cell in table_rows():
        for flag in flags:
            status = flag_status(flag, PARSER_FLAGS)
            if agentrl_cell.startswith("not yet") and status not in ("unknown", "refused"):
                stale.append(f"{flag} ({status})")
            elif agentrl_cell.startswith(("same", "no effect")) and status == "unknown":
                missing.append(flag)  # (a row naming another agentrl flag maps onto that one)
            elif agentrl_cell.startswith("refused") and status != "refused":
                stale.append(f"{flag} ({status}, documented as refused)")
            elif agentrl_cell.startswith("no effect") and status != "no-effect":
                stale.append(f"{flag} ({status}, documented as having no effect)")
    assert not stale, f"docs/slime.md says 'not yet' but agentrl train accepts: {stale}"
    assert not missing, f"docs/slime.md lists as working but agentrl train refuses: {missing}"


def test_every_special_slime_flag_is_documented():
    handled = [*slime_args.SHAPE_VALUES, *slime_args.SHAPE_SWITCHES, *slime_args.SHAPE_FROM_CONFIG,
               *slime_args.NO_EFFECT, *slime_args.REFUSED, *slime_args.RENAMED, *slime_args.MAPPED]
    undocumented = [n for n in handled if f"`--{n.replace('_', '-')}" not in DOC
                    and not (n.startswith(("q_lora", "kv_lora", "qk_", "v_head")))]  # "the MLA sizes"
    assert not undocumented, f"add to docs/slime.md: {undocumented}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_of_the_launch_scripts_is_accepted(name):
    flags = {a.split("=")[0] for a in checked_in(name) if a.startswith("--")}
    assert not [f for f in flags if flag_status(f, PARSER_FLAGS) == "unknown"]


def test_every_flag_of_slimes_scripts_and_examples_is_taken():
    """The argument arrays of all of slime's scripts/ and examples/ (tests/data/slime_scripts/
    all_flags.txt; test_the_flag_list_is_slimes checks it against a checkout)."""
    flags = (Path(__file__).parent / "data" / "slime_scripts" / "all_flags.txt").read_text().split()
    assert len(flags) > 200
    assert not [f for f in flags if flag_status(f, PARSER_FLAGS) == "unknown"]


def test_the_flag_list_is_slimes(tmp_path):
    from slime_scripts import array_flags, slime_checkout

    slime = slime_checkout(tmp_path)
    if slime is None:
        pytest.skip("no slime checkout (AGENTRL_SLIME_SRC or the git mirror)")
    assert array_flags(slime) == (Path(__file__).parent / "data" / "slime_scripts" / "all_flags.txt").read_text().split()
