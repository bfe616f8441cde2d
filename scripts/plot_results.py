#!/usr/bin/env python3
"""Plots a training run's results JSONL (results_subscriber/to_disc, `evaluation_results.jsonl`) as a PNG.

Each line of the file is one JSON object, as Modalities writes it:

  {"dataloader_tag": "train", "num_train_steps_done": 5,
   "losses": {"train loss avg": 10.38, "train loss last": 9.77},
   "metrics": {"consumed tokens": 2560, "grad norm avg": 2.38, "grad norm last": 2.96},
   "throughput_metrics": {"train samples/s": 24.4, "train mfu (16-bit)": -1.0, "lr mean": 0.0015,
                          "peak memory rank 0 (MB)": 738.3}}

Evaluation lines carry another tag (the eval dataloader's), their loss under the loss function's tag
and "evaluation_num_samples_per_second".

Panels (a panel without data is left out), x axis = num_train_steps_done:
  loss         every key of "losses", of every tag (train: lines; evaluation tags: lines with markers)
  learning rate  every metrics / throughput_metrics key starting with "lr" ("lr mean")
  throughput   every key with "samples/s" or "samples_per_second"
  MFU          every key with "mfu"; negative values (-1 = "unknown", no mfu_calculator) are left out
  grad norm    every key with "grad norm" / "grad_norm"
  peak memory  every key with "peak memory"
"consumed tokens" is not plotted (tokens per step is not a rate: the file has no wall-clock times).

Data handling: values that are lists (non-scalar tensors) or booleans are skipped; NaN / Infinity
values are left out of the curves (and counted in a note on stderr). A step logged more than once
for the same tag and key (a warm start appending to the same file, or overlapping runs) keeps the
value of the last line in the file; each curve is then drawn in step order. An incomplete last line
(no trailing newline: the run is still writing) is ignored with a note; any other line that is not
valid JSON is an error reported as FILE:LINE.

Several input files are overlaid, one colour per run, each run labelled by its parent folder name
(made unique with more path components where two runs share it).

The PNG is written atomically (temporary file in the output folder, then rename). Exit status:
0 written, 1 bad input or output, 2 bad command line. Needs matplotlib (pip install matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

PROG = "plot_results.py"

EPILOG = """\
examples:
  %(prog)s out/experiments/quickstart/evaluation_results.jsonl
      -> out/experiments/quickstart/evaluation_results.png
  %(prog)s out/experiments/quickstart/evaluation_results.jsonl \\
           out/experiments/quickstart_resumed/evaluation_results.jsonl -o /tmp/compare.png --log-y
      -> both runs overlaid, labelled "quickstart" and "quickstart_resumed"
"""

SECTIONS = ("losses", "metrics", "throughput_metrics")


class InputError(Exception):
    """A problem with an input or output file; printed as `plot_results.py: error: ...`, exit 1."""


# Panels in display order: (id, title, y label).
PANELS = (
    ("loss", "Loss", "loss"),
    ("lr", "Learning rate", "lr"),
    ("throughput", "Throughput", "samples / s"),
    ("mfu", "Model FLOPs utilization", "MFU"),
    ("grad_norm", "Gradient norm", "grad norm"),
    ("memory", "Peak memory", "MB"),
)


def panel_of(section: str, key: str) -> str | None:
    """The panel a (section, key) value belongs to, or None when it is not plotted."""
    k = key.lower()
    if section == "losses":
        return "loss"
    if k.startswith("lr"):
        return "lr"
    if "samples/s" in k or "samples_per_second" in k:
        return "throughput"
    if "mfu" in k:
        return "mfu"
    if "grad norm" in k or "grad_norm" in k:
        return "grad_norm"
    if "peak memory" in k:
        return "memory"
    return None


@dataclass
class Series:
    tag: str
    key: str
    points: dict[int, float] = field(default_factory=dict)  # step -> value; a later line replaces
    replaced: int = 0

    def label(self) -> str:
        # "train loss avg" already names its tag; an eval loss "CLMCrossEntropyLoss" does not.
        # Train keys without their tag ("lr mean", "grad norm avg") stay as they are.
        if self.tag == "train" or re.match(re.escape(self.tag) + r"(?![A-Za-z0-9])", self.key, re.IGNORECASE):
            return self.key
        return f"{self.tag}: {self.key}"

    def sorted_points(self) -> tuple[list[int], list[float]]:
        steps = sorted(self.points)
        return steps, [self.points[s] for s in steps]


@dataclass
class Run:
    path: Path
    label: str = ""
    lines: int = 0
    # panel -> (tag, key) -> Series, in first-seen order
    panels: dict[str, dict[tuple[str, str], Series]] = field(default_factory=dict)
    skipped_lists: int = 0
    skipped_nonfinite: int = 0
    skipped_negative_mfu: int = 0
    incomplete_last_line: bool = False

    def has_data(self) -> bool:
        return any(s.points for series in self.panels.values() for s in series.values())


def read_run(path: Path) -> Run:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot read '{path}': {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise InputError(f"'{path}' is not UTF-8 text ({e.reason} at byte {e.start})") from None

    run = Run(path=path)
    lines = text.split("\n")
    # text ending with "\n" gives a final "" element; otherwise the last element is unterminated.
    unterminated = lines[-1] if lines[-1] != "" else None
    if unterminated is None:
        lines.pop()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if unterminated is not None and lineno == len(lines):
                run.incomplete_last_line = True
                continue
            raise InputError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(record, dict):
            raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
        tag = record.get("dataloader_tag")
        if not isinstance(tag, str):
            raise InputError(f"{where}: missing or non-string \"dataloader_tag\"")
        step = record.get("num_train_steps_done")
        if isinstance(step, bool) or not isinstance(step, int):
            raise InputError(f"{where}: missing or non-integer \"num_train_steps_done\"")
        run.lines += 1
        for section in SECTIONS:
            values = record.get(section, {})
            if values is None:
                continue
            if not isinstance(values, dict):
                raise InputError(f"{where}: \"{section}\" must be an object, got {type(values).__name__}")
            for key, value in values.items():
                panel = panel_of(section, key)
                if panel is None:
                    continue
                if isinstance(value, list):
                    run.skipped_lists += 1
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                value = float(value)
                if not math.isfinite(value):
                    run.skipped_nonfinite += 1
                    continue
                if panel == "mfu" and value < 0:
                    run.skipped_negative_mfu += 1
                    continue
                series = run.panels.setdefault(panel, {}).setdefault((tag, key), Series(tag, key))
                if step in series.points:
                    series.replaced += 1
                    del series.points[step]
                series.points[step] = value
    return run


def assign_labels(runs: list[Run]) -> None:
    """Parent folder name; more trailing path components where that is not unique."""
    parts = [p.path.resolve().parent.parts for p in runs]
    depth = 1
    while True:
        labels = ["/".join(p[-depth:]) if p[-depth:] else "/" for p in parts]
        if len(set(labels)) == len(labels) or depth >= max(len(p) for p in parts):
            break
        depth += 1
    seen: dict[str, int] = {}
    for run, label in zip(runs, labels):
        seen[label] = seen.get(label, 0) + 1
        run.label = label if seen[label] == 1 else f"{label} #{seen[label]}"


def notes_for(run: Run) -> list[str]:
    notes = []
    name = f"{run.path}"
    if run.incomplete_last_line:
        notes.append(f"{name}: ignored the incomplete last line (run still writing?)")
    replaced = max((s.replaced for series in run.panels.values() for s in series.values()), default=0)
    if replaced:
        notes.append(f"{name}: {replaced} step(s) logged more than once (warm start?); kept the last value of each")
    if run.skipped_nonfinite:
        notes.append(f"{name}: left out {run.skipped_nonfinite} NaN/Infinity value(s)")
    if run.skipped_lists:
        notes.append(f"{name}: skipped {run.skipped_lists} list (non-scalar) value(s)")
    return notes


def import_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise InputError(
            f"matplotlib is not installed for {sys.executable}: pip install matplotlib "
            "(the bench venv has it: .deps/bench/bin/python)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    global PlainLogFormatter

    class PlainLogFormatter(ticker.LogFormatter):
        def __call__(self, x, pos=None):
            return f"{x:g}" if super().__call__(x, pos) else ""

    return plt, ticker


def fmt_value(v: float) -> str:
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.3e}"
    return f"{v:.4g}"


def render(runs: list[Run], title: str | None, log_y: bool):
    plt, ticker = import_pyplot()

    panels = [p for p in PANELS if any(s.points for r in runs for s in r.panels.get(p[0], {}).values())]
    ncols = 1 if len(panels) == 1 else 2
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7.0 * ncols, 3.9 * nrows + 0.9), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(panels):]:
        ax.set_visible(False)

    all_steps = [st for r in runs for series in r.panels.values() for s in series.values() for st in s.points]
    lo, hi = min(all_steps), max(all_steps)
    pad = max((hi - lo) * 0.02, 0.5)

    multi = len(runs) > 1
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    linestyles = ["-", "--", ":", "-."]
    eval_markers = ["o", "s", "^", "D", "v"]

    for ax, (pid, ptitle, ylabel) in zip(flat, panels):
        n_series = 0
        for ri, run in enumerate(runs):
            tags = []
            for si, series in enumerate(run.panels.get(pid, {}).values()):
                if not series.points:
                    continue
                if series.tag not in tags:
                    tags.append(series.tag)
                xs, ys = series.sorted_points()
                is_train = series.tag == "train"
                color = cycle[ri % len(cycle)] if multi else cycle[si % len(cycle)]
                style = linestyles[si % len(linestyles)] if multi else "-"
                if is_train:
                    marker = "." if len(xs) <= 40 else None
                else:
                    marker = eval_markers[tags.index(series.tag) % len(eval_markers)]
                label = series.label()
                if pid == "loss":
                    label += f" (last {fmt_value(ys[-1])} @ {xs[-1]})"
                if multi:
                    label = f"{run.label} · {label}"
                ax.plot(xs, ys, linestyle=style, marker=marker, markersize=4 if is_train else 5,
                        linewidth=1.6, color=color, label=label, alpha=0.95)
                n_series += 1
        ax.set_title(ptitle, fontsize=11, fontweight="bold")
        ax.set_xlabel("step (num_train_steps_done)")
        ax.set_ylabel(ylabel)
        ax.set_xlim(lo - pad, hi + pad)
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        ax.grid(True, which="major", alpha=0.3)
        if log_y and pid in ("loss", "grad_norm"):
            ax.set_yscale("log")
            # plain numbers (0.2, 3, 10) instead of 2x10^-1; matplotlib still picks which minor ticks get a label
            ax.yaxis.set_major_formatter(PlainLogFormatter())
            ax.yaxis.set_minor_formatter(PlainLogFormatter())
            ax.grid(True, which="minor", alpha=0.12)
        elif pid == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
        elif pid == "mfu":
            ax.yaxis.set_major_formatter(ticker.PercentFormatter(xmax=1.0))
        ax.legend(fontsize=8 if n_series <= 6 else 7, loc="best", framealpha=0.85)

    if title is None:
        if multi:
            title = " vs ".join(r.label for r in runs[:4]) + (f" (+{len(runs) - 4} more)" if len(runs) > 4 else "")
        else:
            title = runs[0].label
    fig.suptitle(title, fontsize=14, fontweight="bold")
    sources = [f"{r.label}: {r.path} ({r.lines} lines)" for r in runs]
    if len(sources) > 4:
        sources = sources[:3] + [f"... and {len(sources) - 3} more"]
    fig.text(0.01, 0.005, "\n".join(sources), fontsize=7, color="0.4", va="bottom", ha="left")
    footer = 0.012 + 0.014 * len(sources) / max(nrows, 1)
    fig.tight_layout(rect=(0, footer, 1, 0.97))
    return fig, plt, len(panels)


def write_png_atomically(fig, out: Path) -> None:
    directory = out.parent if str(out.parent) else Path(".")
    if not directory.is_dir():
        raise InputError(f"output folder '{directory}' does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=110)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, out)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise InputError(f"cannot write '{out}': {e.strerror or e}") from None
        raise


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Plot loss, learning rate, throughput, MFU, grad norm and peak memory vs step from "
        "results JSONL files (results_subscriber/to_disc, evaluation_results.jsonl) into one PNG. "
        "Several files are overlaid, each labelled by its parent folder.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("inputs", nargs="+", metavar="RESULTS.jsonl", type=Path, help="results file(s)")
    parser.add_argument("-o", "--output", type=Path, metavar="OUT.png",
                        help="output PNG (default: next to the first input, <stem>.png)")
    parser.add_argument("--title", help="figure title (default: the run label(s))")
    parser.add_argument("--log-y", action="store_true", help="logarithmic y axis for the loss and grad norm panels")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        runs = [read_run(p) for p in args.inputs]
        assign_labels(runs)
        for run in runs:
            for note in notes_for(run):
                print(f"{PROG}: note: {note}", file=sys.stderr)
            if not run.has_data():
                print(f"{PROG}: warning: {run.path}: no plottable values ({run.lines} result lines)", file=sys.stderr)
        runs = [r for r in runs if r.has_data()]
        if not runs:
            raise InputError("nothing to plot: no numeric losses, lr, throughput or grad norm values in the input")
        out = args.output if args.output is not None else args.inputs[0].with_suffix(".png")
        if out.resolve() in {p.resolve() for p in args.inputs}:
            raise InputError(f"output '{out}' would overwrite an input")
        fig, plt, n_panels = render(runs, args.title, args.log_y)
        try:
            write_png_atomically(fig, out)
        finally:
            plt.close(fig)
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({n_panels} panel{'s' if n_panels != 1 else ''}, {len(runs)} run{'s' if len(runs) != 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
