"""meshkit migrate on files and through the CLI: output format, --diff, --fix, --check, --json, excludes."""

import codecs
import io
import json
import re
import shutil
import stat
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from _limits import limit
from meshkit.cli import main
from meshkit.migrate import MigratePathError, MigrateWriteError, fix_source, lint, migrate_file, write

FIXTURES = Path(__file__).parent / "fixtures" / "migrate"
LINE = re.compile(r"^\S+:\d+:\d+ MK\d{3} .+ \(fix: .+\)$")
COMMENTED = """\
# header comment
import jax  # why jax

# a step, mapped over devices
step = jax.pmap(  # opening
    lambda x: x * 2,  # the body
    axis_name="i",  # the axis
    jit=True,  # legacy flag
)
key = jax.random.PRNGKey(0)  # seed
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of the fixtures plus a file that does not parse and one under an excluded directory."""
    shutil.copytree(FIXTURES, tmp_path / "proj", ignore=shutil.ignore_patterns("earlier", "inline"))
    (tmp_path / "proj" / "broken.py").write_text("def f(:\n    pass\n")
    (tmp_path / "proj" / "vendor").mkdir()
    (tmp_path / "proj" / "vendor" / "old.py").write_text("import jax\nk = jax.random.PRNGKey(1)\n")
    return tmp_path / "proj"


def comments(text: str) -> list[str]:
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return sorted(t.string for t in tokens if t.type == tokenize.COMMENT)


def test_fix_keeps_every_comment_and_is_idempotent():
    once = fix_source(COMMENTED)
    assert comments(once) == comments(COMMENTED)
    assert "jit=" not in once and "jax.random.key(0)  # seed" in once
    assert fix_source(once) == once
    fixture = (FIXTURES / "legacy_train.py").read_text()
    assert comments(fix_source(fixture)) == comments(fixture)
    assert fix_source(fix_source(fixture)) == fix_source(fixture)


def test_directory_with_a_syntax_error_reports_it_goes_on_and_exits_1(project: Path, capsys):
    assert main(["migrate", str(project)]) == 1  # a file migrate could not read is never a silent pass
    out = capsys.readouterr().out
    broken = [line for line in out.splitlines() if "broken.py" in line]
    assert len(broken) == 1 and re.match(r"^\S+broken\.py:1:7 MK000 cannot parse: ", broken[0])
    assert "legacy_train.py:13:1 MK015 " in out and "vendor/old.py:2:5 MK002 " in out
    assert sum(1 for f in lint([project]) if f.rule == "MK000") == 1


def test_lint_output_format_and_summary(project: Path, capsys):
    assert main(["migrate", str(project / "legacy_train.py"), str(project / "modern.py")]) == 0
    out = capsys.readouterr().out.splitlines()
    findings = [line for line in out if LINE.match(line)]
    assert len(findings) == 5
    assert any(line.startswith(f"{project}/legacy_train.py:29:11 MK002 ") for line in findings)
    assert "Findings by rule" in out[len(findings)]
    assert out[-1] == "5 finding(s) in 2 file(s)"


def test_diff_shows_the_change_and_writes_nothing(project: Path, capsys):
    path = project / "vendor" / "old.py"
    assert main(["migrate", str(path), "--diff", "--fix"]) == 0
    out = capsys.readouterr().out
    assert f"--- {path}\n+++ {path} (fixed)\n" in out
    assert "-k = jax.random.PRNGKey(1)\n+k = jax.random.key(1)\n" in out
    assert path.read_text() == "import jax\nk = jax.random.PRNGKey(1)\n"


def test_fix_writes_then_check_passes_and_second_fix_changes_nothing(project: Path, capsys):
    target = project / "legacy_train.py"
    assert main(["migrate", str(target), "--fix", "--check"]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == "0 finding(s) in 1 file(s); fixed 5"
    fixed = target.read_text()
    assert "jax.shard_map(" in fixed and "jax.pmap" not in fixed
    assert main(["migrate", str(target), "--fix", "--check"]) == 0
    assert target.read_text() == fixed


def test_check_exits_1_while_findings_remain(project: Path, capsys):
    assert main(["migrate", str(project / "modern.py"), "--check"]) == 0
    assert main(["migrate", str(project / "legacy_train.py"), "--check"]) == 1
    nested = project / "nested.py"
    nested.write_text("import jax\ninner = jax.pmap(lambda x: x)\nouter = jax.pmap(lambda x: inner(x))\n")
    assert main(["migrate", str(nested), "--fix", "--check"]) == 1
    assert "MK014" in capsys.readouterr().out


def test_json_lists_findings_and_counts(project: Path, capsys):
    assert main(["migrate", str(project), "--json", "--exclude", "broken.py"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["counts"] == {"MK001": 1, "MK002": 2, "MK010": 1, "MK015": 2}
    assert report["files"] == 3 and report["fixed"] == 0
    first = report["findings"][0]
    assert set(first) == {"path", "line", "col", "rule", "message", "fix", "fixable"}


def test_excludes_skip_matching_files_and_directories(project: Path, capsys):
    assert main(["migrate", str(project), "--json", "--exclude", "vendor", "--exclude", "*.py"]) == 0
    assert json.loads(capsys.readouterr().out)["files"] == 0
    assert main(["migrate", str(project), "--json", "--exclude", "vendor", "--exclude", "broken*"]) == 0
    paths = {Path(f["path"]).name for f in json.loads(capsys.readouterr().out)["findings"]}
    assert paths == {"legacy_train.py"}


def test_missing_path_is_one_line_error_and_exit_2(tmp_path: Path, capsys):
    assert main(["migrate", str(tmp_path / "nope.py")]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: no such file or directory ") and captured.err.count("\n") == 1
    with pytest.raises(MigratePathError):
        lint([tmp_path / "nope.py"])


@pytest.mark.parametrize(
    "legacy",
    [
        "import jax\nt = jax.tree_multimap(lambda a, b: a + b, [1], [2])\n",
        "from jax.experimental import PartitionSpec\n",
        "import jax\nx = jax.ops.index_update(jax.numpy.zeros(3), 0, 1.0)\n",
        "import jax.numpy as jnp\nninf = jnp.NINF\n",
        "from jax.experimental.pjit import with_sharding_constraint\n",
    ],
)
def test_check_fails_on_a_file_that_would_not_import_under_jax_0_12(tmp_path: Path, legacy: str, capsys):
    path = tmp_path / "old.py"
    path.write_text(legacy)
    with pytest.raises((AttributeError, ImportError)):  # the file itself fails under JAX 0.12
        exec(compile(legacy, str(path), "exec"), {})
    assert main(["migrate", str(path), "--check"]) == 1
    assert " MK0" in capsys.readouterr().out


def test_json_reports_an_immediately_called_pmap_once(tmp_path: Path, capsys):
    path = tmp_path / "doc.py"
    path.write_text(
        'import jax\ny = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")(jax.numpy.ones(8))\n'
    )
    assert main(["migrate", str(path), "--json"]) == 0
    (finding,) = json.loads(capsys.readouterr().out)["findings"]
    assert finding["rule"] == "MK015" and finding["fixable"] and (finding["line"], finding["col"]) == (2, 5)
    assert main(["migrate", str(path), "--fix", "--check"]) == 0
    assert path.read_text().splitlines()[-2:] == [
        'mesh = jax.sharding.Mesh(jax.devices()[:8], ("i",))',
        'y = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "i"), mesh=mesh, in_specs=P("i"), '
        'out_specs=P("i")))(jax.numpy.ones(8))',
    ]


def meshkit_in_child(args: list[str], cwd: Path, prelude: str = "") -> subprocess.CompletedProcess:
    """``meshkit ARGS`` in a fresh process (a crash there cannot take pytest down), after ``prelude``."""
    code = f"import sys\n{prelude}\nfrom meshkit.cli import main\nsys.exit(main({args!r}))\n"
    # the child imports meshkit and libcst: seconds, beside other CPU-heavy jobs (tests/_limits.py)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=limit(3), check=False
    )


def test_fix_keeps_crlf_line_endings_and_the_byte_order_mark(tmp_path: Path, capsys):
    path = tmp_path / "win.py"
    legacy = "import jax\r\nf = jax.pmap(lambda x: x * 2)  # doubled\r\nk = jax.random.PRNGKey(0)\r\n"
    path.write_bytes(codecs.BOM_UTF8 + legacy.encode())
    assert main(["migrate", str(path), "--fix", "--check"]) == 0
    data = path.read_bytes()
    assert data.startswith(codecs.BOM_UTF8) and data.count(b"\n") == data.count(b"\r\n") > 20
    text = data.decode("utf-8-sig").replace("\r\n", "\n")
    assert "jax.random.key(0)" in text and text == fix_source(legacy.replace("\r\n", "\n"))
    assert main(["migrate", str(path), "--fix"]) == 0 and path.read_bytes() == data


def test_fix_writes_through_a_link_and_keeps_the_mode(tmp_path: Path, capsys):
    real = tmp_path / "real.py"
    real.write_text("import jax\nk = jax.random.PRNGKey(1)\n")
    real.chmod(0o751)
    (tmp_path / "link.py").symlink_to(real)
    assert main(["migrate", str(tmp_path / "link.py"), "--fix"]) == 0
    assert (tmp_path / "link.py").is_symlink() and "jax.random.key(1)" in real.read_text()
    assert stat.S_IMODE(real.stat().st_mode) == 0o751 and sorted(p.name for p in tmp_path.iterdir()) == [
        "link.py",
        "real.py",
    ]


def test_a_full_disk_leaves_the_file_whole_with_one_line_and_exit_1(tmp_path: Path):
    """The file-size limit makes every write past 8 KiB fail as a full disk would (EFBIG for ENOSPC)."""
    lines = [
        f"k{i} = jax.random.PRNGKey({i})  # one key per line, to make the file long\n" for i in range(200)
    ]
    original = ("import jax\nf = jax.pmap(lambda x: x * 2)\n" + "".join(lines)).encode()
    assert len(original) > 8192
    (tmp_path / "big.py").write_bytes(original)
    limit = "import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    limit += "resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))"
    done = meshkit_in_child(["migrate", "--fix", "big.py"], tmp_path, prelude=limit)
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.splitlines()
    assert line == "error: cannot write big.py: File too large; the file is left unchanged"
    assert (tmp_path / "big.py").read_bytes() == original
    assert [p.name for p in tmp_path.iterdir()] == ["big.py"]  # no temporary file left behind


def test_a_file_changed_since_it_was_read_is_not_overwritten(tmp_path: Path):
    path = tmp_path / "old.py"
    path.write_text("import jax\nk = jax.random.PRNGKey(1)\n")
    result = migrate_file(path)
    path.write_text("import jax\nk = jax.random.PRNGKey(2)  # edited meanwhile\n")
    with pytest.raises(MigrateWriteError, match="changed since it was read"):
        write(result)
    assert path.read_text() == "import jax\nk = jax.random.PRNGKey(2)  # edited meanwhile\n"


def test_files_nested_too_deeply_for_the_parser_are_one_line_each_never_a_crash(tmp_path: Path):
    """2,000 parentheses Python itself refuses; 50,000 ``and``s and 5,000 subscripts it reads, but libcst's
    parser overflows the C stack on the first (segfault) and runs for minutes on the second."""
    (tmp_path / "parens.py").write_text("x = " + "(" * 2000 + "1" + ")" * 2000 + "\n")
    (tmp_path / "chain.py").write_text("x = " + " and ".join(["a"] * 50_000) + "\n")
    (tmp_path / "subs.py").write_text("x = a" + "[0]" * 5000 + "\n")
    (tmp_path / "fine.py").write_text("import jax\nk = jax.random.PRNGKey(0)\n")
    done = meshkit_in_child(["migrate", "--fix", "."], tmp_path)
    assert done.returncode == 1, done.stderr[-2000:]
    found = [line for line in done.stdout.splitlines() if LINE.match(line)]
    assert found == [
        "chain.py:1:1 MK000 file too deeply nested for the parser (depth 50004 > 200): left unchanged "
        "(fix: by hand: split the deepest expression (nesting depth at most 200), then run migrate again)",
        "parens.py:1:205 MK000 cannot parse: too many nested parentheses "
        "(fix: by hand: make the file valid Python, then run migrate again)",
        "subs.py:1:1 MK000 file too deeply nested for the parser (depth 5004 > 200): left unchanged "
        "(fix: by hand: split the deepest expression (nesting depth at most 200), then run migrate again)",
    ]
    assert "jax.random.key(0)" in (tmp_path / "fine.py").read_text()


@pytest.mark.parametrize(
    ("args", "error"),
    [(["nope.py"], "no such file or directory"), ([], "no paths given"), (["--bogus"], "No such option")],
)
def test_json_on_bad_input_is_one_json_object_and_exit_2(tmp_path: Path, capsys, args, error):
    args = [a if a.startswith("-") else str(tmp_path / a) for a in args]
    assert main(["migrate", "--json", *args]) == 2
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # one JSON document: a second object would not parse
    assert list(report) == ["error"] and error in report["error"] and captured.err == ""
