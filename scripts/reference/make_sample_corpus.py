#!/usr/bin/env python3
"""Makes the bundled sample data and tokenizer of the main job -- all text written by this script.

Outputs (deterministic: a rerun reproduces every byte; each step has its own fixed seed):
  data/tokenizer/gpt2_style_8k/   a GPT-2-style byte-level BPE (8 192 tokens, <|endoftext|> = 0),
                                  trained with Hugging Face `tokenizers` on 3 000 generated
                                  documents (seed TOKENIZER_SEED), plus the tokenizer_config.json
                                  that transformers' AutoTokenizer reads
  data/sample/train.jsonl         500 documents (seed TRAIN_SEED)
  data/sample/eval.jsonl          24 documents (seed EVAL_SEED)

Documents: about three in four are lorem-ipsum-like pseudo-Latin (words built from syllables,
Zipf-distributed, sentences and paragraphs); the rest are "multilingual": pseudo-words in Latin
with diacritics, Cyrillic, Greek, Arabic script, CJK ideographs or Hangul, mixed with the
sentences of scripts/reference/make_multilingual_corpus.py, numbers and a little code. Each
document's length in tokens of the tokenizer above (without EOD) is drawn from a log-normal
distribution (median 300, sigma 1.0) and clipped to [50, 5 000]; the document grows sentence by
sentence until it reaches its length.

The .idx/.pbin next to the JSONL files are not made here: scripts/reference/make_sample_data.py
runs Modalities 0.5.0 (PyPI) on these files.

    .deps/bench/bin/python scripts/reference/make_sample_corpus.py [--check]

--check regenerates into a temporary folder and compares with the committed files.
"""
import argparse
import filecmp
import json
import math
import random
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_multilingual_corpus as ml  # noqa: E402  (our own sentences)

TOKENIZER_SEED = 20261128
TRAIN_SEED = 1128
EVAL_SEED = 2811
VOCAB_SIZE = 8192
EOD = "<|endoftext|>"
MEDIAN_TOKENS, SIGMA, MIN_TOKENS, MAX_TOKENS = 300, 1.0, 50, 5000

# --- pseudo-words ----------------------------------------------------------------------------

LATIN_ONSETS = ["", "b", "c", "d", "f", "g", "l", "m", "n", "p", "qu", "r", "s", "t", "v", "st", "pr", "tr", "cr", "pl"]
LATIN_NUCLEI = ["a", "e", "i", "o", "u", "ae", "au", "ia", "io", "ua"]
LATIN_CODAS = ["", "", "", "m", "n", "s", "t", "r", "x", "nt", "st", "ns"]
NORDIC_NUCLEI = ["a", "e", "i", "o", "u", "å", "æ", "ø", "ä", "ö", "ü", "é", "ei", "au"]
NORDIC_CODAS = ["", "n", "r", "t", "ß", "nd", "rk", "ng", "st", "ch", "ll"]

CYRILLIC_ONSETS = ["", "б", "в", "г", "д", "ж", "з", "к", "л", "м", "н", "п", "р", "с", "т", "ш", "ст", "пр"]
CYRILLIC_NUCLEI = ["а", "е", "и", "о", "у", "ы", "я", "ю", "ё"]
CYRILLIC_CODAS = ["", "", "й", "н", "т", "с", "в", "ть", "ль"]
GREEK_ONSETS = ["", "β", "γ", "δ", "θ", "κ", "λ", "μ", "ν", "π", "ρ", "σ", "τ", "φ", "χ"]
GREEK_NUCLEI = ["α", "ε", "η", "ι", "ο", "υ", "ω", "ά", "έ", "ί", "ό", "ού"]
GREEK_CODAS = ["", "", "ς", "ν", "ρ"]
ARABIC_LETTERS = [chr(c) for c in range(0x0627, 0x063B)] + [chr(c) for c in range(0x0641, 0x064B)]


def syllable_word(rng, onsets, nuclei, codas, lo=1, hi=4):
    return "".join(rng.choice(onsets) + rng.choice(nuclei) + rng.choice(codas) for _ in range(rng.randint(lo, hi)))


def make_lexicon(rng, size, make):
    words = []
    seen = set()
    while len(words) < size:
        w = make(rng)
        if w and w not in seen:
            seen.add(w)
            words.append(w)
    return words


class Language:
    """A pseudo-language: a lexicon drawn with Zipf weights, its sentence end marks and spacing."""

    def __init__(self, rng, size, make, ends=(".", ".", ".", "?", "!"), space=" ", capitalize=True):
        self.words = make_lexicon(rng, size, make)
        self.weights = [1.0 / (rank + 2.7) for rank in range(size)]
        self.ends, self.space, self.capitalize = ends, space, capitalize

    def sentence(self, rng):
        n = max(3, int(rng.gauss(11, 5)))
        words = rng.choices(self.words, weights=self.weights, k=n)
        for i in range(1, n - 1):
            if rng.random() < 0.07:
                words[i] += ","
        text = self.space.join(words)
        if self.capitalize:
            text = text[0].upper() + text[1:]
        return text + rng.choice(self.ends)


def languages(seed):
    rng = random.Random(seed)
    return {
        "latin": Language(rng, 2500, lambda r: syllable_word(r, LATIN_ONSETS, LATIN_NUCLEI, LATIN_CODAS)),
        "nordic": Language(rng, 1200, lambda r: syllable_word(r, LATIN_ONSETS, NORDIC_NUCLEI, NORDIC_CODAS)),
        "cyrillic": Language(rng, 1200, lambda r: syllable_word(r, CYRILLIC_ONSETS, CYRILLIC_NUCLEI, CYRILLIC_CODAS)),
        "greek": Language(rng, 1000, lambda r: syllable_word(r, GREEK_ONSETS, GREEK_NUCLEI, GREEK_CODAS)),
        "arabic": Language(rng, 800, lambda r: "".join(r.choices(ARABIC_LETTERS, k=r.randint(2, 7))),
                           ends=(".", "؟"), capitalize=False),
        "cjk": Language(rng, 1500, lambda r: "".join(chr(0x4E00 + int(r.paretovariate(0.6) * 40) % 6000)
                                                     for _ in range(r.randint(1, 3))),
                        ends=("。", "。", "？"), space="", capitalize=False),
        "hangul": Language(rng, 900, lambda r: "".join(chr(0xAC00 + r.randrange(0, 11172, 7))
                                                       for _ in range(r.randint(1, 4))),
                           ends=(".", "?"), capitalize=False),
    }


REAL_SENTENCES = (ml.LATIN + ml.CYRILLIC + ml.GREEK + ml.ARABIC + ml.HEBREW + ml.DEVANAGARI + ml.THAI + ml.CJK
                  + ml.HANGUL + ml.JAPANESE + ml.EMOJI + ml.CONTRACTIONS)


def number(rng):
    r = rng.random()
    if r < 0.4:
        return str(rng.randint(0, 2100))
    if r < 0.7:
        return f"{rng.uniform(0, 1000):.{rng.randint(1, 3)}f}"
    return rng.choice(ml.NUMBERS)


def sentences(rng, langs, multilingual):
    """Endless sentences of one document (a generator); paragraph breaks are separate items."""
    main = "latin"
    if multilingual:
        main = rng.choice(["nordic", "cyrillic", "greek", "arabic", "cjk", "hangul", "latin"])
    while True:
        r = rng.random()
        if r < 0.08:
            yield "\n\n"
        elif multilingual and r < 0.20:
            yield rng.choice(REAL_SENTENCES)
        elif multilingual and r < 0.30:
            yield langs[rng.choice(list(langs))].sentence(rng)
        elif r < 0.34:
            words = langs[main].sentence(rng).split(langs[main].space) if langs[main].space else [langs[main].sentence(rng)]
            words.insert(rng.randrange(len(words)), number(rng))
            yield langs[main].space.join(words) if langs[main].space else "".join(words)
        elif multilingual and r < 0.36:
            yield rng.choice(ml.CODE)
        else:
            yield langs[main].sentence(rng)


def join(parts):
    out = ""
    for p in parts:
        if p == "\n\n":
            if out and not out.endswith("\n\n"):
                out = out.rstrip(" ") + "\n\n"
        elif not out or out.endswith("\n\n"):
            out += p
        else:
            out += " " + p
    return out.rstrip()


def document(rng, langs, target_tokens, count):
    """Grows a document sentence by sentence until it has at least target_tokens tokens (count(text))."""
    gen = sentences(rng, langs, multilingual=rng.random() < 0.25)
    parts = [next(gen)]
    while parts[0] == "\n\n":
        parts = [next(gen)]
    text = join(parts)
    n = count(text)
    while n < target_tokens:
        parts.append(next(gen))
        candidate = join(parts)
        m = count(candidate)
        if m > MAX_TOKENS:
            parts.pop()
            break
        text, n = candidate, m
    return text, n


def target_length(rng):
    return min(MAX_TOKENS, max(MIN_TOKENS, round(math.exp(rng.gauss(math.log(MEDIAN_TOKENS), SIGMA)))))


def train_tokenizer(langs, out_dir):
    rng = random.Random(TOKENIZER_SEED)
    texts = [document(rng, langs, target_length(rng), lambda t: len(t.split()) * 2)[0] for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False, special_tokens=[EOD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": EOD, "eos_token": EOD, "unk_token": EOD}  # tokenizer_config.json carries them
    config = {"add_prefix_space": False, "model_max_length": 1024, "tokenizer_class": "GPT2Tokenizer",
              "clean_up_tokenization_spaces": False, **special}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok


def write_corpus(path, seed, num_docs, langs, tok):
    rng = random.Random(seed)
    count = lambda t: len(tok.encode(t).ids)  # noqa: E731
    lengths = []
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for _ in range(num_docs):
            text, n = document(rng, langs, target_length(rng), count)
            lengths.append(n)
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return lengths


def make(out_root):
    langs = languages(TOKENIZER_SEED)
    tok = train_tokenizer(langs, out_root / "data/tokenizer/gpt2_style_8k")
    (out_root / "data/sample").mkdir(parents=True, exist_ok=True)
    stats = {}
    for name, seed, n in (("train", TRAIN_SEED, 500), ("eval", EVAL_SEED, 24)):
        lengths = sorted(write_corpus(out_root / f"data/sample/{name}.jsonl", seed, n, langs, tok))
        stats[name] = (len(lengths), sum(lengths), lengths[0], lengths[len(lengths) // 2], lengths[-1])
    return stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="regenerate into a temp folder and compare")
    args = ap.parse_args()
    if not args.check:
        for name, (n, total, lo, med, hi) in make(ROOT).items():
            print(f"{name}: {n} documents, {total} tokens (without EOD); min {lo}, median {med}, max {hi}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        make(Path(tmp))
        rels = ["data/tokenizer/gpt2_style_8k/tokenizer.json", "data/tokenizer/gpt2_style_8k/tokenizer_config.json",
                "data/sample/train.jsonl",
                "data/sample/eval.jsonl"]
        bad = [r for r in rels if not filecmp.cmp(Path(tmp) / r, ROOT / r, shallow=False)]
        if bad:
            sys.exit("differs from the committed file: " + ", ".join(bad))
        print("all files reproduced byte for byte")


if __name__ == "__main__":
    main()
