"""The suite's two tiers by a recorded run: core CPU, sweep CPU and the ten costliest core tests.

    python scripts/suite_tiers.py RECORD

RECORD: the lines a run with MESHKIT_TEST_CPU=RECORD wrote (tests/conftest.py): node id, children CPU s,
wall s, own CPU s, ...; a test's CPU is children + own. The tiers are pytest's own collection
(`-m "not sweep and not reference"` and `-m sweep`); tests not in the record are listed by name."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def collected(marks: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marks],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return [line.strip() for line in out.splitlines() if "::" in line and not line.startswith(" ")]


def cpu_seconds(record: Path) -> dict[str, float]:
    seconds = {}
    for line in record.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) >= 4:
            seconds[fields[0]] = float(fields[1]) + float(fields[3])
    return seconds


def main(record: str) -> None:
    seconds = cpu_seconds(Path(record))
    tiers = {"core": collected("not sweep and not reference"), "sweep": collected("sweep")}
    for name, ids in tiers.items():
        known = [i for i in ids if i in seconds]
        print(
            f"{name}: {len(ids)} tests, {sum(seconds[i] for i in known):,.0f} CPU s "
            f"({len(ids) - len(known)} not in the record)"
        )
    print("ten costliest core tests (CPU s):")
    for i in sorted(tiers["core"], key=lambda i: -seconds.get(i, 0))[:10]:
        print(f"  {seconds.get(i, 0):6.1f}  {i}")
    unknown = sorted(i for ids in tiers.values() for i in ids if i not in seconds)
    print(f"not in the record ({len(unknown)}; new or renamed):")
    for i in unknown:
        print(f"  {i}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/cpu_run3.txt")
