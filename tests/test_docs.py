"""The documentation builds, and every code block in it runs.

- ``mkdocs build --strict`` builds ``docs/`` into a temporary folder: a broken link, a link to a
  missing page or anchor, or a page left out of the navigation fails the test.
- Every fenced block of ``README.md`` and ``docs/*.md`` is run, by its language:

  * ``python``: a page's Python blocks run in order in one fresh interpreter (the reader's one
    session), in a temporary folder, with 8 simulated CPU devices. Tracebacks name the page and
    its line.
  * ``bash``: the block runs as one bash script in a fresh temporary folder (so ``cd`` carries
    from line to line), with this environment's ``meshkit`` first on ``PATH``. Each command must
    exit 0, or the status its line's comment names (``# exit 2``).
  * ``console``: as ``bash`` for the ``$ `` lines; every other line is output shown in the docs,
    and must appear, in order, in what the commands print (digits may differ; ``...`` skips).
  * ``text``: output or a picture of a layout, not run.

  Any other language fails the test, so that no block is left unrun by accident.

The only commands in code blocks not run are the README's two, ``make run`` and ``make test``: CI
runs ``make test`` (``.ci/run``), which includes this file, and ``make run`` trains for a minute or
more. The benchmarks that produced the tables of ``docs/measurements.md`` (minutes to hours each)
are named in its text, not in code blocks, and are not run here.

Cost: about 25 commands and 8 Python sessions, each a fresh process that starts JAX and compiles;
the examples are tiny on purpose (``--preset tiny``, small models, few steps).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from _limits import limit

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("python", "bash", "console", "text")
NOT_RUN = ("make run", "make test")  # the README's two commands; see the module docstring

# A block's (or a page's Python) time limit: from the slowest one's CPU seconds, measured (the
# commands and every process they started; tests/_limits.py), scaled by the load when it starts.
BLOCK_CPU_S = 18

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+)(?P<info>[^`\n]*)$")
EXIT = re.compile(r"#\s*exit (\d+)\b")
HEREDOC = re.compile(r"<<-?\s*'?\"?(\w+)'?\"?")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the block's first line of code
    lang: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, with the line each starts on."""
    out, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and lines[i].strip() != m["fence"]:
            body.append(lines[i][len(m["indent"]) :])
            i += 1
        assert i < len(lines), f"{page.name}:{start}: unclosed code block"
        out.append(Block(page, start + 1, m["info"].strip(), "\n".join(body) + "\n"))
        i += 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]


def env(*, python: bool = False) -> dict[str, str]:
    """The environment of a block: this checkout's meshkit first, CPU devices, no colours. Python
    blocks get 8 simulated CPU devices; shell commands get what a user's shell has (each meshkit
    command simulates its own, `--devices 8` by default)."""
    # The suite's JAX_DISABLE_MOST_OPTIMIZATIONS (conftest) is kept: it turns off XLA's backend (LLVM)
    # passes only, so the HLO, collectives, memory and every figure a page prints (digits are not
    # compared) are a user's, and the blocks share the suite's compilation cache. That a user's command
    # runs at XLA's default level is test_deterministic_mp's point (meshkit train and launch, bit for bit).
    e = {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_") and k != "XLA_FLAGS"}
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.update(
        JAX_PLATFORMS="cpu",
        NO_COLOR="1",
        # Open MPI refuses root unless told (CI runs as root); 2 processes on a 1-core machine.
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
    )
    if python:
        e["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    return e


def test_blocks_compile_as_the_suite_does():
    """The pages' commands inherit the suite's compile setting (conftest), hence its compilation cache;
    a user's default optimisation level is run by tests/test_deterministic_mp.py, which must keep it."""
    assert os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "1"
    for e in (env(), env(python=True)):
        assert e["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1" and e["JAX_COMPILATION_CACHE_DIR"]
    mp = (ROOT / "tests" / "test_deterministic_mp.py").read_text()
    assert 'k not in ("JAX_DISABLE_MOST_OPTIMIZATIONS", "XLA_FLAGS")' in mp


def test_every_block_has_a_known_language():
    bad = [f"{b.id}: ```{b.lang}" for b in ALL if b.lang not in LANGUAGES]
    assert not bad, f"code blocks must be one of {LANGUAGES} (so that the test runs them): {bad}"
    assert sum(b.lang == "python" for b in ALL) >= 5 and sum(b.lang in ("bash", "console") for b in ALL) >= 10


def test_site_builds_strict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=limit(1),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_strict_build_fails_on_a_broken_link(tmp_path):
    """The check above can fail: the same build over a copy with one broken link does."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    (copy / "docs" / "index.md").write_text(
        (copy / "docs" / "index.md").read_text() + "\n[x](no-such-page.md)\n"
    )
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "s")],
                          cwd=copy, capture_output=True, text=True, timeout=limit(1))  # fmt: skip
    assert proc.returncode != 0 and "no-such-page.md" in proc.stdout + proc.stderr


def test_readme_links_resolve():
    """The README is outside the site, so mkdocs does not check it: every relative link must name a
    file that exists, and an anchor a heading of that file (slugged as the site slugs it)."""
    from markdown.extensions.toc import slugify

    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path
        if not file.is_file():
            bad.append(target)
        elif anchor:
            heads = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
            if anchor not in {slugify(re.sub(r"[`*]", "", h), "-") for h in heads}:
                bad.append(target)
    assert not bad, f"README links to what does not exist: {bad}"


# -- Python ---------------------------------------------------------------------------------------
RUNNER = """
import json, sys
ns = {"__name__": "__main__"}
for page, line, code in json.load(open(sys.argv[1])):
    exec(compile("\\n" * (line - 1) + code, page, "exec"), ns)
"""

PY_PAGES = sorted({b.page for b in ALL if b.lang == "python"})

# Tiers: each page's Python runs whole in the core tier but the three dearest pages', which sweep, the same
# calls core in the tests named here:
# - docs/your-model.md (a Trainer's step, report, compiled program, save and restore under another plan; a
#   loss with state, a key and aux; meshkit.layer; logical axes; NNX, Linen and Equinox models):
#   test_trainer.py (test_save_and_restore_continue_the_run, test_aux_state_and_a_fresh_key_per_step_...),
#   test_fsdp.py (meshkit.layer under zero3's layer remat), test_user_models.py (logical axes under dp+tp),
#   test_adapters.py (each framework's model under fsdp+tp: zero3's sharding over data and the rules, its
#   state carried), test_batchnorm.py (Equinox's state under a vmapped axis name), test_user_transformers.py
#   (a Linen LM's blocks marked through nn.intercept_methods, fsdp+tp with layer remat).
# - docs/plans.md (dp, zero1-3's reports beside the model; a ParallelSpec with accumulate, and its refusal of
#   microbatches without a pipeline; meshkit.layer's peak under zero3 with and without layer remat):
#   test_plans.py's certificates, test_trainer.py's test_report_prints_as_a_table, test_pipeline.py's
#   test_trainer_refusals_name_the_fix, test_peak.py's test_model_predicts_per_layer_remat_below_holding_...
#   and, for meshkit.layer's hooks, test_sharded_gradient_accumulator_of_zero2_and_zero3_is_in_the_model.
# - docs/pipelines.md (a user's Stages under dp+pp and pp, their executed schedule and bubble in the report,
#   build_schedule, bubble_model, layer remat in a pipeline): test_pipeline.py's
#   test_user_stages_model_matches_numpy_float64, test_schedule_table_is_legal_and_reaches_the_bubble,
#   test_trainer_fsdp_pp_and_tp_pp_match_one_device_and_their_model (the bubble and remat in the report).
PY_SWEEP = {"docs/your-model.md", "docs/plans.md", "docs/pipelines.md"}
PY_IDS = [str(p.relative_to(ROOT)) for p in PY_PAGES]


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(p, id=i, marks=pytest.mark.sweep if i in PY_SWEEP else ())
        for p, i in zip(PY_PAGES, PY_IDS, strict=True)
    ],
)
def test_python_blocks_run(page, tmp_path):
    code = [(str(b.page), b.line, b.code) for b in ALL if b.page == page and b.lang == "python"]
    (tmp_path / "blocks.json").write_text(json.dumps(code))
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(tmp_path / "blocks.json")], cwd=work, env=env(python=True),
                          capture_output=True, text=True, timeout=limit(BLOCK_CPU_S))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


# -- Shell ----------------------------------------------------------------------------------------
def commands(block: Block) -> list[tuple[int, str, list[str]]]:
    """(line, command, output lines shown under it) for each command of a bash/console block;
    continuation lines (ending in a backslash) are joined."""
    out: list[tuple[int, str, list[str]]] = []
    lines = block.code.splitlines()
    i = 0
    while i < len(lines):
        raw, n = lines[i], block.line + i
        if block.lang == "console":
            if not raw.startswith("$ "):
                if out:
                    out[-1][2].append(raw)
                i += 1
                continue
            raw = raw[2:]
        cmd = raw
        while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        if (here := HEREDOC.search(cmd)) is not None:  # a here-document is part of its command
            while i < len(lines) and lines[i] != here[1]:
                cmd += "\n" + lines[i]
                i += 1
            cmd += "\n" + here[1]
            i += 1
        if cmd.strip() and not cmd.strip().startswith("#"):
            out.append((n, cmd, []))
    return out


def script(block: Block) -> str:
    """The block as one bash script that checks each command's exit status."""
    lines = ["set -u"]
    for n, cmd, _ in commands(block):
        if cmd.split("#")[0].strip() in NOT_RUN:
            continue
        m = EXIT.search(cmd)
        want = int(m[1]) if m else 0
        lines.append(f"echo '>>> {block.page.relative_to(ROOT)}:{n}' >&2")
        lines.append(cmd)
        lines.append(f'rc=$?; [ "$rc" = {want} ] || {{ echo "{block.page.name}:{n}: exit $rc, the docs say {want}: '
                     f'{cmd.replace(chr(34), chr(39))[:80]}" >&2; exit 99; }}')  # fmt: skip
    return "\n".join(lines) + "\n"


SHELL = [b for b in ALL if b.lang in ("bash", "console")]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def normal(line: str) -> str:
    """A line of output with what varies from run to run taken out: digits, widths, colours."""
    line = ANSI.sub("", line)
    line = re.sub(r"\d[\d,.]*", "0", line)
    line = re.sub(r"([━─═ ])\1+", r"\1", line)
    return " ".join(line.split())


def shown_in_order(shown: list[str], printed: str) -> str | None:
    """None if every shown line (normalised) appears in the printed output in order, else the first
    shown line that does not."""
    got = [normal(x) for x in printed.splitlines()]
    k = 0
    for s in shown:
        if s.strip() in ("...", ""):
            continue
        want = normal(s)
        while k < len(got) and want not in got[k]:
            k += 1
        if k == len(got):
            return s
        k += 1
    return None


def run_block(block: Block, body: str, cwd: Path, timeout_s: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a block's script; past ``timeout_s`` the test fails naming the
    command that was running, and every process the block started is killed (none is left burning CPU
    beside the tests after it)."""
    proc = subprocess.Popen(["bash", "-c", body], cwd=cwd, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        running = [x for x in err.splitlines() if x.startswith(">>> ")][-1:] or ["before its first command"]
        pytest.fail(f"{block.id}: still running after {timeout_s:g} s at {running[0]}\n{err[-2000:]}")
    return proc.returncode, out, err


# Tiers: the README keeps its shell blocks named here by their order in the core tier (its first is its two
# make commands); every other page keeps its first shell block or the cheaper ones named here, but for the
# pages named with none (()): theirs sweep, each command's path core in the tests named below. Every other
# shell block sweeps.
# - docs/llama.md (meshkit train --model llama under fsdp+tp with --export-hf, meshkit export --shard-mb,
#   meshkit generate of two prompts, --init-from hf: under zero3): test_llama_cli.py's trained run,
#   test_meshkit_export_and_generate_on_the_run and test_init_from_the_export_starts_from_its_weights.
# - docs/fine-tuning.md: data prepare --vocab-size in docs/data.md's core block, prompt/completion rows
#   through a tokenizer without a chat template in test_data_sft.py's
#   test_prepare_chat_refuses_what_it_cannot_read, --task sft from an --export-hf checkpoint with
#   --init-from hf: and --lora-rank in test_sft_train.py's
#   test_meshkit_train_task_sft_on_prepared_conversations, LoRA under fsdp and its merged export in
#   test_lora.py's test_meshkit_train_with_lora_proves_its_cost_and_exports_the_merged_model.
# - docs/migrating.md: --check, --diff, --fix and a missing path in test_migrate_cli.py
#   (test_check_exits_1_while_findings_remain, test_diff_shows_the_change_and_writes_nothing,
#   test_fix_writes_then_check_passes_and_second_fix_changes_nothing,
#   test_missing_path_is_one_line_error_and_exit_2), fixed pmaps running as before in
#   test_migrate_corpus.py's test_distilled_snippet_gives_the_same_outputs_after_fix.
# - docs/deterministic.md: meshkit train --deterministic and its summary line in test_deterministic.py's
#   test_a_deterministic_run_resumed_turns_fused_multiply_adds_off_before_jax_starts, the line's price in
#   test_report_sets_the_measured_gather_beside_the_deterministic_model.
# - docs/plans.md (its meshkit verify block; its two meshkit train blocks sweep as they did): a
#   path/to/file.py:function target in test_grpo_train.py's --reward (user_code.resolve, as --model reads
#   it; test_verify_deterministic_mp.py's test_a_loss_that_differs_between_processes_fails_the_local_rows
#   sweeps), --model linear --json in test_plans.py's
#   test_verify_cli_json_and_exit_code, zero2 with --accumulate 2 on a plain-JAX MLP in test_verify.py's
#   test_verify_model_certifies_a_plain_jax_mlp_..., an unknown plan in test_bad_input.py, a missing function
#   in test_verify.py's test_bad_model_targets_are_one_line.
# - docs/training.md (--resume with no checkpoint, a missing --data file; the resume under another plan and
#   mesh): test_train.py's test_bad_input_is_one_line_exit_2_and_writes_nothing, test_pipeline.py's
#   test_meshkit_train_dp_pp_resumes_under_fsdp_and_back_bitwise_and_writes_the_schedule.
CORE_SHELL = {"README.md": (0, 3), "docs/data.md": (1,), "docs/index.md": (0, 1), "docs/many-hosts.md": (3,),
              "docs/deterministic.md": (), "docs/fine-tuning.md": (), "docs/llama.md": (),
              "docs/migrating.md": (), "docs/plans.md": (), "docs/training.md": ()}  # fmt: skip


def tiered_shell(shell: list[Block]) -> list:
    order: dict[str, int] = {}
    cases, pages, cored = [], set(), set()
    for block in shell:
        page = str(block.page.relative_to(ROOT))
        n = order[page] = order.get(page, -1) + 1
        core = n in CORE_SHELL.get(page, (0,))
        pages.add(page)
        cored |= {page} if core else set()
        cases.append(pytest.param(block, id=block.id, marks=() if core else pytest.mark.sweep))
    none = {page for page, core in CORE_SHELL.items() if core == ()}
    assert "README.md" in cored, "the README's shell blocks must keep one in the core tier"
    assert pages == cored | (none & pages), (
        f"pages with no shell block in the core tier: {sorted(pages - cored - none)}"
    )
    assert not none & cored, f"pages named with no core block that have one: {sorted(none & cored)}"
    return cases


@pytest.mark.parametrize("block", tiered_shell(SHELL))
def test_shell_block_runs(block, tmp_path):
    body = script(block)
    if body.count("\n") == 1:  # only the README's two commands
        assert {c.split("#")[0].strip() for _, c, _ in commands(block)} <= set(NOT_RUN)
        return
    rc, out, err = run_block(block, body, tmp_path, limit(BLOCK_CPU_S))
    assert rc == 0, out[-4000:] + err[-4000:]
    shown = [line for _, _, printed in commands(block) for line in printed]
    missing = shown_in_order(shown, out + err)
    assert missing is None, f"{block.id}: shown output not printed: {missing!r}\n{out[-4000:]}"


def test_output_check_can_fail():
    """The output check above is not vacuous: changed words or a changed order fail it."""
    printed = "Layouts that fit, fastest first (top 5 of 2240)\n 1 | dp=32 zero3 | 28.03 GB\nchoice: dp=32\n"
    assert (
        shown_in_order(["Layouts that fit, fastest first (top 3 of 11)", "...", "choice: dp=8"], printed)
        is None
    )
    assert shown_in_order(["Layouts that do not fit"], printed) == "Layouts that do not fit"
    assert (
        shown_in_order(["choice: dp=8", "Layouts that fit, fastest first (top 3 of 11)"], printed) is not None
    )


def test_a_block_past_its_timeout_fails_naming_its_command_and_leaves_no_process(tmp_path):
    """A timed-out block's commands (here one in the background, as a meshkit command's children) are
    killed with it: bash alone killed left them running, a CPU burner beside the rest of the suite."""
    block = Block(ROOT / "README.md", 1, "bash", "true\nsleep 300 & echo $! > pid; wait\n")
    with pytest.raises(
        pytest.fail.Exception, match=r"README.md:1: still running after 5 s at >>> README.md:2"
    ):
        run_block(block, script(block), tmp_path, 5)  # room for bash to start on busy cores
    pid = int((tmp_path / "pid").read_text())
    assert not _alive(pid), f"the block's background command {pid} still runs"


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs: a killed process that nobody has reaped yet (its parent, bash, is
    gone, and a container's init may not reap) is a zombie, and counts as gone; a second for the kill
    to land."""
    import time

    for _ in range(20):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.05)
    return True
