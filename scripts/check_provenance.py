#!/usr/bin/env python3
"""Fails if a tracked file of this repository is a byte-for-byte copy of a file from another
project's repository, as collected in ../shared/fixtures (Modalities' data, tokenizers and
configs; see README "Provenance"). Compares SHA-256 digests of every tracked file (`git ls-files`,
or the source tree without build folders when there is no .git) with every file under the
fixtures folder; empty files are ignored.

    python3 scripts/check_provenance.py [--shared DIR]

Exit status: 0 no copy found, 1 copies found (each named), 77 the fixtures folder is absent
(CTest reports the test as skipped). Standard library only.
"""
import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".deps", ".carry", "out"}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tracked_files() -> list[Path]:
    if (ROOT / ".git").exists():
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True, capture_output=True).stdout
        return [ROOT / p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith("build")]
        files.extend(Path(dirpath) / f for f in filenames)
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", type=Path, default=Path(os.environ.get("MODALITIES_SHARED_DIR", ROOT.parent / "shared")),
                    help="folder holding fixtures/ (default: $MODALITIES_SHARED_DIR or ../shared beside the checkout)")
    args = ap.parse_args()
    fixtures = args.shared / "fixtures"
    if not fixtures.is_dir():
        print(f"skipped: {fixtures} is absent (present in CI), so there is nothing to compare with")
        return 77
    foreign = {}
    for f in sorted(fixtures.rglob("*")):
        if f.is_file() and f.stat().st_size > 0:
            foreign.setdefault(sha256(f), f)
    copies, checked = [], 0
    for f in tracked_files():
        if not f.is_file() or f.is_symlink() or f.stat().st_size == 0:
            continue
        checked += 1
        twin = foreign.get(sha256(f))
        if twin is not None:
            copies.append((f.relative_to(ROOT), twin))
    for ours, theirs in copies:
        print(f"{ours}: byte-for-byte copy of {theirs} (files from other projects' repositories must not be "
              "committed; read them from ../shared/fixtures in tests)", file=sys.stderr)
    print(f"checked {checked} tracked files against {len(foreign)} files under {fixtures}: "
          f"{len(copies)} cop{'y' if len(copies) == 1 else 'ies'}")
    return 1 if copies else 0


if __name__ == "__main__":
    sys.exit(main())
