#!/usr/bin/env python3
"""Data-preparation benchmark: Modalities C++ against Python Modalities, side by side.

On the same machine, in one run, with the same thread count and settings:
  1. create_raw_index and pack_encoded_data of a >= 200 MB multilingual JSONL
     (scripts/make_bench_corpus.py) with GPT-2, ours vs `modalities` (pip);
     outputs must be byte-identical; reports MB/s, tokens/s per core, ratio.
  2. single-thread tokenization tokens/s on the same documents, for GPT-2, a
     Llama-3-style and a SentencePiece-style byte_fallback tokenizer: our packer
     with one thread (JSON parsing and writing included) vs Python `tokenizers`
     (Tokenizer.encode per document) and, for GPT-2, `tiktoken` (ranks built from
     the same vocabulary; tiktoken cannot download its own files here); ids compared.
  3. random-access reads of 1024-token samples from the packed file: our
     PackedFile vs Modalities' PackedMemMapDatasetContinuous.

Needs the venv .deps/bench with `modalities` 0.5.0, `tokenizers` and `tiktoken` at the versions
pinned in scripts/bench-requirements.txt (create it with scripts/setup_bench_env.sh; --venv picks
another) and a build with benchmarks (scripts/build.sh; this script adds
-DMODALITIES_BUILD_BENCHMARKS=ON itself).

    python3 scripts/bench_data.py [--size-mb 200] [--threads N] [--out out/bench]
Results: a table on stdout and <out>/results.json.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, env=None, quiet=True):
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=quiet, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout if quiet else ''}\n{r.stderr if quiet else ''}")
    return dt, (r.stdout if quiet else "")


def same_bytes(a, b):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 24), fb.read(1 << 24)
            if x != y:
                return False
            if not x:
                return True


def count_tokens(pbin):
    with open(pbin, "rb") as f:
        head = f.read(12)
    data_len = int.from_bytes(head[:8], "little")
    return data_len // int.from_bytes(head[8:12], "little")


# Single-thread tokenization rows: the GPT-2 tokenizer of the packing benchmark, a Llama-3-style one
# (Modalities' own headline benchmark tokenizes with the Llama-3 tokenizer; this one has its
# regex, ignore_merges and BOS template at a small vocabulary) and a SentencePiece-style BPE with
# byte_fallback (Llama-2 pipeline: Prepend/Replace normalizer, no pre-tokenizer).
SINGLE_THREAD_TOKENIZERS = [
    ("gpt2", "data/tokenizer/gpt2_style_8k", "<|endoftext|>"),
    ("llama3_style", "plugins/hf_tokenizer/tests/data/llama3_style", "<|end_of_text|>"),
    ("llama2_byte_fallback", "plugins/hf_tokenizer/tests/data/families/llama2_style", "</s>"),
]

SINGLE_THREAD_PY = r'''
import array, json, sys, time
sample, tok_dir, pbin, eod, with_tiktoken = sys.argv[1:6]
texts = [json.loads(l)["text"] for l in open(sample, encoding="utf-8")]
from transformers import AutoTokenizer
eod_id = AutoTokenizer.from_pretrained(tok_dir).convert_tokens_to_ids(eod)
from tokenizers import Tokenizer
tok = Tokenizer.from_file(tok_dir + "/tokenizer.json")
t0 = time.perf_counter(); ids_hf = [tok.encode(t).ids for t in texts]; t_hf = time.perf_counter() - t0
out = {"hf_s": t_hf, "hf_tokens": sum(len(x) for x in ids_hf)}
raw = open(pbin, "rb").read(); dl = int.from_bytes(raw[:8], "little"); width = int.from_bytes(raw[8:12], "little")
toks = array.array({1: "B", 2: "H", 4: "I"}[width]); toks.frombytes(raw[12:12 + dl])
flat = []
for ids in ids_hf:
    flat.extend(ids)
    if not ids or ids[-1] != eod_id:
        flat.append(eod_id)
out["hf_equals_ours"] = flat == toks.tolist()
if with_tiktoken == "1":
    import tiktoken
    vocab = json.load(open(tok_dir + "/tokenizer.json", encoding="utf-8"))["model"]["vocab"]
    # GPT-2's byte-level alphabet back to bytes (the inverse of bytes_to_unicode).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]; n = 0
    for b in range(256):
        if b not in bs: bs.append(b); cs.append(256 + n); n += 1
    dec = {chr(c): b for b, c in zip(bs, cs)}
    ranks = {bytes(dec[ch] for ch in tokstr): i for tokstr, i in vocab.items() if tokstr != "<|endoftext|>"}
    pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    enc = tiktoken.Encoding("gpt2_local", pat_str=pattern, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256})
    t0 = time.perf_counter(); ids_tt = [enc.encode(t, allowed_special="all") for t in texts]; t_tt = time.perf_counter() - t0
    out.update({"tiktoken_s": t_tt, "tiktoken_tokens": sum(len(x) for x in ids_tt), "tiktoken_equals_hf": ids_tt == ids_hf})
print(json.dumps(out))
'''


def packing_time(log):
    """The packer's own time, as it prints it ("wrote ...: ... in 0.281 s (..."): reading, JSON, tokenizing
    and writing, without starting the process and loading the tokenizer (the Python timings of the
    single-thread rows leave out their start, JSON parsing and tokenizer loading too)."""
    m = re.search(r" in ([0-9.]+) s \(", log)
    if not m:
        sys.exit(f"could not read the packing time from: {log}")
    return float(m.group(1))


def single_thread(name, tok_dir, eod, sample, ours, py, env, out_dir):
    """Our packer on one thread (JSON parsing and writing included) against `tokenizers`' encode per
    document, on the same documents; the packed ids are compared with `tokenizers`' ids + EOD."""
    d = os.path.join(out_dir, "single", name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    idx, pbin = os.path.join(d, "sample.idx"), os.path.join(d, "sample.pbin")
    run([ours, "data", "create_raw_index", sample, "--index_path", idx], env)
    cfg = os.path.join(d, "pack.toml")
    with open(cfg, "w") as f:
        f.write(f'[settings]\nsrc_path = "{sample}"\ndst_path = "{pbin}"\nindex_path = "{idx}"\n'
                f'jq_pattern = ".text"\nnum_cpus = 1\neod_token = "{eod}"\nprocessing_batch_size = 100\n\n'
                '[tokenizer]\ncomponent_key = "tokenizer"\nvariant_key = "pretrained_hf_tokenizer"\n'
                f'config = {{ pretrained_model_name_or_path = "{tok_dir}" }}\n')
    t_ours, log = run([ours, "data", "pack_encoded_data", cfg], env)
    _, out = run([py, "-c", SINGLE_THREAD_PY, sample, tok_dir, pbin, eod, "1" if name == "gpt2" else "0"],
                 dict(env, RAYON_NUM_THREADS="1"))
    st = json.loads(out.strip().splitlines()[-1])
    st.update({"ours_s": t_ours, "ours_pack_s": packing_time(log), "ours_tokens": count_tokens(pbin),
               "sample_bytes": os.path.getsize(sample)})
    return st


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=200.0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "bench"))
    ap.add_argument("--venv", default=os.path.join(ROOT, ".deps", "bench"))
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--single-thread-mb", type=float, default=20.0, help="size of the single-thread tokenizer sample")
    args = ap.parse_args()

    ours = os.path.join(args.build, "bin", "modalities")
    py = os.path.join(args.venv, "bin", "python")
    theirs = os.path.join(args.venv, "bin", "modalities")
    for p in (ours, py, theirs):
        if not os.path.exists(p):
            hint = "scripts/build.sh" if p == ours else "scripts/setup_bench_env.sh"
            sys.exit(f"missing {p}; run {hint} (see --help for the set-up)")
    tok_dir = os.path.join(ROOT, "data", "tokenizer", "gpt2")
    os.makedirs(args.out, exist_ok=True)
    corpus = os.path.join(args.out, "corpus.jsonl")
    if not os.path.exists(corpus) or os.path.getsize(corpus) < args.size_mb * (1 << 20) * 0.99:
        run([sys.executable, os.path.join(ROOT, "scripts", "make_bench_corpus.py"), "--size-mb", str(args.size_mb),
             "--out", corpus])
    size = os.path.getsize(corpus)
    mb = size / 1e6
    res = {"corpus_bytes": size, "threads": args.threads, "machine_cpus": os.cpu_count()}
    env = dict(os.environ, MODALITIES_PROGRESS="0", TOKENIZERS_PARALLELISM="false")

    # --- 1. index + pack, both tools ------------------------------------------
    results = {}
    for who in ("cpp", "python"):
        d = os.path.join(args.out, who)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        idx, pbin = os.path.join(d, "corpus.idx"), os.path.join(d, "corpus.pbin")
        if who == "cpp":
            t_idx, _ = run([ours, "data", "create_raw_index", corpus, "--index_path", idx], env)
            cfg = os.path.join(d, "pack.toml")
            with open(cfg, "w") as f:
                f.write(f'[settings]\nsrc_path = "{corpus}"\ndst_path = "{pbin}"\nindex_path = "{idx}"\n'
                        f'jq_pattern = ".text"\nnum_cpus = {args.threads}\neod_token = "<|endoftext|>"\n'
                        'processing_batch_size = 100\nraw_samples_queue_size = 300\nprocessed_samples_queue_size = 300\n\n'
                        '[tokenizer]\ncomponent_key = "tokenizer"\nvariant_key = "pretrained_hf_tokenizer"\n'
                        f'config = {{ pretrained_model_name_or_path = "{tok_dir}", padding = false, truncation = false }}\n')
            t_pack, log = run([ours, "data", "pack_encoded_data", cfg], env)
            own = packing_time(log)
        else:
            t_idx, _ = run([theirs, "data", "create_raw_index", "--index_path", idx, corpus], env)
            cfg = os.path.join(d, "pack.yaml")
            with open(cfg, "w") as f:
                f.write(f"settings:\n  src_path: {corpus}\n  dst_path: {pbin}\n  index_path: {idx}\n"
                        f"  jq_pattern: .text\n  num_cpus: {args.threads}\n  eod_token: <|endoftext|>\n"
                        "  processing_batch_size: 100\n  raw_samples_queue_size: 300\n  processed_samples_queue_size: 300\n"
                        "tokenizer:\n  component_key: tokenizer\n  variant_key: pretrained_hf_tokenizer\n  config:\n"
                        f"    pretrained_model_name_or_path: {tok_dir}\n    padding: false\n    truncation: false\n")
            t_pack, _ = run([theirs, "data", "pack_encoded_data", cfg], env)
        tokens = count_tokens(pbin)
        results[who] = {"index_s": t_idx, "pack_s": t_pack, "tokens": tokens, "idx": idx, "pbin": pbin,
                        "index_MBps": mb / t_idx, "pack_MBps": mb / t_pack,
                        "pack_tokens_per_s_per_core": tokens / t_pack / args.threads}
        if who == "cpp":
            results[who].update({"packing_only_s": own, "packing_only_MBps": mb / own})
        print(f"{who:7s} index {t_idx:8.2f} s ({mb / t_idx:8.1f} MB/s)   pack {t_pack:8.2f} s "
              f"({mb / t_pack:7.2f} MB/s, {tokens / t_pack / args.threads / 1e6:6.3f} M tok/s/core)"
              + (f"; the packing itself {own:.2f} s ({mb / own:.1f} MB/s)" if who == "cpp" else ""), flush=True)
    res["idx_identical"] = same_bytes(results["cpp"]["idx"], results["python"]["idx"])
    res["pbin_identical"] = same_bytes(results["cpp"]["pbin"], results["python"]["pbin"])
    res["pack"] = results
    res["index_speedup"] = results["python"]["index_s"] / results["cpp"]["index_s"]
    res["pack_speedup"] = results["python"]["pack_s"] / results["cpp"]["pack_s"]
    print(f"identical .idx: {res['idx_identical']}   identical .pbin: {res['pbin_identical']}   "
          f"speed-up index x{res['index_speedup']:.1f}, pack x{res['pack_speedup']:.1f}")

    # --- 2. single-thread tokenization, one row per tokenizer family ---------------
    sample = os.path.join(args.out, "sample.jsonl")
    limit = int(args.single_thread_mb * (1 << 20))
    with open(corpus, encoding="utf-8") as f, open(sample, "w", encoding="utf-8") as g:
        n = 0
        for line in f:
            g.write(line)
            n += len(line.encode())
            if n >= limit:
                break
    res["single_thread"] = {}
    for name, folder, eod in SINGLE_THREAD_TOKENIZERS:
        st = single_thread(name, os.path.join(ROOT, folder), eod, sample, ours, py, env, args.out)
        res["single_thread"][name] = st
        tiktoken = (f", tiktoken {st['tiktoken_tokens'] / st['tiktoken_s'] / 1e6:.3f} M tok/s "
                    f"(== tokenizers: {st['tiktoken_equals_hf']})" if "tiktoken_s" in st else "")
        print(f"single thread, {name:20s} on {st['sample_bytes'] / 1e6:.0f} MB: ours "
              f"{st['ours_tokens'] / st['ours_pack_s'] / 1e6:.3f} M tok/s packing (JSON + write included; "
              f"{st['ours_tokens'] / st['ours_s'] / 1e6:.3f} with the process start), tokenizers "
              f"{st['hf_tokens'] / st['hf_s'] / 1e6:.3f} M tok/s (x{st['hf_s'] / st['ours_pack_s']:.1f}; "
              f"x{st['hf_s'] / st['ours_s']:.1f} with our start){tiktoken}; "
              f"ours == tokenizers: {st['hf_equals_ours']}", flush=True)

    # --- 3. random-access sample reads -----------------------------------------
    pbin = results["cpp"]["pbin"]
    bench = os.path.join(args.build, "bin", "modalities_packed_file_bench")
    if not os.path.exists(bench):
        run(["cmake", "-S", ROOT, "-B", args.build, "-DMODALITIES_BUILD_BENCHMARKS=ON"])
        run(["cmake", "--build", args.build, "--target", "modalities_packed_file_bench"])
    _, out = run([bench, "--benchmark_format=json", "--benchmark_filter=RandomSamples"],
                 dict(env, MODALITIES_BENCH_PBIN=pbin))
    b = json.loads(out)["benchmarks"][0]
    ours_tps = b["items_per_second"]
    py_code = r'''
import json, sys, time, random
from pathlib import Path
from modalities.dataloader.dataset import PackedMemMapDatasetContinuous
ds = PackedMemMapDatasetContinuous(Path(sys.argv[1]), sample_key="input_ids", block_size=1025, reuse_last_target=True)
rng = random.Random(0); n = len(ds); k = 20000
idx = [rng.randrange(n) for _ in range(k)]
t0 = time.perf_counter()
for i in idx: ds[i]
dt = time.perf_counter() - t0
print(json.dumps({"tokens_per_s": k * 1025 / dt}))
'''
    _, out = run([py, "-c", py_code, pbin], env)
    py_tps = json.loads(out.strip().splitlines()[-1])["tokens_per_s"]
    res["random_access"] = {"ours_tokens_per_s": ours_tps, "modalities_tokens_per_s": py_tps, "ratio": ours_tps / py_tps}
    print(f"random 1025-token samples, one thread: ours {ours_tps / 1e6:.1f} M tok/s, Modalities {py_tps / 1e6:.2f} M tok/s "
          f"(x{ours_tps / py_tps:.1f})")
    for r in results.values():
        r.pop("idx"), r.pop("pbin")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
