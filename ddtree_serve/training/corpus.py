"""The training corpus: the Python standard library of the running interpreter.

Every machine that runs this project has it, so the bundled pair can be retrained anywhere
without a download. Files are listed in sorted relative-path order and split into train and
held-out by a hash of the relative path, so the split of a file never depends on which other
files exist (a 3.12 stdlib and a 3.11 stdlib agree on every file they share).
"""

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIR_NAMES = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
HELDOUT_PER_MILLE = 30  # ~3% of files are held out


@dataclass(frozen=True)
class SourceFile:
    """One corpus document: its path relative to the stdlib root and its text."""

    rel_path: str
    text: str


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str) -> bool:
    """Whether a file belongs to the held-out split (a stable hash of its relative path)."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < HELDOUT_PER_MILLE


def list_source_paths(root: Path | None = None) -> list[str]:
    """Relative posix paths of the corpus .py files under `root`, sorted."""
    root = stdlib_root() if root is None else root
    rel_paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIR_NAMES for part in rel.parts[:-1]):
            continue
        if path.is_file():
            rel_paths.append(rel.as_posix())
    return sorted(rel_paths)


def load_corpus(
    root: Path | None = None, max_files: int | None = None
) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, heldout) documents; `max_files` keeps the first files of each split (smoke runs)."""
    root = stdlib_root() if root is None else root
    train: list[SourceFile] = []
    heldout: list[SourceFile] = []
    for rel_path in list_source_paths(root):
        split = heldout if is_heldout(rel_path) else train
        if max_files is not None and len(split) >= max_files:
            continue
        # A few stdlib files are not UTF-8; byte-level BPE does not care, replacement is enough.
        text = (root / rel_path).read_bytes().decode("utf-8", errors="replace")
        if text.strip():
            split.append(SourceFile(rel_path, text))
    return train, heldout
