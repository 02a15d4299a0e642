"""docs/measurements.md's generated sections are what scripts/measurements.py builds now (issue 35):
``make run``'s facts from the Makefile and the training config, and ``meshkit plan``'s ranking of the
1.3 B GPT on 64 h100 (analytical: about 4 CPU seconds in all). The page had described the old GPT
job and a ranking of 1,218 layouts led by dp=8,tp=8 after both had changed."""

import importlib.util
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
