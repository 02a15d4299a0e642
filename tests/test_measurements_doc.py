"""docs/measurements.md's generated sections are what scripts/measurements.py builds now (issue 35):
``make run``'s facts from the Makefile and the training config, ``meshkit plan``'s ranking of the
1.3 B GPT on 64 h100, and the planner beside the published runs (analytical: about 4 CPU seconds in
all). The page had described the old GPT job and a ranking of 1,218 layouts led by dp=8,tp=8 after
both had changed; its published-runs tables were edited by hand (the trust issue)."""

import importlib.util
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "measurements.py"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("measurements", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def page(gen):
    return gen.PAGE.read_text()


def test_page_is_what_the_generator_builds(gen, page):
    assert gen.render(page) == page, "docs/measurements.md is stale: run scripts/measurements.py"


def test_generated_sections_name_the_job_and_the_ranking_of_now(gen, page):
    run = page.split("<!-- generated: make-run -->")[1].split("<!-- end generated")[0]
    words = " ".join(run.split())
    assert "--model llama" in words and "BPE of 1,024 ids" in words and "200 steps" in words
    plan = page.split("<!-- generated: plan-gpt-1.3b -->")[1].split("<!-- end generated")[0]
    assert "| 1 |" in plan and "| 3 |" in plan and "| 4 |" not in plan
    # a stale figure inside a generated section is rebuilt; the check mode says so
    stale = page.replace(plan, plan.replace("| 1 |", "| 1 | stale"))
    assert stale != page and gen.render(stale) == page


def test_planner_tables_are_the_planners_predictions_of_the_published_runs(gen, page):
    """Every calibrate and check run of the corpus, its ratio the planner's (``Run.ratio``) now; a
    stale figure in a row or in the summary is rebuilt, so the page check fails on it."""
    from meshkit.planner.calibrate import load

    tables = page.split("<!-- generated: planner-published-runs -->")[1].split("<!-- end generated")[0]
    runs = [
        r
        for r in load(SCRIPT.parents[1] / "tests" / "corpus" / "published_runs.json")[0]
        if r.split in ("calibrate", "check")
    ]
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in tables.splitlines() if " | " in line}
    assert {r.name for r in runs} <= rows.keys() and len(runs) > 50
    for r in runs:
        assert rows[r.name].split(" | ")[5] == f"{r.ratio():.2f}", r.name
    check = [r.ratio() for r in runs if r.split == "check"]
    rms = math.sqrt(sum(math.log(x) ** 2 for x in check) / len(check))
    assert f"| check ({len(check)} runs) | {min(check):.2f}-{max(check):.2f} | {rms:.3f} |" in tables
    row = rows[runs[0].name]
    stale_row = row.replace(f" | {runs[0].ratio():.2f} | ", " | 9.99 | ")
    stale_summary = f"| check ({len(check) - 1} runs) |"
    stale = page.replace(row, stale_row).replace(f"| check ({len(check)} runs) |", stale_summary)
    assert stale_row != row and stale_row in stale and stale_summary in stale and stale_summary not in page
    assert gen.render(stale) == page
