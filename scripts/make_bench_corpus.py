#!/usr/bin/env python3
"""Builds a realistic multilingual JSONL benchmark corpus of a given size.

Documents are made of 3-40 paragraphs drawn from the bundled multilingual and
lorem-ipsum corpora; every paragraph is varied (numbers replaced, words
swapped, case changed, whitespace runs altered) so that a tokenizer's word
cache sees a realistic mix of repeated and new words instead of the same few
hundred lines again and again. Deterministic for a given --seed.

    python3 scripts/make_bench_corpus.py --size-mb 200 --out out/bench/corpus.jsonl
"""
import argparse
import json
import os
import random
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = [
    os.path.join(ROOT, "data", "multilingual", "multilingual.jsonl"),
    os.path.join(ROOT, "data", "sample", "train.jsonl"),
]


def paragraphs():
    out = []
    for path in SOURCES:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                text = json.loads(line).get("text")
                if isinstance(text, str):
                    out.extend(p for p in re.split(r"\n{2,}", text) if p.strip())
    return out


def vary(rng, text):
    words = text.split(" ")
    for _ in range(max(1, len(words) // 8)):
        i = rng.randrange(len(words))
        r = rng.random()
        if r < 0.3:
            words[i] = str(rng.randrange(10 ** rng.randrange(1, 8)))
        elif r < 0.5:
            j = rng.randrange(len(words))
            words[i], words[j] = words[j], words[i]
        elif r < 0.65:
            words[i] = words[i].upper()
        elif r < 0.8:
            words[i] = words[i].capitalize()
        elif r < 0.9:
            words[i] = words[i] + rng.choice([",", ".", ";", ":", "!", "?", ")", "'s"])
        else:
            words[i] = words[i] + " " * rng.randrange(2, 6)
    return " ".join(words)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=200.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    paras = paragraphs()
    target = int(args.size_mb * (1 << 20))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    written = docs = 0
    with open(tmp, "w", encoding="utf-8") as f:
        while written < target:
            n = rng.randrange(3, 41)
            text = "\n\n".join(vary(rng, rng.choice(paras)) for _ in range(n))
            line = json.dumps({"id": docs, "text": text}, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            docs += 1
    os.replace(tmp, args.out)
    print(f"{args.out}: {docs} documents, {written / (1 << 20):.1f} MiB", file=sys.stderr)


if __name__ == "__main__":
    main()
