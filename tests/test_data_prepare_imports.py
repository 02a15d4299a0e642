"""``meshkit data prepare`` starts without JAX and grain, which it never uses (issue 39: 1.3 s and
206 MiB of imports), and its batched encoding (``encode_batch_fast``: no offsets) gives the ids of
encoding each text alone."""

import subprocess
import sys

from _limits import limit
from meshkit.data.text import default_documents
from meshkit.data.tokenizer import train_bpe

_CHILD = """
import sys
from meshkit.cli import main
code = main(["data", "prepare", sys.argv[1], "--vocab-size", "300", "--out", sys.argv[2]])
print(code, sorted(m for m in ("jax", "jaxlib", "grain", "optax", "orbax") if m in sys.modules))
"""


def test_data_prepare_imports_neither_jax_nor_grain(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(default_documents()[:3]))
    done = subprocess.run([sys.executable, "-c", _CHILD, str(text), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=limit(1))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "0 []", done.stdout
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_batched_encoding_gives_each_texts_own_ids():
    docs = default_documents()[:20]
    bpe = train_bpe(docs[:5], 400)
    assert [ids.tolist() for ids in bpe.encode_batch(docs)] == [bpe.encode(d).tolist() for d in docs]
