"""The loss plot's unit comes from the data (issue 35): nats per token for BPE token shards and bare
ids, nats per character for text read per character; ``Corpus.loss_unit`` owns it and the plot, like
the held-out line ``meshkit train`` prints, asks it (the plot said nats/char for every run)."""

import matplotlib.pyplot as plt
import numpy as np
import pytest

from meshkit.data import load
from meshkit.data.prepare import prepare
from meshkit.data.text import default_documents
from meshkit.train import plots


def _ylabel(tmp_path, unit, monkeypatch):
    """The y label of the figure ``loss_plot`` draws in ``unit``."""
    seen = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (seen.append(fig.axes[0].get_ylabel()), close(fig)))
    history = [{"step": s, "loss": 5.0 - 0.1 * s} for s in range(1, 5)]
    plots.loss_plot(history, [{"step": 4, "eval_loss": 4.7}], tmp_path / "loss.png", unit)
    assert (tmp_path / "loss.png").stat().st_size > 0
    return seen[0]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    for i, t in enumerate([t for t in default_documents() if 1000 < len(t) < 6000][:4]):
        (root / "text").mkdir(exist_ok=True)
        (root / "text" / f"{i}.txt").write_text(t, encoding="utf-8")
    prepare([str(root / "text")], root / "data", vocab_size=300, shard_tokens=4000)
    return root / "data"


def test_token_shards_plot_nats_per_token(shards, tmp_path, monkeypatch):
    data = load(str(shards))
    assert data.tokenizer == "BPE" and data.loss_unit == "nats/token"
    assert _ylabel(tmp_path, data.loss_unit, monkeypatch) == "cross-entropy (nats/token)"


def test_characters_plot_nats_per_char_and_ids_per_token(tmp_path, monkeypatch):
    text = load(None)
    assert text.tokenizer == "characters" and text.loss_unit == "nats/char"
    assert _ylabel(tmp_path, text.loss_unit, monkeypatch) == "cross-entropy (nats/char)"
    np.save(tmp_path / "ids.npy", np.arange(5000, dtype=np.int32) % 97)
    assert load(str(tmp_path / "ids.npy")).loss_unit == "nats/token"
