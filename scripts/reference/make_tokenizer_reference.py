#!/usr/bin/env python3
"""Expected outputs for the tokenizer plugins' tests (hf_tokenizer, sp_tokenizer).

Runs the real Hugging Face `tokenizers`, `transformers` and `sentencepiece`
packages over data/multilingual/multilingual.jsonl and writes what the C++
tests compare against, without needing Python in CI:

  plugins/hf_tokenizer/tests/data/
    llama3_style/, qwen2_style/      small byte-level BPE tokenizers trained here on the corpus
                                     (tokenizer.json + tokenizer_config.json), committed fixtures
    expected/<name>.jsonl            per corpus line: {"ids": [...]} (transformers `tokenizer(text)`,
                                     asserted equal to `tokenizers` encode), "decoded" (decode of the
                                     ids without template tokens) when it differs from the text, and
                                     "decoded_hf" (transformers decode, i.e. with clean-up) when it
                                     differs from the `tokenizers` decode of all ids
    probes.json                      ids of hand-written strings that exercise added-token rules
    variants/                        27 small tokenizers (one pipeline feature each) + expected.json
    regex_classes.json               code points matched by \s, \w, \p{L}, ... in Oniguruma
    wrapper_cases.json               Modalities-level behaviour: padding/truncation/special_tokens
                                     matrices, vocab sizes, special ids, token ids
  plugins/sp_tokenizer/tests/data/
    tiny_bpe.model                   a small SentencePiece model trained here on the corpus
    expected/<name>.jsonl            {"ids": [...]} per corpus line (+ "decoded" when != text)
    facts.json                       piece count, control ids, PieceToId of some pieces

Names: gpt2 = <fixtures>/data/tokenizer/hf_gpt2 (the Modalities fixture),
en32k = <fixtures>/data/tokenizer/sentencepiece_dclm/en_32k_tokenizer.model.

Trained tokenizers are only (re)trained when missing or with --retrain, so the
committed fixtures stay fixed. Usage (the venv .deps/bench of scripts/setup_bench_env.sh, with
the tokenizers, transformers<5 and sentencepiece versions pinned in scripts/bench-requirements.txt):

    .deps/bench/bin/python scripts/reference/make_tokenizer_reference.py [fixtures-dir] [--retrain]

[fixtures-dir] (<fixtures> above) holds data/tokenizer/... (default: ../shared/fixtures/modalities beside the checkout).
"""

import argparse
import collections
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sentencepiece as spm  # noqa: E402
from sentencepiece import sentencepiece_model_pb2  # noqa: E402
import tokenizers  # noqa: E402
import transformers  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data/multilingual/multilingual.jsonl"
HF_DATA = ROOT / "plugins/hf_tokenizer/tests/data"
SP_DATA = ROOT / "plugins/sp_tokenizer/tests/data"
FIXTURES = ROOT.parent / "shared/fixtures/modalities"

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
]
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Non-special added tokens of the Qwen2-style fixture, one per matching rule.
QWEN2_EXTRA = [
    AddedToken("[LS]", lstrip=True, normalized=False),
    AddedToken("[RS]", rstrip=True, normalized=False),
    AddedToken("[BOTH]", lstrip=True, rstrip=True, normalized=False),
    AddedToken("fox", single_word=True, normalized=True),
    AddedToken("ñ", normalized=True),
    AddedToken("tion", normalized=False),
]

PROBES = [
    "", " ", "a", "Hello world", "hello   [LS]b", "[LS]", " [LS] [LS]  x", "x[LS]", "\u3000\u00a0[LS]y",
    "a[RS]   b", "[RS]\n\nz", "[RS]", "q [BOTH]  r", "  [BOTH]  ", "[BOTH][BOTH]",
    "fox foxes xfox fox, (fox) fox_ fox1 éfox fox\u0301 ²fox", "the fox", "fox",
    "n\u0303 jalapen\u0303o ñ Ñ", "nation station tion", "<|endoftext|>x<|im_start|>user\nhi<|im_end|>",
    "<|begin_of_text|><|eot_id|> <|start_header_id|>", "<|endoftext|><|endoftext|>", "<|endof", "a<|im_end|",
    "it's IT'S It'S 'll 're", "12345678901234567890", "A" * 70 + "b" * 70, "\n\r\n\t \u000b\u000c",
    "👍🏽👨‍👩‍👧‍👦🇩🇪", "A\u0301\u0300\u0302", "\ufeff", "  leading and trailing  ",
]


def load_corpus():
    with open(CORPUS, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n")


def write_json(path, obj):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")


def write_rows_json(path, obj):
    """JSON with one line per list element two levels down (compact, still diffable)."""
    def dumps(x):
        return json.dumps(x, ensure_ascii=False, separators=(",", ":"))

    lines = ["{"]
    for i, (key, value) in enumerate(obj.items()):
        sep = "," if i + 1 < len(obj) else ""
        if isinstance(value, list):
            lines.append(f" {dumps(key)}: [")
            lines += [f"  {dumps(v)}" + ("," if j + 1 < len(value) else "") for j, v in enumerate(value)]
            lines.append(f" ]{sep}")
        else:
            lines.append(f" {dumps(key)}: {{")
            items = list(value.items())
            for j, (k, v) in enumerate(items):
                if isinstance(v, list):
                    lines.append(f"  {dumps(k)}: [")
                    lines += [f"   {dumps(x)}" + ("," if m + 1 < len(v) else "") for m, x in enumerate(v)]
                    lines.append("  ]" + ("," if j + 1 < len(items) else ""))
                else:
                    lines.append(f"  {dumps(k)}: {dumps(v)}" + ("," if j + 1 < len(items) else ""))
            lines.append(f" }}{sep}")
    lines.append("}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Training the small fixtures


def byte_level_bpe(pattern, vocab_size, normalizer, texts):
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_llama3_style(texts, out_dir):
    tok = byte_level_bpe(LLAMA3_PATTERN, 3000, None, texts)
    # Whole words in the vocabulary that the merges would split differently, so that
    # ignore_merges (Llama-3 sets it) changes results: frequent long pre-tokens not in the vocab.
    counts = collections.Counter()
    for t in texts:
        for piece, _ in tok.pre_tokenizer.pre_tokenize_str(t):
            counts[piece] += 1
    state = json.loads(tok.to_str())
    vocab = state["model"]["vocab"]
    extra = [p for p, _ in counts.most_common() if len(p) >= 5 and p not in vocab][:40]
    for p in extra:
        vocab[p] = len(vocab)
    state["model"]["ignore_merges"] = True
    tok = Tokenizer.from_str(json.dumps(state))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LLAMA3_SPECIALS])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    decoder = {str(tok.token_to_id(s)): dict(content=s, lstrip=False, normalized=False, rstrip=False,
                                            single_word=False, special=True) for s in LLAMA3_SPECIALS}
    write_json(out_dir / "tokenizer_config.json", {
        "added_tokens_decoder": decoder,
        "bos_token": "<|begin_of_text|>",
        "clean_up_tokenization_spaces": True,
        "eos_token": "<|end_of_text|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })


def train_qwen2_style(texts, out_dir):
    tok = byte_level_bpe(QWEN2_PATTERN, 2500, normalizers.NFC(), texts)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN2_SPECIALS])
    tok.add_tokens(QWEN2_EXTRA)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    decoder = {}
    for entry in json.loads(tok.to_str())["added_tokens"]:
        decoder[str(entry["id"])] = {k: entry[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
    write_json(out_dir / "tokenizer_config.json", {
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    })


def train_tiny_sp(texts, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    sentences = [t.replace("\n", " ") for t in texts if t.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_prefix=str(path.with_suffix("")), vocab_size=1200, model_type="bpe",
        normalization_rule_name="identity", byte_fallback=True, character_coverage=0.98,
        user_defined_symbols=["<eod>"], control_symbols=["<ctl>"], num_threads=1, minloglevel=2)
    path.with_suffix(".vocab").unlink()
    # The trainer records its output path in the model; keep only the file's stem, so that no path of
    # the machine that trained it is committed (it plays no part in encoding).
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(path.read_bytes())
    model.trainer_spec.model_prefix = path.stem
    path.write_bytes(model.SerializeToString())


# --------------------------------------------------------------------------------------------
# Expected outputs


def hf_expected(name, folder, texts):
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(folder))
    prefix = hf("")["input_ids"]  # template tokens around an empty text
    template = raw.encode("").ids
    assert prefix == template, (name, prefix, template)
    # All our templates put their tokens before the text (BOS) or nowhere.
    n_before = len(template)
    assert raw.encode("a").ids[:n_before] == template, name
    rows = []
    mismatches = 0
    for text in texts:
        ids = hf(text)["input_ids"]
        raw_ids = raw.encode(text).ids
        if ids != raw_ids:
            mismatches += 1
        content = ids[n_before:]
        row = {"ids": ids}
        decoded = raw.decode(content, skip_special_tokens=False)
        if decoded != text:
            row["decoded"] = decoded
        full = raw.decode(ids, skip_special_tokens=False)
        assert full == raw.decode(ids[:n_before], skip_special_tokens=False) + decoded, (name, text)
        decoded_hf = hf.decode(ids)
        if decoded_hf != full:
            row["decoded_hf"] = decoded_hf
        rows.append(row)
    assert mismatches == 0, f"{name}: transformers and tokenizers disagree on {mismatches} lines"
    write_jsonl(HF_DATA / "expected" / f"{name}.jsonl", rows)
    print(f"{name}: {len(rows)} lines, {sum(len(r['ids']) for r in rows)} tokens, "
          f"{sum('decoded' in r for r in rows)} lossy decodes, {sum('decoded_hf' in r for r in rows)} cleaned-up decodes")
    return raw, hf


def ignore_merges_effect(folder, texts):
    state = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    state["model"]["ignore_merges"] = False
    plain = Tokenizer.from_str(json.dumps(state))
    real = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return sum(plain.encode(t).ids != real.encode(t).ids for t in texts)


def wrapper_cases(folders):
    cases = []

    def case(name, config, text):
        folder = folders[name]
        tok = AutoTokenizer.from_pretrained(str(folder))
        special = config.get("special_tokens")
        if special is not None:
            before = len(tok.get_vocab())
            tok.add_special_tokens(special_tokens_dict=special, replace_additional_special_tokens=False)
            assert len(tok.get_vocab()) == before
        ids = tok(text, max_length=config.get("max_length"), padding=config.get("padding", False),
                  truncation=config.get("truncation", False))["input_ids"]
        cases.append({"tokenizer": name, "config": config, "text": text, "ids": ids})

    # Modalities' tests/test_tokenization.py matrix (GPT-2, pad token "°").
    pad = {"pad_token": "°"}
    for reps, truncation, padding, max_length in [
        (6, False, "max_length", 10), (6, True, "max_length", 10), (6, False, "max_length", None),
        (6, True, "max_length", None), (6, False, False, 10), (6, True, False, 10), (6, False, False, None),
        (6, True, False, None), (15, True, False, 10), (15, True, True, 10), (15, True, False, None),
        (15, True, True, None), (15, False, False, 10), (15, False, True, 10), (15, False, False, None),
        (15, False, True, None), (1030, False, False, None), (1030, False, True, None), (1030, True, True, None),
        (1020, True, True, None), (1020, True, "max_length", None),
    ]:
        case("gpt2", {"truncation": truncation, "padding": padding, "max_length": max_length, "special_tokens": pad},
             "AAAAAAAA" * reps)
    case("gpt2", {"special_tokens": pad}, "a°b °")
    case("gpt2", {"special_tokens": {"eos_token": "<|endoftext|>"}}, "x<|endoftext|>y")
    case("gpt2", {}, "Hello world<|endoftext|>")
    # Template tokens count against max_length; padding with an added special token.
    rpad = {"pad_token": "<|reserved_special_token_0|>"}
    case("llama3_style", {}, "Hello there, world!")
    case("llama3_style", {"truncation": True, "max_length": 5}, "Hello there, general Kenobi, how are you?")
    case("llama3_style", {"truncation": True, "max_length": 1}, "Hello there")
    case("llama3_style", {"padding": "max_length", "max_length": 12, "special_tokens": rpad}, "Hello")
    case("llama3_style", {"padding": "max_length", "truncation": True, "max_length": 6, "special_tokens": rpad},
         "Hello there, general Kenobi")
    case("llama3_style", {"truncation": True}, "word " * 20)
    case("qwen2_style", {"padding": "max_length", "max_length": 8}, "Hi!")
    case("qwen2_style", {"padding": True, "truncation": True, "max_length": 4}, "one two three four five six")
    case("qwen2_style", {"special_tokens": {"additional_special_tokens": ["fox", "<|im_start|>"]}}, "the fox jumps")
    case("qwen2_style", {"special_tokens": {"mask_token": "hello"}}, "hello world, Hello")

    facts = {}
    for name, folder in folders.items():
        tok = AutoTokenizer.from_pretrained(str(folder))
        probe = ["<|endoftext|>", "<|begin_of_text|>", "<|eot_id|>", "<|im_end|>", "Hello", "ĠHello", "hello", "°",
                 "[LS]", "fox", "not-a-token-at-all"]
        token_ids = {}
        for t in probe:
            i = tok.convert_tokens_to_ids(t)
            if tok._tokenizer.token_to_id(t) is not None:
                token_ids[t] = i
        facts[name] = {
            "vocab_size": tok.vocab_size,
            "full_vocab_size": len(tok.get_vocab()),
            "special_ids": sorted(set(tok.all_special_ids)),
            "token_ids": token_ids,
            "model_max_length": tok.model_max_length if tok.model_max_length < 1e20 else None,
        }
    write_rows_json(HF_DATA / "wrapper_cases.json", {"cases": cases, "tokenizers": facts})


def probes(folders):
    out = {}
    for name, folder in folders.items():
        raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
        out[name] = [{"text": t, "ids": raw.encode(t).ids, "decoded": raw.decode(raw.encode(t).ids, skip_special_tokens=False)} for t in PROBES]
    write_json(HF_DATA / "probes.json", out)


VARIANT_SAMPLE_EVERY = 40  # corpus lines used per variant (plus PROBES)


def tiny_byte_level_base(texts):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return json.loads(tok.to_str())


def tiny_char_base(texts, **trainer_args):
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+"), behavior="removed")
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=2, show_progress=False, special_tokens=["[UNK]"],
                                  limit_alphabet=120, **trainer_args)
    tok.train_from_iterator(texts, trainer=trainer)
    return json.loads(tok.to_str())


def variants(texts, retrain):
    """Small tokenizers, each changing one part of the pipeline, and their ids."""
    out_dir = HF_DATA / "variants"
    out_dir.mkdir(parents=True, exist_ok=True)
    sample = PROBES + texts[::VARIANT_SAMPLE_EVERY]
    existing = sorted(p for p in out_dir.glob("*.json") if p.name != "expected.json")
    if existing and not retrain:  # BPE training is not fully deterministic: keep the committed files
        specs = {p.stem: p.read_text(encoding="utf-8") for p in existing}
    else:
        specs = {name: json.dumps(spec, ensure_ascii=False) for name, spec in variant_specs(texts).items()}
        for name, text in specs.items():
            (out_dir / f"{name}.json").write_text(text, encoding="utf-8")
    expected = {}
    for name, text in specs.items():
        tok = Tokenizer.from_str(text)
        rows = []
        for t in sample:
            ids = tok.encode(t).ids
            row = {"ids": ids}
            decoded = tok.decode(ids, skip_special_tokens=False)
            if decoded != t:
                row["decoded"] = decoded
            rows.append(row)
        expected[name] = rows
    write_rows_json(out_dir / "expected.json", {"texts": sample, "expected": expected})
    print(f"variants: {len(specs)} tokenizers x {len(sample)} texts")


def variant_specs(texts):
    bl = tiny_byte_level_base(texts)
    ch = tiny_char_base(texts)
    ch_affix = tiny_char_base(texts, continuing_subword_prefix="##", end_of_word_suffix="</w>")

    def state(base, **parts):
        s = json.loads(json.dumps(base))
        for k, v in parts.items():
            s[k] = v
        return s

    def split(pattern, behavior, invert=False, literal=False):
        return {"type": "Split", "pattern": {"String" if literal else "Regex": pattern}, "behavior": behavior,
                "invert": invert}

    def seq(*pre):
        return {"type": "Sequence", "pretokenizers": list(pre)}

    bl_last = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    bl_regex = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    bl_prefix = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}

    def added(*tokens):
        return [dict(id=0, content=c, single_word=sw, lstrip=l, rstrip=r, normalized=n, special=sp)
                for c, sw, l, r, n, sp in tokens]

    specs = {
        "bl_gpt2_regex": state(bl),
        "bl_prefix_space": state(bl, pre_tokenizer=bl_prefix,
                                 added_tokens=added(("<special>", False, False, False, False, True))),
        "bl_split_removed": state(bl, pre_tokenizer=seq(split(r"\s+", "Removed"), bl_last)),
        "bl_merged_with_previous": state(bl, pre_tokenizer=seq(split(r"[aeiou]", "MergedWithPrevious"), bl_last)),
        "bl_merged_with_next": state(bl, pre_tokenizer=seq(split(r"[aeiou]", "MergedWithNext"), bl_last)),
        "bl_contiguous": state(bl, pre_tokenizer=seq(split(r"\p{P}", "Contiguous"), bl_last)),
        "bl_invert": state(bl, pre_tokenizer=seq(split(r"\w+", "Isolated", invert=True), bl_last)),
        "bl_string_pattern": state(bl, pre_tokenizer=seq(split(" ", "MergedWithNext", literal=True), bl_last)),
        "bl_string_removed": state(bl, pre_tokenizer=seq(split("e ", "Removed", literal=True), bl_regex)),
        "bl_digits_individual": state(bl, pre_tokenizer=seq({"type": "Digits", "individual_digits": True}, bl_regex)),
        "bl_digits_contiguous": state(bl, pre_tokenizer=seq({"type": "Digits", "individual_digits": False},
                                                            split(r"\s", "Isolated"), bl_last)),
        "bl_empty_matches": state(bl, pre_tokenizer=seq(split(r"x?", "Isolated"), split(r"a*", "Contiguous"),
                                                        split(r"\b", "MergedWithNext"), bl_last)),
        "bl_line_anchors": state(bl, pre_tokenizer=seq(split(r"^\p{L}+|\p{L}+$|\h+|(?m:a.b)", "Isolated"), bl_last)),
        "bl_classes": state(bl, pre_tokenizer=seq(split(r"(?i:[a-f]+)|\u00e9|\d+|\W|\S{4}", "Isolated"), bl_last)),
        "bl_nfkc": state(bl, normalizer={"type": "NFKC"},
                         added_tokens=added(("\u00c5", False, False, False, True, False),
                                            ("fi", False, False, False, True, False))),
        "bl_nfd": state(bl, normalizer={"type": "NFD"},
                        added_tokens=added(("\u00c5", False, False, False, True, False))),
        "bl_nfkd": state(bl, normalizer={"type": "NFKD"}),
        "bl_nfd_nfc": state(bl, normalizer={"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "NFC"}]}),
        "bl_roberta": state(bl, added_tokens=added(("<s>", False, False, False, False, True),
                                                   ("</s>", False, False, False, False, True)),
                            post_processor={"type": "RobertaProcessing", "sep": ["</s>", 421], "cls": ["<s>", 420],
                                            "trim_offsets": True, "add_prefix_space": False}),
        "bl_bert": state(bl, added_tokens=added(("[CLS]", False, False, False, False, True),
                                                ("[SEP]", False, False, False, False, True)),
                         post_processor={"type": "BertProcessing", "sep": ["[SEP]", 421], "cls": ["[CLS]", 420]}),
        "bl_template_eos": state(bl, added_tokens=added(("<bos>", False, False, False, False, True),
                                                        ("<eos>", False, False, False, False, True)),
                                 post_processor={"type": "TemplateProcessing",
                                                 "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                                                            {"Sequence": {"id": "A", "type_id": 0}},
                                                            {"SpecialToken": {"id": "<eos>", "type_id": 0}}],
                                                 "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                                          {"Sequence": {"id": "B", "type_id": 1}}],
                                                 "special_tokens": {
                                                     "<bos>": {"id": "<bos>", "ids": [420], "tokens": ["<bos>"]},
                                                     "<eos>": {"id": "<eos>", "ids": [421], "tokens": ["<eos>"]}}}),
        "ch_unk": state(ch),
        "ch_fuse_unk": state(ch),
        "ch_byte_fallback": state(ch),
        "ch_affixes": state(ch_affix),
        "ch_no_decoder": state(ch, decoder=None),
    }
    specs["ch_fuse_unk"]["model"]["fuse_unk"] = True
    fb = specs["ch_byte_fallback"]["model"]
    fb["byte_fallback"] = True
    for b in range(256):
        fb["vocab"][f"<0x{b:02X}>"] = len(fb["vocab"])
    specs["ch_affixes"]["model"]["fuse_unk"] = True
    for name in ("ch_unk", "ch_fuse_unk", "ch_byte_fallback", "ch_affixes"):
        specs[name]["decoder"] = None
    # An ignore_merges variant of the byte-level base with whole words added to the vocabulary.
    im = state(bl)
    im["model"]["ignore_merges"] = True
    for w in ["Ġthe", "Ġquick", "Ġbrown", "Ġtokenizers", "ĠHello", "Ġworld", "Straße", "Ġ2024", "Ã©"]:
        im["model"]["vocab"].setdefault(w, len(im["model"]["vocab"]))
    specs["bl_ignore_merges"] = im

    for name, spec in specs.items():
        ids_of = {}
        for i, t in enumerate(spec.get("added_tokens") or []):
            t["id"] = ids_of[t["content"]] = len(spec["model"]["vocab"]) + i
        post = spec.get("post_processor") or {}
        for key in ("sep", "cls"):
            if key in post:
                post[key][1] = ids_of[post[key][0]]
        for entry in post.get("special_tokens", {}).values():
            entry["ids"] = [ids_of[t] for t in entry["tokens"]]
    return specs


# transformers' loading rules on synthetic folders: the tokenizer.json of variants/bl_gpt2_regex.json
# with different tokenizer_config.json / special_tokens_map.json files.
CONFIG_TEXTS = ["Hello world", "ab er ab", "x</s>   y <s>z", "the Ġthe er", "a<x>b <x> c", "<|endoftext|>!",
                "word " * 12]
CONFIG_FOLDERS = {
    "legacy_special_tokens_map": {
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "model_max_length": "HUGE"},
        "special_tokens_map.json": {"bos_token": "<s>",
                                    "eos_token": {"content": "</s>", "lstrip": False, "normalized": False,
                                                  "rstrip": True, "single_word": False},
                                    "pad_token": "er", "additional_special_tokens": ["ab"]},
    },
    "gpt2_class_defaults": {
        "tokenizer_config.json": {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": True,
                                  "model_max_length": 8, "truncation_side": "left"},
    },
    "qwen2_class_decoder": {
        "tokenizer_config.json": {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 6, "padding_side": "left",
                                  "added_tokens_decoder": {"420": {"content": "<x>", "lstrip": True, "normalized": False,
                                                                   "rstrip": False, "single_word": False,
                                                                   "special": True}},
                                  "eos_token": "<x>", "bos_token": None},
    },
}


def config_cases():
    base = HF_DATA / "variants" / "bl_gpt2_regex.json"
    out = {}
    import tempfile
    for name, files in CONFIG_FOLDERS.items():
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            state = json.loads(base.read_text(encoding="utf-8"))
            if name == "qwen2_class_decoder":  # tokenizer.json knows <x> with other flags
                state["added_tokens"] = [dict(id=420, content="<x>", single_word=False, lstrip=False, rstrip=False,
                                              normalized=False, special=False)]
            (folder / "tokenizer.json").write_text(json.dumps(state, ensure_ascii=False), encoding="utf-8")
            texts = {}
            for fname, content in files.items():
                text = json.dumps(content, ensure_ascii=False).replace('"HUGE"', "1000000000000000019884624838656")
                (folder / fname).write_text(text, encoding="utf-8")
                texts[fname] = text
            tok = AutoTokenizer.from_pretrained(str(folder))
            pad = tok.pad_token is not None
            out[name] = {
                "files": texts,
                "tokenizer_json_added_tokens": state.get("added_tokens", []),
                "ids": [tok(t)["input_ids"] for t in CONFIG_TEXTS],
                "ids_truncated": [tok(t, truncation=True)["input_ids"] for t in CONFIG_TEXTS],
                "ids_padded": [tok(t, padding="max_length", truncation=True)["input_ids"] for t in CONFIG_TEXTS] if pad and tok.model_max_length < 1e20 else None,
                "decoded": [tok.decode(tok(t)["input_ids"]) for t in CONFIG_TEXTS],
                "vocab_size": tok.vocab_size,
                "full_vocab_size": len(tok.get_vocab()),
                "special_ids": sorted(set(i for i in tok.all_special_ids if i is not None)),
            }
    write_json(HF_DATA / "config_cases.json", {"texts": CONFIG_TEXTS, "folders": out})
    print(f"config cases: {len(out)} folders")


# Character classes of the regexes, as Oniguruma (inside `tokenizers`) sees them: for each
# pattern, the code points it matches, as [first, last] ranges.
REGEX_CLASSES = [r"\s", r"\S", r"\w", r"\W", r"\d", r"\D", r"\h", r"\p{L}", r"\p{N}", r"\p{P}", r"\p{M}",
                 r"[^\s\p{L}\p{N}]", r"[^\r\n\p{L}\p{N}]", r"(?i:'s|k)"]


def regex_classes():
    cps = [c for c in range(1, 0x110000) if not (0xD800 <= c <= 0xDFFF)]
    text = "".join(chr(c) for c in cps)
    out = {}
    for pattern in REGEX_CLASSES:
        kept = bytearray(len(cps))  # pieces left by a Removed split are the non-matches (char offsets)
        for _, (a, b) in pre_tokenizers.Split(Regex(pattern), "removed").pre_tokenize_str(text):
            kept[a:b] = b"\x01" * (b - a)
        ranges = []
        for i, c in enumerate(cps):
            if kept[i]:
                continue
            if ranges and ranges[-1][1] + 1 == c:
                ranges[-1][1] = c
            else:
                ranges.append([c, c])
        out[pattern] = ranges
    write_rows_json(HF_DATA / "regex_classes.json", out)
    print(f"regex classes: {len(out)} patterns over {len(cps)} code points")


def sp_expected(name, model, texts, facts):
    sp = spm.SentencePieceProcessor(model_file=str(model))
    pieces = ["<unk>", "<s>", "</s>", "<pad>", "<eod>", "<ctl>", "▁the", "▁The", "abc123", "▁", "e", "<0x41>"]
    facts[name] = {
        "vocab_size": sp.get_piece_size(),
        "unk_id": sp.unk_id(),
        "control_ids": [i for i in range(sp.get_piece_size()) if sp.is_control(i)],
        "piece_ids": {p: sp.piece_to_id(p) for p in pieces if sp.piece_to_id(p) != sp.unk_id()},
        "unknown_pieces": [p for p in pieces if sp.piece_to_id(p) == sp.unk_id()],
    }
    rows = []
    for text in texts:
        ids = sp.encode(text)
        row = {"ids": ids}
        decoded = sp.decode(ids)
        if decoded != text:
            row["decoded"] = decoded
        rows.append(row)
    write_jsonl(SP_DATA / "expected" / f"{name}.jsonl", rows)
    print(f"sp {name}: {sp.get_piece_size()} pieces, {sum(len(r['ids']) for r in rows)} tokens, "
          f"{sum('decoded' in r for r in rows)} decodes differ from the text")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fixtures", type=Path, nargs="?", default=FIXTURES,
                    help="Modalities fixtures directory holding data/... (default: ../shared/fixtures/modalities beside the checkout)")
    ap.add_argument("--retrain", action="store_true", help="retrain the small tokenizers even if present")
    args = ap.parse_args()
    print(f"tokenizers {tokenizers.__version__}, transformers {transformers.__version__}, sentencepiece {spm.__version__}")
    texts = load_corpus()

    folders = {
        "gpt2": args.fixtures / "data/tokenizer/hf_gpt2",
        "llama3_style": HF_DATA / "llama3_style",
        "qwen2_style": HF_DATA / "qwen2_style",
    }
    if args.retrain or not (folders["llama3_style"] / "tokenizer.json").exists():
        train_llama3_style(texts, folders["llama3_style"])
    if args.retrain or not (folders["qwen2_style"] / "tokenizer.json").exists():
        train_qwen2_style(texts, folders["qwen2_style"])
    tiny = SP_DATA / "tiny_bpe.model"
    if args.retrain or not tiny.exists():
        train_tiny_sp(texts, tiny)

    for name, folder in folders.items():
        hf_expected(name, folder, texts)
    # The main job's tokenizer (scripts/reference/make_sample_corpus.py); not in `folders`, whose
    # probes and wrapper cases predate it.
    hf_expected("gpt2_style_8k", ROOT / "data/tokenizer/gpt2_style_8k", texts)
    print(f"llama3_style: ignore_merges changes {ignore_merges_effect(folders['llama3_style'], texts)} lines")
    probes(folders)
    variants(texts, args.retrain)
    regex_classes()
    config_cases()
    wrapper_cases(folders)
    sp_facts = {}
    sp_expected("en32k", args.fixtures / "data/tokenizer/sentencepiece_dclm/en_32k_tokenizer.model", texts, sp_facts)
    sp_expected("tiny_bpe", tiny, texts, sp_facts)
    write_json(SP_DATA / "facts.json", sp_facts)


if __name__ == "__main__":
    sys.exit(main())
