"""Token data end to end, with real processes (issue 25): prepare -> train -> SIGKILL mid-run -> --resume
gives bitwise the losses of the uninterrupted run, and resumed by 2 processes the same to float32
rounding; and a corpus larger
than the memory the process may map trains."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _limits import limit
from meshkit.cli import main
from meshkit.data import shards as S
from meshkit.data.prepare import prepare
from meshkit.data.text import default_documents
from meshkit.train.checkpoint import held

EXE = str(Path(sys.executable).parent / "meshkit")
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
# A run too long to finish (so the kill lands mid-run); the loss still moves (no warmup).
RUN = ["--preset", "tiny", "--steps", "100000", "--warmup", "0", "--checkpoint-every", "2", "--eval-every", "0",
       "--sample-chars", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    for i, t in enumerate(default_documents()[:20]):
        (root / "text" / f"{i:02d}.txt").parent.mkdir(exist_ok=True)
        (root / "text" / f"{i:02d}.txt").write_text(t, encoding="utf-8")
    prepare([str(root / "text")], root / "data", vocab_size=300)
    return root / "data"


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


# The same run as a config file, with one option from --set and one flag.
TOML = 'preset = "tiny"\n[run]\nsteps = 100000\neval_every = 0\nsample_chars = 0\n[optimizer]\nwarmup = 0\n'


def _kill_mid_run(data: Path, run: Path) -> None:
    """Train in a process of its own (options from a config file) and SIGKILL it once it has passed a
    checkpoint."""
    (run.parent / "run.toml").write_text(TOML)
    cmd = [EXE, "train", "--config", str(run.parent / "run.toml"), "--set", "run.checkpoint_every=2", "--data",
           str(data), "--run-dir", str(run)]  # fmt: skip
    log = (run.parent / "killed.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV)
    wait = limit(20)  # the run's start: its compiles, on a busy 2-core machine
    deadline = time.monotonic() + wait
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, (run.parent / "killed.log").read_text()[-2000:]
            if (
                (run / "metrics.jsonl").is_file()
                and max(losses(run), default=0) >= 3
                and held(run / "checkpoints")
            ):
                break  # past step 3, and a checkpoint complete (saves run in the background)
            time.sleep(0.02)
        else:
            pytest.fail(f"the run did not reach step 3 in {wait:.0f} s")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        log.close()


# Tiers: sweeps (issue 25's paths together, each core on its own): a SIGKILLed meshkit train resumed to the
# same losses in test_async_save.py's test_sigkill_during_a_background_save_..., token shards' stream state
# through a checkpoint and meshkit train --resume, bit for bit, in test_data_mixture.py's
# test_a_mixture_run_stopped_and_resumed_trains_as_an_uninterrupted_one, that state restored on 2 processes
# to the same batches in test_data_tokens.py's test_resume_is_exact_with_another_process_count, meshkit train
# as a job of 2 processes under meshkit launch in test_signals.py's
# test_a_local_job_listens_on_loopback_only_and_a_stalled_rank_ends_it_in_one_line (such a job resuming
# through meshkit launch sweeps: test_faults.py's test_two_processes_agree_on_the_step_when_only_one_..._latest),
# a config file with --set resolved as its flags in test_config_file.py's test_the_file_then_set_then_flags.
@pytest.mark.sweep
def test_sigkill_then_resume_gives_the_same_losses_also_on_two_processes(data, tmp_path, capsys):
    killed = tmp_path / "killed"
    _kill_mid_run(data, killed)
    saved = sorted(int(p.name) for p in (killed / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and max(losses(killed)) < 100000  # killed mid-run, after a checkpoint
    stop = saved[-1] + 3  # three steps past the checkpoint it resumes from
    shutil.copytree(killed, tmp_path / "killed2", symlinks=True)

    assert (
        main(
            [
                "train",
                *RUN,
                "--data",
                str(data),
                "--run-dir",
                str(tmp_path / "straight"),
                "--stop-after",
                str(stop),
            ]
        )
        == 0
    )
    assert main(["train", "--resume", "--run-dir", str(killed), "--stop-after", str(stop)]) == 0
    assert f"resuming at step {saved[-1]}" in capsys.readouterr().out
    straight = losses(tmp_path / "straight")
    assert sorted(straight) == list(range(1, stop + 1))
    assert losses(killed) == straight  # bitwise: the same batches, the same steps
    configs = [json.loads((d / "config.json").read_text()) for d in (killed, tmp_path / "straight")]
    for c in configs:
        c["run"]["run_dir"] = ""
    assert configs[0] == configs[1]  # the file resolved as flags

    two = [EXE, "launch", "-n", "2", "--devices-per-process", "4", "--", EXE, "train", "--resume", "--run-dir",
           str(tmp_path / "killed2"), "--stop-after", str(stop)]  # fmt: skip
    proc = subprocess.run(two, capture_output=True, text=True, env=ENV, timeout=limit(20))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resuming at step {saved[-1]}" in proc.stdout
    # 1 process, then 2: the same batches (bitwise: test_data_tokens.py draws them through the state the
    # checkpoint holds) and the same losses to float32 rounding (gloo sums the 2 processes in another
    # order; a batch of other tokens moves the loss by 1e-2, not 1e-7)
    two_losses = losses(tmp_path / "killed2")
    assert sorted(two_losses) == sorted(straight)
    assert all(two_losses[k] == straight[k] for k in straight if k <= saved[-1])
    assert all(two_losses[k] == pytest.approx(straight[k], rel=1e-6, abs=0) for k in straight)


def test_a_corpus_larger_than_the_process_may_map_trains(data, tmp_path, monkeypatch):
    """8 GiB of token shard (sparse on disk) under an address-space limit of 2 GiB: JAX itself maps
    about 1.3 GiB, so any design that mapped or loaded the corpus could not start."""
    big = tmp_path / "big"
    big.mkdir()
    shutil.copy(data / S.TOKENIZER, big / S.TOKENIZER)
    manifest = json.loads((data / S.MANIFEST).read_text())
    tokens = 4 << 30
    with (big / "shard-00000.bin").open("wb") as f:
        f.truncate(2 * tokens)  # uint16 ids: zeros, the end-of-text id
        f.seek(0)
        f.write((data / "shard-00000.bin").read_bytes())  # real text at the start
    # hashing 8 GiB would cost this test 10 s of CPU: it is stamped as verified instead (shards.verify)
    shards = [{"file": "shard-00000.bin", "tokens": tokens, "bytes": 2 * tokens, "sha256": "0" * 64}]
    manifest |= {"tokens": tokens, "shards": shards}
    (big / S.MANIFEST).write_text(json.dumps(manifest))
    cache = {S.CACHE_ENV: str(tmp_path / "cache")}
    monkeypatch.setenv(S.CACHE_ENV, cache[S.CACHE_ENV])
    S.stamp_prepared(big, S.listed(big, shards, dtype="<u2", below=manifest["vocab_size"], what="token"))

    address_space = 2 << 30
    assert (big / "shard-00000.bin").stat().st_size > 3 * address_space

    run = tmp_path / "run"
    # the limit is set in the child, which then becomes meshkit (a preexec_fn would fork this JAX process)
    capped = f"import os, resource; resource.setrlimit(resource.RLIMIT_AS, ({address_space}, {address_space})); os.execv({EXE!r}, {[EXE]!r} + __import__('sys').argv[1:])"
    cmd = [sys.executable, "-c", capped, "train", "--preset", "tiny", "--steps", "4", "--stop-after", "3",
           "--data", str(big), "--run-dir", str(run)]  # fmt: skip
    env = {
        **ENV,
        **cache,
        "MALLOC_ARENA_MAX": "2",
    }  # glibc reserves 64 MiB of address space per arena otherwise
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=limit(5))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(BPE token shards) (4,294,967,296 tokens, vocab 300)" in proc.stdout
    assert sorted(losses(run)) == [1, 2, 3]
