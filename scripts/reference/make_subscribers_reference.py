#!/usr/bin/env python3
"""Expected outputs for the subscribers plugin's tests (plugins/subscribers).

Runs Modalities' own EvaluationResultBatch.__str__ (the console log line) and
EvaluationResultToDiscSubscriber (the JSONL results file) on sample results,
plus Python's repr/round/json.dumps and torch's scalar printing on many edge
values, and writes what the C++ tests compare against byte for byte:

  plugins/subscribers/tests/data/python_format.tsv
      kind <TAB> input <TAB> expected, one case per line; inputs are float.hex()
      (exact), strings are hex-encoded UTF-8:
        repr     repr(x)
        round    repr(round(x, n))            input "hex,n"
        json     json.dumps(x)
        jsonstr  json.dumps(s)
  plugins/subscribers/tests/data/results.jsonl   what to_disc writes for SAMPLES
  plugins/subscribers/tests/data/results.txt     str(result) for SAMPLES, one per line

The samples are rebuilt in tests/subscribers_test.cpp (keep both in sync).
Usage: .deps/bench/bin/python scripts/reference/make_subscribers_reference.py
(the venv with modalities 0.5.0 and torch 2.11.0, made by scripts/setup_bench_env.sh).
"""
import json
import math
import os
import random
import tempfile
from pathlib import Path
from unittest import mock

import torch
from modalities.batch import EvaluationResultBatch, ResultItem
from modalities.logging_broker.messages import Message, MessageTypes
from modalities.logging_broker.subscriber_impl.results_subscriber import EvaluationResultToDiscSubscriber

OUT = Path(__file__).resolve().parents[2] / "plugins" / "subscribers" / "tests" / "data"


def samples():
    """The sample results (mirrored in subscribers_test.cpp)."""
    train = EvaluationResultBatch(
        dataloader_tag="train",
        num_train_steps_done=42,
        losses={
            "train loss avg": ResultItem(torch.tensor(3.4567891, dtype=torch.float32), 2),
            "train loss last": ResultItem(torch.tensor(2.675, dtype=torch.float64), 2),
        },
        metrics={
            "consumed tokens": ResultItem(torch.tensor(1048576, dtype=torch.int64), 0),
            "grad norm avg": ResultItem(torch.tensor(0.125, dtype=torch.float32), 2),
            "grad norm last": ResultItem(torch.tensor(1.005, dtype=torch.float32), 2),
        },
        throughput_metrics={
            "train samples/s": ResultItem(torch.tensor(123.45, dtype=torch.float32), 1),
            "train mfu (16-bit)": ResultItem(torch.tensor(-1.0, dtype=torch.float32), 2),
            "lr mean": ResultItem(torch.tensor(0.0003, dtype=torch.float32)),
            "peak memory rank 0 (MB)": ResultItem(torch.tensor(1234.5678, dtype=torch.float32), 2),
        },
    )
    evaluation = EvaluationResultBatch(
        dataloader_tag="val \u00fc \"q\"",
        num_train_steps_done=42,
        losses={"CLMCrossEntropyLoss": ResultItem(torch.tensor(3.215, dtype=torch.float32), 2)},
        throughput_metrics={
            "evaluation_num_samples_per_second": ResultItem(torch.tensor(45.25, dtype=torch.float32), 1)
        },
    )
    shapes = EvaluationResultBatch(
        dataloader_tag="shapes",
        num_train_steps_done=0,
        losses={"small": ResultItem(torch.tensor(6e-05, dtype=torch.float32))},
        metrics={
            "matrix": ResultItem(torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), 1),
            "vector": ResultItem(torch.tensor([0.5, 1e-7, float("nan")], dtype=torch.float32)),
            "flag": ResultItem(torch.tensor(True)),
            "big": ResultItem(torch.tensor(1.5e17, dtype=torch.float64), 0),
            "whole": ResultItem(torch.tensor(7.0, dtype=torch.float32)),
            "zero": ResultItem(torch.tensor(0.0, dtype=torch.float32)),
            "bf16": ResultItem(torch.tensor(0.1, dtype=torch.bfloat16), 3),
        },
    )
    return [train, evaluation, shapes]


def float_cases():
    vals = [0.0, -0.0, 1.0, -1.0, 0.1, 0.2 + 0.1, 1e-4, 1e-5, 0.00012345, 1e15, 1e16, 1.5e16, 9999999999999998.0,
            123456789.125, 1 / 3, 2 / 3, 5e-324, 1.7976931348623157e308, 2.5, 0.5, 1.5, 3.4567891, 123.45,
            float("nan"), float("inf"), float("-inf"), 1e22, 1e-7, 100.0, 12345678901234567890.0]
    rng = random.Random(1234)
    for _ in range(80):
        vals.append(rng.uniform(-1000, 1000))
        vals.append(10 ** rng.uniform(-8, 20) * rng.choice([-1, 1]))
        vals.append(round(rng.uniform(0, 100), rng.randint(0, 4)) + rng.choice([0, 0.005, 0.0005, 0.05]))
    return vals


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    vals = float_cases()
    for x in vals:
        rows.append(("repr", x.hex(), repr(x)))
        rows.append(("json", x.hex(), json.dumps(x)))
        if math.isfinite(x):
            for n in (0, 1, 2, 3, 4, 6, -1, -2):
                rows.append(("round", f"{x.hex()},{n}", repr(round(x, n))))
    # Exact ties and near-ties of decimal rounding.
    for s in ["0.125", "0.375", "2.675", "1.005", "0.5", "1.5", "2.5", "-2.5", "0.045", "1234.5678", "45.25",
              "3.215", "0.0003", "6e-05", "0.999999", "99.95", "-0.004", "1e-4", "100000000.0", "100000001.5"]:
        x = float(s)
        for n in (0, 1, 2, 3):
            rows.append(("round", f"{x.hex()},{n}", repr(round(x, n))))
    for s in ["train", "a\"b\\c", "tab\there\nnl\r\b\f", "\x00\x01\x1f\x7f", "\u00fcber", "\u20ac", "\U0001F600",
              "mixed \u00e9\u4e2d\U00010348 end", ""]:
        rows.append(("jsonstr", s.encode("utf-8").hex(), json.dumps(s)))
    with open(OUT / "python_format.tsv", "w", encoding="utf-8", newline="\n") as f:
        f.write("# generated by scripts/reference/make_subscribers_reference.py; kind\tinput\texpected\n")
        for kind, inp, exp in rows:
            assert "\t" not in exp and "\n" not in exp
            f.write(f"{kind}\t{inp}\t{exp}\n")

    # The JSONL file, written by Modalities' own subscriber (rank 0).
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sub" / "results.jsonl"
        sub = EvaluationResultToDiscSubscriber(output_file_path=path)
        with mock.patch("torch.distributed.get_rank", return_value=0):
            for r in samples():
                sub.consume_message(Message(message_type=MessageTypes.EVALUATION_RESULT, payload=r))
        (OUT / "results.jsonl").write_bytes(path.read_bytes())
    with open(OUT / "results.txt", "w", encoding="utf-8", newline="\n") as f:
        for r in samples():
            f.write(str(r) + "\n")
    print(f"wrote {len(rows)} format cases and {len(samples())} results to {OUT}")


if __name__ == "__main__":
    main()
