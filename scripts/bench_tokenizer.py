#!/usr/bin/env python3
"""Single-thread tokenizer throughput of the Python reference libraries.

Side by side with plugins/hf_tokenizer/tests/hf_tokenizer_bench.cpp (Google Benchmark,
built with -DMODALITIES_BUILD_BENCHMARKS=ON): the same text, data/multilingual/
multilingual.jsonl repeated to about 20 MB (--mb), for GPT-2 and every tokenizer family of
plugins/hf_tokenizer/tests/data/families, through
  * Hugging Face `tokenizers` (Rust core) with one thread: `encode_batch` under
    RAYON_NUM_THREADS=1 (and, with --loop, a plain loop of `encode` calls);
  * our engine (the benchmark binary, --ours; skipped when it is not built), with the
    ratio ours / tokenizers and a check that both produced the same number of tokens;
    for each tokenizer ours runs right before `tokenizers`, and each engine makes --repeat
    whole passes over the text, of which the fastest counts (machine noise only slows a pass);
  * tiktoken with the GPT-2 ranks built offline from the fixture's vocabulary
    (tiktoken.get_encoding("gpt2") would download them); its ids are checked
    against `tokenizers` first.
Prints tokens/s and MB/s. Usage (the venv .deps/bench of scripts/setup_bench_env.sh, with the
tokenizers and tiktoken versions pinned in scripts/bench-requirements.txt):

    .deps/bench/bin/python scripts/bench_tokenizer.py [fixtures-dir] [--repeat 3] [--mb 20]
        [--ours build/bin/modalities_hf_tokenizer_bench] [--only gpt2,llama2_style]

[fixtures-dir] holds data/tokenizer/hf_gpt2/... (default: ../shared/fixtures/modalities beside the checkout).
"""

import os

os.environ["RAYON_NUM_THREADS"] = "1"  # must precede the import of tokenizers
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from tokenizers import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT.parent / "shared/fixtures/modalities"
FAMILIES = ["gpt2", "llama3_style", "qwen2_style", "starcoder_style", "tekken_style", "gpt4o_style",
            "deepseek_v3_style", "gptneox_style", "roberta_style", "bloom_style", "llama2_style", "mistral_style",
            "gemma_style", "bert_style", "t5_style", "t5_nmt_style", "unigram_style", "pretok_sequences_style", "whitespace_style"]
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def corpus(target_bytes):
    lines = [json.loads(l)["text"] for l in open(ROOT / "data/multilingual/multilingual.jsonl", encoding="utf-8")]
    out, size = [], 0
    while size < target_bytes:
        for line in lines:
            out.append(line)
            size += len(line.encode("utf-8"))
    return out, size


def best_of(repeat, fn):
    best, result = None, None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - start
        best = elapsed if best is None else min(best, elapsed)
    return best, result


def report(label, seconds, tokens, size):
    print(f"{label:<44} {tokens / seconds / 1e6:8.2f} M tokens/s {size / seconds / 1e6:8.2f} MB/s ({seconds:.2f} s)")


def gpt2_tiktoken(tokenizer_json):
    import tiktoken

    state = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    # Invert GPT-2's bytes_to_unicode to get each token's raw bytes; ranks = ids.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    char_to_byte = {chr(c): b for b, c in zip(bs, cs)}
    ranks = {bytes(char_to_byte[ch] for ch in tok): i for tok, i in state["model"]["vocab"].items()
             if tok != "<|endoftext|>"}
    return tiktoken.Encoding("gpt2-offline", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256})


def tokenizer_file(name, fixtures):
    if name == "gpt2":
        return fixtures / "data/tokenizer/hf_gpt2/tokenizer.json"
    data = ROOT / "plugins/hf_tokenizer/tests/data"
    return (data / name if (data / name).exists() else data / "families" / name) / "tokenizer.json"


def run_ours(binary, name, mb, passes):
    """Our engine on one tokenizer, from the Google Benchmark binary: `passes` whole passes over the
    text, the best one kept (as best_of does for the Python side)."""
    pattern = f"BM_Encode/{name}/"
    env = dict(os.environ, MODALITIES_BENCH_MB=str(mb), MODALITIES_BENCH_PASSES=str(passes))
    out = subprocess.run([str(binary), "--benchmark_format=json", f"--benchmark_filter={pattern}"], env=env,
                         check=True, capture_output=True, text=True).stdout
    benchmarks = json.loads(out)["benchmarks"]
    return benchmarks[0] if benchmarks else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fixtures", type=Path, nargs="?", default=FIXTURES,
                    help="Modalities fixtures directory holding data/... (default: ../shared/fixtures/modalities beside the checkout)")
    ap.add_argument("--repeat", type=int, default=3, help="whole passes per engine; the fastest counts (default 3)")
    ap.add_argument("--mb", type=float, default=20.0, help="corpus size in MiB (default 20)")
    ap.add_argument("--ours", type=Path, default=ROOT / "build/bin/modalities_hf_tokenizer_bench")
    ap.add_argument("--only", default=",".join(FAMILIES), help="comma-separated tokenizer names")
    ap.add_argument("--loop", action="store_true", help="also time a loop of encode calls")
    args = ap.parse_args()
    texts, size = corpus(int(args.mb * (1 << 20)))
    names = [n for n in args.only.split(",") if n]
    if unknown := [n for n in names if n not in FAMILIES]:
        ap.error(f"--only: unknown tokenizer(s) {', '.join(unknown)}; expected some of {', '.join(FAMILIES)}")
    print(f"{len(texts)} texts, {size / 1e6:.1f} MB, one thread")
    have_ours = args.ours.exists()
    if not have_ours:
        print(f"{args.ours} not built (cmake -DMODALITIES_BUILD_BENCHMARKS=ON, target modalities_hf_tokenizer_bench): "
              "ours skipped")
    rows = []
    for name in names:
        # One tokenizer at a time, ours right before theirs, so that both see the machine in the same state.
        b = run_ours(args.ours, name, args.mb, args.repeat) if have_ours else None
        tok = Tokenizer.from_file(str(tokenizer_file(name, args.fixtures)))
        seconds, encs = best_of(args.repeat, lambda: tok.encode_batch(texts))
        n = sum(len(e.ids) for e in encs)
        report(f"tokenizers {name} encode_batch", seconds, n, size)
        if args.loop:
            loop_s, loop_n = best_of(args.repeat, lambda: sum(len(tok.encode(t).ids) for t in texts))
            report(f"tokenizers {name} encode loop", loop_s, loop_n, size)
        row = {"name": name, "tokenizers_tps": n / seconds, "tokens": n}
        if b is not None:
            tps = b["best_pass_tokens/s"]
            ours_n = int(b["tokens"])
            row.update(ours_tps=tps, ours_MBps=tps * size / ours_n / 1e6, same_count=ours_n == n)
            report(f"ours {name}", n / tps, n, size)
        rows.append(row)
    if have_ours:
        print(f"\n| tokenizer | ours M tok/s | ours MB/s | tokenizers M tok/s | ratio | same token count |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            if "ours_tps" in r:
                print(f"| {r['name']} | {r['ours_tps'] / 1e6:.2f} | {r['ours_MBps']:.1f} | {r['tokenizers_tps'] / 1e6:.2f} "
                      f"| {r['ours_tps'] / r['tokenizers_tps']:.1f}x | {r['same_count']} |")
    if "gpt2" not in names:
        return
    files = {"gpt2": tokenizer_file("gpt2", args.fixtures)}

    try:
        enc = gpt2_tiktoken(files["gpt2"])
    except Exception as e:  # tiktoken missing or unusable
        print(f"tiktoken: not available ({e})")
        return
    ref = Tokenizer.from_file(str(files["gpt2"]))
    unique = list(dict.fromkeys(texts))
    diff = sum(enc.encode(t, allowed_special="all") != ref.encode(t).ids for t in unique)
    print(f"tiktoken gpt2 (offline ranks) differs from tokenizers on {diff} of {len(unique)} distinct texts")
    seconds, n = best_of(args.repeat, lambda: sum(len(x) for x in enc.encode_ordinary_batch(texts, num_threads=1)))
    report("tiktoken gpt2 encode_ordinary_batch", seconds, n, size)
    seconds, n = best_of(args.repeat, lambda: sum(len(enc.encode_ordinary(t)) for t in texts))
    report("tiktoken gpt2 encode_ordinary loop", seconds, n, size)


if __name__ == "__main__":
    main()
