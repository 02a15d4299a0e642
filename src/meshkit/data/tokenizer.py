"""The BPE tokenizer of token data: Hugging Face ``tokenizers``, byte level, with an end-of-text token.

``train_bpe`` learns one from texts; ``load_tokenizer`` reads an existing ``tokenizer.json``. The one
saved beside the shards (``tokenizer.json``) is what every later command encodes and decodes with.
Byte level means every text round-trips exactly (``decode(encode(t)) == t``), and each id stands for a
fixed string of bytes, which gives bits per byte (:meth:`Tokenizer.token_bytes`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from meshkit.data.source import DataError
from meshkit.files import regular

EOT = "<|endoftext|>"
"""The end-of-text token that separates documents in the shards."""
MIN_VOCAB = 257
"""The 256 byte symbols and the end-of-text token."""
MAX_VOCAB = 1 << 24
"""The largest BPE trained here: 16.8 M ids, 64 times the largest published vocabularies (``tokenizers``
aborts the process, in Rust, on sizes near 2**31)."""


def check_vocab_size(vocab_size: int) -> None:
    """A BPE of ``vocab_size`` ids can be trained here (``train_bpe``; ``meshkit data prepare`` asks before
    it reads an input); one line naming the fix if not."""
    if vocab_size < MIN_VOCAB:
        raise DataError(
            f"--vocab-size {vocab_size} is below {MIN_VOCAB} (256 bytes and {EOT}): give a larger one"
        )
    if vocab_size > MAX_VOCAB:
        raise DataError(
            f"--vocab-size {vocab_size:,} is above {MAX_VOCAB:,} (2**24, 64 times the largest published "
            "vocabularies): give a smaller one"
        )


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with its end-of-text token (``eos``, which closes every document in the
    shards), its beginning-of-text token where it has one (``bos``), and the ids its post-processor puts
    around a document (``prefix``: a BOS where the tokenizer prepends one). It encodes special tokens'
    text as plain text (a document that contains ``<|endoftext|>`` keeps it as characters, not as a
    boundary)."""

    def __init__(self, tok, source: str, *, eos: str = EOT, bos: str | None = None) -> None:
        self._tok, self.source = tok, source
        self.vocab_size: int = tok.get_vocab_size()
        self.eos: tuple[str, int] = (eos, self._id(eos, "end-of-text", "--eos-token"))
        self.bos: tuple[str, int] | None = (
            None if bos is None else (bos, self._id(bos, "beginning-of-text", "--bos-token"))
        )
        self.eot_id: int = self.eos[1]
        self.prefix, suffix = _frame(tok)
        self.suffix = suffix if suffix[-1:] == (self.eot_id,) else (*suffix, self.eot_id)
        """The ids that close a document: the post-processor's, then the end-of-text id (once)."""
        tok.encode_special_tokens = True

    def _id(self, token: str, what: str, flag: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None or i >= self.vocab_size:
            special = sorted(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)
            some = ", ".join(special[:6]) + (", ..." if len(special) > 6 else "") if special else "none"
            raise DataError(
                f"tokenizer {self.source} has no {token} token: name its {what} token with {flag} "
                f"(its special tokens: {some}), or let meshkit data prepare train one (leave out --tokenizer)"
            )
        return i

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_offsets(self, text: str, *, special: bool) -> tuple[np.ndarray, np.ndarray]:
        """``text``'s ids (no BOS or EOS added) and each id's ``[start, end)`` characters in ``text``;
        ``special``: a special token's text is that token (as transformers' ``encode`` reads the text a
        chat template writes), else plain text (as documents are encoded)."""
        tok = self._special_tok if special else self._tok
        e = tok.encode(text, add_special_tokens=False)
        return np.asarray(e.ids, np.int32), np.asarray(e.offsets, np.int64).reshape(-1, 2)

    def encode_offsets_batch(
        self, texts: Sequence[str], *, special: bool
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`encode_offsets` of each text, on the library's own threads."""
        tok = self._special_tok if special else self._tok
        return [
            (np.asarray(e.ids, np.int32), np.asarray(e.offsets, np.int64).reshape(-1, 2))
            for e in tok.encode_batch(list(texts), add_special_tokens=False)
        ]

    @functools.cached_property
    def _special_tok(self):
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = False
        return tok

    def encode_batch(self, texts: Sequence[str], continued: Sequence[bool] | None = None) -> list[np.ndarray]:
        """Encode ``texts`` in parallel (the library's own threads). ``continued[i]``: text ``i`` goes on
        a document after a newline (a piece of it), so a tokenizer that puts a space before a text's first
        word (SentencePiece's ``▁``) must not put one there: it is encoded after that newline, whose ids
        are then dropped."""
        cont = [bool(c) and self._prefix_space for c in continued or [False] * len(texts)]
        nl = self._newline
        batch = ["\n" + t if c else t for t, c in zip(texts, cont, strict=True)]
        out = []
        for e, c in zip(
            self._tok.encode_batch_fast(batch, add_special_tokens=False), cont, strict=True
        ):  # no offsets: 2x
            ids = e.ids[len(nl) :] if c and e.ids[: len(nl)] == nl else e.ids
            out.append(np.asarray(ids, np.int32))
        return out

    @functools.cached_property
    def _newline(self) -> list[int]:
        return self._tok.encode("\n", add_special_tokens=False).ids

    @functools.cached_property
    def _prefix_space(self) -> bool:
        """Whether the tokenizer puts a space before a text's first word (``a`` twice decodes as ``a a``)."""
        a = self._tok.encode("a", add_special_tokens=False).ids
        return self._tok.decode(a + a, skip_special_tokens=False) != "aa"

    def decode(self, ids) -> str:
        return self._tok.decode(np.asarray(ids).reshape(-1).tolist(), skip_special_tokens=False)

    def vocabulary(self) -> dict[str, int]:
        """Every token's string and id (two tokenizers with the same one encode alike)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def to_str(self) -> str:
        return self._tok.to_str()

    def added_tokens(self) -> list[tuple[str, bool]]:
        """Each added token's text and whether it is special, in id order."""
        decoder = self._tok.get_added_tokens_decoder()
        return [(decoder[i].content, bool(decoder[i].special)) for i in sorted(decoder)]

    def special(self, i: int) -> str | None:
        """The string of id ``i`` if it is one of the tokenizer's special tokens, else None."""
        token = self._tok.get_added_tokens_decoder().get(i)
        return token.content if token is not None and token.special else None

    @functools.cached_property
    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each id stands for (0 for special tokens), as int64 of length ``vocab_size``: a
        byte-level symbol is one byte, a byte-fallback ``<0xNN>`` token one, any other token what it adds
        decoded after an ordinary one (so that a SentencePiece ``▁`` counts its space, which a decoder
        strips from a text's start)."""
        from tokenizers import decoders

        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        counts = np.zeros(self.vocab_size, np.int64)
        byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        table = _byte_level_table() if byte_level else frozenset()
        byte_fallback = bool(getattr(self._tok.model, "byte_fallback", False))
        rest: list[int] = []
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if token in special or i >= self.vocab_size:
                continue
            if byte_level and all(c in table for c in token):
                counts[i] = len(token)  # each symbol is one byte
            elif byte_fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                counts[i] = 1
            else:
                rest.append(i)
        anchor = self._tok.encode("a", add_special_tokens=False).ids
        base = len(self._tok.decode(anchor, skip_special_tokens=False).encode("utf-8"))
        texts = self._tok.decode_batch([[*anchor, i] for i in rest], skip_special_tokens=False)
        counts[rest] = [len(t.encode("utf-8")) - base for t in texts]
        return counts


def _frame(tok) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids the tokenizer's post-processor adds before and after a text (encoding with special
    tokens, as transformers does by default)."""
    probe = "a"
    bare = tok.encode(probe, add_special_tokens=False).ids
    full = tok.encode(probe, add_special_tokens=True).ids
    for at in range(len(full) - len(bare) + 1):
        if full[at : at + len(bare)] == bare:
            return tuple(full[:at]), tuple(full[at + len(bare) :])
    return (), ()  # a post-processor that rewrites the text's own ids: none that meshkit knows


@functools.cache
def _byte_level_table() -> frozenset[str]:
    from tokenizers import pre_tokenizers

    return frozenset(pre_tokenizers.ByteLevel.alphabet())


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with ``vocab_size`` ids (``EOT`` is id 0) learnt from ``texts``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return Tokenizer(tok, "trained by meshkit data prepare")


def load_tokenizer(path: str | Path, *, eos: str | None = None, bos: str | None = None) -> Tokenizer:
    """A ``tokenizer.json`` saved by Hugging Face ``tokenizers`` (or a directory holding one), with the
    end-of-text and BOS tokens ``eos`` and ``bos`` (None: those its ``tokenizer_config.json`` /
    ``special_tokens_map.json`` name, else ``<|endoftext|>``), framed as transformers frames a document
    (:mod:`meshkit.data.tokenizer_config`); one line naming the fix if it is not one."""
    from tokenizers import Tokenizer as HFTokenizer

    from meshkit.data.tokenizer_config import read_config

    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not regular(path, fix="give a tokenizer.json saved by Hugging Face tokenizers", error=DataError):
        raise DataError(f"no tokenizer file '{path}': give a tokenizer.json saved by Hugging Face tokenizers")
    try:
        tok = HFTokenizer.from_str(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, Exception) as e:  # tokenizers raises a bare Exception
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DataError(
            f"'{path}' is not a tokenizer.json ({first}): give one saved by Hugging Face tokenizers "
            "(Tokenizer.save)"
        ) from None
    cfg = read_config(path.parent)
    eos = eos or cfg.eos_token or EOT
    bos = bos or cfg.bos_token
    if cfg.add_bos_token is not None:
        _rebuild_post_processor(tok, eos, bos, cfg.add_bos_token, bool(cfg.add_eos_token), f"'{path.parent}'")
    return Tokenizer(tok, f"'{path}'", eos=eos, bos=bos)


def _rebuild_post_processor(tok, eos: str, bos: str | None, add_bos: bool, add_eos: bool, where: str) -> None:
    """The post-processor transformers' Llama/Gemma/GPT-NeoX tokenizers build from ``add_bos_token`` and
    ``add_eos_token`` (``update_post_processor``), in place of the tokenizer.json's own."""
    from tokenizers import processors

    if add_bos and bos is None:
        raise DataError(f"{where}: add_bos_token is true but no bos_token is named: give --bos-token")
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    special = [(t, tok.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    if any(i is None for _, i in special):
        return  # Tokenizer() names the missing token
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
