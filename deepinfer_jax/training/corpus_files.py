"""The source files of a text corpus: every ``.py`` file (optionally ``.rst``/``.txt``/``.md``)
under a list of roots, read as strict UTF-8, in a deterministic order.

Order and identity never depend on where the tree lies or how the file system lists it: a file
is named by its path relative to its root (POSIX form), and files are visited sorted by
``(root index, relative path)``. Exact duplicates (same bytes, e.g. vendored copies) keep the
first file in that order.

Skipped, and counted by reason: ``too_large`` (above ``max_file_bytes``), ``empty``,
``not_utf8`` (undecodable: binary test data, legacy encodings), ``duplicate``, ``unreadable``
(``OSError``, e.g. a dangling symlink). Directories pruned from the walk, counted under their
reason: ``__pycache__``; ``site-packages`` / ``dist-packages`` below a root (an interpreter's
stdlib holds its own site-packages, which is walked as its own root when asked for); any
directory that is itself another root (walked once, as that root)."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import sysconfig

CODE_EXTENSIONS = (".py",)
DOC_EXTENSIONS = (".rst", ".txt", ".md")
DEFAULT_MAX_FILE_BYTES = 1_000_000
PRUNED_DIRS = {"__pycache__": "pycache_dir", "site-packages": "site_packages_dir",
               "dist-packages": "site_packages_dir"}


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One kept file: ``relpath`` (POSIX, relative to ``roots[root_index]``), its text, its size."""

    root_index: int
    relpath: str
    text: str
    n_bytes: int


def default_roots() -> list[str]:
    """This interpreter's stdlib, then its purelib and platlib (existing, each once)."""
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"], paths["purelib"], paths["platlib"]]
    return unique_roots(r for r in roots if os.path.isdir(r))


def unique_roots(roots) -> list[str]:
    """Absolute real paths, first occurrence kept (purelib and platlib are often one directory)."""
    out: list[str] = []
    for r in roots:
        real = os.path.realpath(r)
        if real not in out:
            out.append(real)
    return out


def _candidates(roots: list[str], extensions: tuple[str, ...], skipped_dirs: collections.Counter):
    """``(root_index, relpath, abspath)`` of every file with one of ``extensions``, sorted."""
    root_set = set(roots)
    found = []
    for i, root in enumerate(roots):
        for dirpath, dirnames, filenames in os.walk(root):
            keep = []
            for d in dirnames:
                full = os.path.realpath(os.path.join(dirpath, d))
                if d in PRUNED_DIRS:
                    skipped_dirs[PRUNED_DIRS[d]] += 1
                elif full in root_set:
                    skipped_dirs["other_root_dir"] += 1
                else:
                    keep.append(d)
            dirnames[:] = keep
            for name in filenames:
                if name.endswith(extensions):
                    full = os.path.join(dirpath, name)
                    found.append((i, os.path.relpath(full, root).replace(os.sep, "/"), full))
    found.sort(key=lambda t: (t[0], t[1]))
    return found


def collect_files(roots, include_docs: bool = False, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                  progress: bool = False) -> tuple[list[SourceFile], dict[str, int], dict[str, int]]:
    """The kept files of ``roots`` in order, skipped files by reason, pruned directories by reason."""
    if max_file_bytes <= 0:
        raise ValueError(f"max_file_bytes={max_file_bytes}: must be > 0")
    roots = unique_roots(roots)
    for r in roots:
        if not os.path.isdir(r):
            raise ValueError(f"root {r!r} is not a directory")
    extensions = CODE_EXTENSIONS + (DOC_EXTENSIONS if include_docs else ())
    skipped: collections.Counter = collections.Counter()
    skipped_dirs: collections.Counter = collections.Counter()
    cands = _candidates(roots, extensions, skipped_dirs)
    if progress:
        from tqdm.auto import tqdm

        cands = tqdm(cands, unit="file", desc="read")
    seen: set[bytes] = set()
    kept: list[SourceFile] = []
    for root_index, relpath, full in cands:
        try:
            if os.stat(full).st_size > max_file_bytes:
                skipped["too_large"] += 1
                continue
            with open(full, "rb") as f:
                data = f.read()
        except OSError:
            skipped["unreadable"] += 1
            continue
        if len(data) > max_file_bytes:  # grew since the stat
            skipped["too_large"] += 1
            continue
        if not data:
            skipped["empty"] += 1
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        digest = hashlib.sha256(data).digest()
        if digest in seen:
            skipped["duplicate"] += 1
            continue
        seen.add(digest)
        kept.append(SourceFile(root_index, relpath, text, len(data)))
    return kept, dict(sorted(skipped.items())), dict(sorted(skipped_dirs.items()))
