"""Sizes the machine cannot hold (issue 22): one line and exit 2 from ``meshkit train`` before
anything is allocated, compiled or written, instead of a native crash.

Before: ``--width 1000000`` printed an out-of-memory error and exited 139; ``--devices 100000``
exited 139; a ``.npy`` whose ids reach 1e6 made a 64 M-parameter embedding (exit 134 where memory is
short, else minutes of a useless run); ``--seq-len 200000`` was a raw RESOURCE_EXHAUSTED. The sizes
here are beyond any machine the suite runs on (terabytes per device), so no test depends on it.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from meshkit.cli import main


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--width", "1000000"], r"this run needs about [\d,.]+ GiB per device \(parameters"),
        (["--devices", "100000"], r"--devices 100000: simulating a CPU device takes about 4 MiB .*use --devices \d+ or fewer"),
        (["--data", "{ids}"], r"token ids in '.*ids.npy' reach 999,999: a vocabulary of 1,000,000 .* 2,000 tokens using 3 distinct ids: renumber"),
        (["--seq-len", "200000", "--data", "{long}"], r"needs about [\d,.]+ [GT]iB per device \(activations .* --remat layer"),
    ],
)  # fmt: skip
def test_a_size_the_machine_cannot_hold_is_one_line_before_anything_runs(tmp_path, capsys, args, message):
    ids = np.tile(np.array([0, 1, 999_999], np.int32), 667)[:2000]
    np.save(tmp_path / "ids.npy", ids)
    (tmp_path / "long.txt").write_text("abcdefgh" * 275_000)  # 2.2 M characters: 220 k held out
    args = [a.format(ids=tmp_path / "ids.npy", long=tmp_path / "long.txt") for a in args]
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--run-dir", str(run), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not run.exists()


def test_a_tokenizer_vocabulary_larger_than_the_data_is_one_line_before_anything_runs(tmp_path, capsys):
    # before: a prepared directory whose tokenizer.json has 200,000 ids (a published tokenizer on a
    # small text) trained a 200k-row embedding of which 9 rows ever see a token; the .npy check
    # only looked at token ids
    from tokenizers import Tokenizer, models, pre_tokenizers

    from meshkit.data.prepare import prepare

    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    vocab.update({f"w{i}": len(vocab) + i for i in range(200_000 - len(vocab))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text(" ".join(words[i % 8] for i in range(3000)))
    prepare([str(tmp_path / "text")], tmp_path / "data", tokenizer=str(tmp_path / "tokenizer.json"))
    run = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--run-dir", str(run), "--data", str(tmp_path / "data")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(
        r"the tokenizer of .*data \(BPE token shards\) has a vocabulary of 200,000 \(.* embedding parameters at "
        r"--width \d+\) for 3,001 tokens using 9 distinct ids: .*meshkit data prepare without --tokenizer",
        err,
    ), err
    assert not run.exists()
