"""Trim a Hugging Face BPE ``tokenizer.json`` to about ``N`` model ids, keeping it valid: the model's
ids below ``N`` and every one-character token of Latin-1 or ``▁`` (those above renumbered from ``N`` on, in order, so that a
SentencePiece ``▁`` survives), the merges whose two parts and result all survive, every added token
(those beyond renumbered after them, in order), and the post-processor's ids renumbered alike. Normalizer, pre-tokenizer, decoder and the configs beside it are kept as they are.

    python tests/corpus/tokenizers/trim.py FULL_DIR OUT_DIR 3000 [--drop-added]
"""

import json
import shutil
import sys
from pathlib import Path


def trim(src: Path, out: Path, n: int, drop_added: bool = False) -> None:
    """``drop_added``: leave out the added tokens at ids from ``n`` on that are not special."""
    tok = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    if drop_added:
        tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] < n or t["special"]]
    model = tok["model"]
    assert model["type"] == "BPE", model["type"]
    added_ids = {t["id"] for t in tok["added_tokens"]}
    one_char = lambda t: len(t) == 1 and (t == "\u2581" or ord(t) < 256)  # noqa: E731
    kept = sorted((i, t) for t, i in model["vocab"].items() if i < n or (one_char(t) and i not in added_ids))
    renumber, nxt = {}, n
    vocab = {}
    for i, t in kept:
        if i >= n:
            renumber[i], nxt = nxt, nxt + 1
        vocab[t] = renumber.get(i, i)
    for added in sorted(tok["added_tokens"], key=lambda t: t["id"]):
        if added["id"] >= n:
            if added["id"] not in renumber:
                renumber[added["id"]], nxt = nxt, nxt + 1
            added["id"] = renumber[added["id"]]
            if added["content"] in model["vocab"]:
                vocab[added["content"]] = added["id"]
    merges = []
    for m in model["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    model["vocab"], model["merges"] = vocab, merges
    post = tok.get("post_processor") or {}
    for proc in post.get("processors", [post]):
        for special in (proc.get("special_tokens") or {}).values():
            special["ids"] = [renumber.get(i, i) for i in special["ids"]]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False, indent=None), encoding="utf-8")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            cfg = json.loads((src / name).read_text(encoding="utf-8"))
            decoder = cfg.get("added_tokens_decoder")
            if isinstance(decoder, dict):
                cfg["added_tokens_decoder"] = {str(renumber[int(k)] if int(k) >= n else int(k)): v
                                               for k, v in decoder.items() if int(k) < n or int(k) in renumber}
            (out / name).write_text(json.dumps(cfg, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    shutil.copystat(src / "tokenizer.json", out / "tokenizer.json")


if __name__ == "__main__":
    trim(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), "--drop-added" in sys.argv[4:])
