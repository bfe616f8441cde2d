#!/usr/bin/env python3
"""Reads the event file(s) in DIR with the `tensorboard` package and checks that they hold exactly
the scalars listed in DIR/expected_scalars.tsv (tag, step, value per line; value as float32).

This is the independent check of our `results_subscriber/tensorboard` event files (the TFRecord
framing, CRCs and Event/Summary protocol buffers are written by hand in
plugins/subscribers/src/subscribers.cpp). The CTest test `check.tensorboard` writes DIR with the
subscribers test (MODALITIES_TENSORBOARD_CHECK_DIR) and runs this with the check environment
(scripts/setup_check_env.sh). Usage:

    .deps/check/bin/python scripts/check_tensorboard.py DIR
Exit status 0 when everything matches, 1 on a difference, 2 on an error.
"""
import argparse
import math
import struct
import sys
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    args = ap.parse_args()
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError:
        print("check_tensorboard.py: the tensorboard package is missing (pip install tensorboard, or "
              "scripts/setup_check_env.sh)", file=sys.stderr)
        return 2
    expected_file = args.dir / "expected_scalars.tsv"
    if not expected_file.is_file():
        print(f"check_tensorboard.py: {expected_file} is missing", file=sys.stderr)
        return 2
    expected = []
    for n, line in enumerate(expected_file.read_text(encoding="utf-8").splitlines(), 1):
        tag, step, value = line.split("\t")
        expected.append((tag, int(step), struct.unpack("f", struct.pack("f", float(value)))[0]))
    acc = event_accumulator.EventAccumulator(str(args.dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    got = []
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            got.append((tag, ev.step, ev.value))
    key = lambda x: (x[0], x[1])  # noqa: E731
    got.sort(key=key)
    expected.sort(key=key)
    problems = 0
    if [key(g) for g in got] != [key(e) for e in expected]:
        print(f"tags/steps differ:\n  expected {[key(e) for e in expected]}\n  read     {[key(g) for g in got]}")
        problems += 1
    else:
        for (tag, step, want), (_, _, have) in zip(expected, got):
            same = (math.isnan(want) and math.isnan(have)) or want == have
            if not same:
                print(f"  {tag} step {step}: expected {want!r}, tensorboard read {have!r}")
                problems += 1
    if problems:
        print(f"FAIL: {problems} difference(s)")
        return 1
    print(f"OK: tensorboard read {len(got)} scalars in {len(set(g[0] for g in got))} tags, as written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
