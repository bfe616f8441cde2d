#!/usr/bin/env python3
"""Small tokenizers of the common model families, and what `transformers` makes of them.

Builds, next to the fixtures of make_tokenizer_reference.py, tokenizers that are produced with the
same pipeline components, class names and config flags as the real hub exports of each family
(only with small vocabularies trained here), and runs `transformers.AutoTokenizer` over a corpus
written to stress tokenizers. The C++ plugin (plugins/hf_tokenizer) must give the same ids.

  plugins/hf_tokenizer/tests/data/families/
    corpus.jsonl                 200 documents {"text": ...}: multilingual prose, code, digit runs,
                                 emoji (Unicode 15/16, skin tones, ZWJ, flags), CJK Ext. H/I and the
                                 Unicode 16 scripts (Garay, Todhri, Kirat Rai), NFD text, compatibility
                                 characters, every kind of whitespace, control characters, case and
                                 accent tricks, literal special-token strings, empty documents
    <family>/                    tokenizer.json, tokenizer_config.json (+ special_tokens_map.json where
                                 the real family ships one); never a .model / vocab.txt file, so
                                 AutoTokenizer loads tokenizer.json
    expected/<name>.jsonl        per corpus document: {"ids": AutoTokenizer(folder)(text)["input_ids"],
                                 "raw_ids": tokenizers.Tokenizer.from_file(tokenizer.json).encode(text).ids
                                 (only when != ids), "decoded": transformers decode(ids) (special tokens
                                 kept), "decoded_raw": tokenizers decode(ids, skip_special_tokens=False)
                                 (only when != decoded)}
    expected/facts.json          per tokenizer: class, tokenizer_class of the config, vocab_size (base
                                 vocabulary, transformers' tok.vocab_size), len(tok), special ids and
                                 tokens, bos/eos/pad/unk ids, ids of the empty text

Families (the pipeline each one reproduces):
  starcoder_style        byte-level BPE, Sequence[Digits(individual), ByteLevel(regex)], GPT2Tokenizer
  tekken_style           Mistral-Nemo Tekken: Split(tekken regex) + ByteLevel(use_regex=False), BPE with
                         ignore_merges (tiktoken conversion), BOS template, PreTrainedTokenizerFast
  gpt4o_style            o200k regex Split + ByteLevel, ignore_merges, PreTrainedTokenizerFast
  deepseek_v3_style      DeepSeek-V3's three Splits + ByteLevel, ByteLevel post-processor in tokenizer.json,
                         LlamaTokenizerFast (add_bos_token: the class rule adds the BOS)
  gptneox_style          GPT-NeoX-20B: NFC, ByteLevel, <|endoftext|> <|padding|>, whitespace-run added
                         tokens, GPTNeoXTokenizer; gptneox_bos_style the same with add_bos_token true
  roberta_style          byte-level BPE + RobertaProcessing, <mask> lstrip, RobertaTokenizer
  llama2_style           SentencePiece BPE (byte_fallback) -> LlamaTokenizerFast(legacy=True, from_slow):
                         Prepend+Replace normalizer, BPE byte_fallback, TemplateProcessing <s> $A
  mistral_style          the same SentencePiece model with legacy=False: Metaspace(prepend_scheme first)
  gemma_style            SentencePiece BPE (byte_fallback) -> GemmaTokenizerFast: Replace(" ", "▁")
  bert_style             tokenizers' BertWordPieceTokenizer (lowercase), BertTokenizer, do_lower_case true;
                         bert_cased_style: lowercase=False, strip_accents unset, do_lower_case false
  t5_style               SentencePiece unigram (identity) -> T5TokenizerFast(extra_ids=10): Unigram + Metaspace,
                         "$A </s>"; t5_nmt_style: nmt_nfkc, so a Precompiled normalizer (as the real T5)
  xlm_roberta_style      SentencePiece unigram (identity) -> XLMRobertaTokenizerFast: fairseq ids (<s> <pad> </s>
                         <unk> first), Metaspace, "<s> $A </s>", <mask> lstrip, XLMRobertaTokenizer
  unigram_style          tokenizers' SentencePieceUnigramTokenizer (Nmt+NFKC+Replace, Metaspace)
  pretok_sequences_style WordPiece with normalizers Sequence[NFKC, Lowercase, Strip] and pre-tokenizers
                         Sequence[WhitespaceSplit, Punctuation(isolated), Digits(contiguous)]
  whitespace_style       BPE with unk, NFD+StripAccents+Lowercase, Whitespace, [CLS] $A [SEP], no decoder
                         (the `tokenizers` quicktour pipeline)
  bloom_style            BLOOM's Split + ByteLevel(use_regex=False), BloomTokenizerFast
The expected outputs also cover gpt2 (<fixtures>/data/tokenizer/hf_gpt2) and the llama3_style and
qwen2_style fixtures of make_tokenizer_reference.py (read, not copied).

Config class names are those of the real repos: LlamaTokenizer (Llama-2, Mistral), LlamaTokenizerFast
(DeepSeek-V3), GemmaTokenizer, T5Tokenizer, GPTNeoXTokenizer, GPT2Tokenizer (StarCoder), RobertaTokenizer,
BertTokenizer, BloomTokenizerFast, PreTrainedTokenizerFast (Tekken, o200k). Every family could be built;
t5_nmt_style's tokenizer.json is ~360 KB because of the real nmt_nfkc Precompiled charsmap.

The corpus and the trained tokenizers are only (re)built when missing, with --retrain (all) or --only
NAME... (those), so the committed fixtures stay fixed; the expected outputs are rewritten on every run
and are reproducible. Retraining is reproducible for the byte-level BPE, BPE and SentencePiece
families, not for the WordPiece ones (the trainer's order of "##" symbols varies) nor for
unigram_style (scores differ in the last digits between runs). Usage (the .deps/bench venv of
scripts/setup_bench_env.sh, tokenizers/transformers/sentencepiece versions of scripts/bench-requirements.txt):

    .deps/bench/bin/python scripts/reference/make_tokenizer_families.py [fixtures-dir] [--retrain] [--only NAME...]

[fixtures-dir] holds data/tokenizer/hf_gpt2 (default: ../shared/fixtures/modalities beside the checkout).
"""

import argparse
import json
import os
import random
import sys
import tempfile
import unicodedata
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sentencepiece as spm  # noqa: E402
import tokenizers  # noqa: E402
import transformers  # noqa: E402
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,  # noqa: E402
                        processors, trainers)
from tokenizers.implementations import BertWordPieceTokenizer, SentencePieceUnigramTokenizer  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

transformers.logging.set_verbosity_error()

ROOT = Path(__file__).resolve().parents[2]
MULTILINGUAL = ROOT / "data/multilingual/multilingual.jsonl"
HF_DATA = ROOT / "plugins/hf_tokenizer/tests/data"
OUT = HF_DATA / "families"
FIXTURES = ROOT.parent / "shared/fixtures/modalities"

TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
O200K_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEEPSEEK_PATTERNS = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+",
]
BLOOM_PATTERN = r" ?[^(\s|[.,!?…。，、।۔،])]+"

HUGE = 1000000000000000019884624838656  # transformers' VERY_LARGE_INTEGER, as the hub configs write it
BYTE_LEVEL_VOCAB = 1280  # 256 byte symbols + ~1000 merges (+ specials)
SP_VOCAB = 1500

# --------------------------------------------------------------------------------------------
# Corpus

SPECIAL_STRINGS = [
    "<s>", "</s>", "<unk>", "<pad>", "<mask>", "[CLS]", "[SEP]", "[MASK]", "[UNK]", "[PAD]", "<|endoftext|>",
    "<|begin_of_text|>", "<0x41>", "▁", "<extra_id_0>", "<|im_start|>", "<|im_end|>", "<bos>", "<eos>",
    "<|padding|>", "<fim_prefix>", "[INST]", "[/INST]", "<start_of_turn>", "<|endofprompt|>",
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<|eot_id|>",
]

HAND_WRITTEN = [
    # source code
    'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range(n):\n'
    '        a, b = b, a + b\n    return a\n',
    "template <typename T>\nstd::vector<T> twice(const std::vector<T>& v) {\n\tstd::vector<T> out;\n"
    "\tfor (auto&& x : v) { out.push_back(x * 2); }\n\treturn out; // C++17\n}\n",
    '{"name": "modalities", "version": "0.1.0", "deps": ["torch>=2.3", "tokenizers==0.22.2"], "ok": true, "n": null}',
    '<!DOCTYPE html>\n<html lang="de"><head><meta charset="utf-8"><title>Grüße &amp; Co.</title></head>\n'
    '<body><p class="x">&lt;b&gt;fett&lt;/b&gt; &#x1F600; &nbsp;</p></body></html>',
    "cat /var/log/syslog | grep -E 'err(or)?' | awk '{print $5}' | sort | uniq -c | sort -rn | head -n 10 && echo $?",
    r"^(?:[a-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[a-z0-9!#$%&'*+/=?^_`{|}~-]+)*)@(?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?\.)+$",
    "SELECT u.id, COUNT(*) AS n FROM users u JOIN orders o ON o.user_id = u.id WHERE o.total > 100.50 GROUP BY u.id;",
    "fn main() {\n    let v: Vec<u64> = (1..=10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "all: build\n\nbuild:\n\t$(CXX) -O2 -std=c++20 -o app main.cpp\n\nclean:\n\trm -f app *.o\n",
    "\\begin{equation}\n  \\int_0^\\infty e^{-x^2}\\,dx = \\frac{\\sqrt{\\pi}}{2}\n\\end{equation}",
    "| col a | col b |\n|------:|:------|\n| 1 | **bold** _it_ `code` |\n| 2 | [link](https://example.org/a?b=c&d=e#f) |",
    "Contact: jane.doe+tag@example.co.uk, https://huggingface.co/docs/tokenizers/api/pre-tokenizers?x=1 or C:\\Users\\J\\x.txt",
    "aGVsbG8gd29ybGQhIFRoaXMgaXMgYmFzZTY0IGVuY29kZWQgdGV4dC4uLg==  0x7f454c46 0xDEADBEEF 0b1010_1010 0o755",
    "    if (x != y && y >= 0 || !z) { return -1; } else if (x <<= 2) { x >>= 1; } // ->, =>, ::, ..., ===, !==",
    # numbers
    "3.14159265358979323846264338327950288419716939937510582097494459230781640628620899862803482534211706798",
    "1,234,567.89 vs 1.234.567,89 vs 1 234 567,89 vs 12,34,567 — 2024-06-01T12:34:56.789Z, 23:59:60, +49 (0)30 1234567",
    "0000000000000000000000000000001 " + "9" * 64 + " 12345678901234567890 007 -42 +7 1e-9 6.022e23 ¼ ½ ¾",
    "Other digits: ٠١٢٣٤٥٦٧٨٩ ۰۱۲۳۴۵۶۷۸۹ ०१२३४५६७८९ ০১২৩ ௧௨௩ ๑๒๓๔ ໑໒ ၁၂၃ １２３ x² y³ ₁₂ Ⅻ ⅷ ⑳ 〇",
    "Version 1.2.3-rc.4+build.567, IPv4 192.168.0.1, IPv6 2001:db8::ff00:42:8329, MAC 00:1A:2B:3C:4D:5E",
    "$100 €2,50 £3 ¥400 ₹5,00,000 ₿0.0001 100% 3×4=12 7÷2=3.5 ±0.1 ≤≥≠≈ ∞ √2 ∑∏∫",
    # emoji
    "Skin tones: 👍 👍🏻 👍🏼 👍🏽 👍🏾 👍🏿 🧑🏿‍🦰 👩🏻‍❤️‍💋‍👨🏼 🤝🏽",
    "ZWJ: 👨‍👩‍👧‍👦 🏳️‍🌈 🏴‍☠️ ❤️‍🔥 🐦‍⬛ 🐦‍🔥 🙂‍↔️ 🧑‍🧑‍🧒 🧑‍💻 👁️‍🗨️",
    "Flags: 🇩🇪🇯🇵🇺🇸🇧🇷 🇪🇺 🏴󠁧󠁢󠁳󠁣󠁴󠁿 🏴󠁧󠁢󠁷󠁬󠁳󠁿 🏁 keycaps 1️⃣ #️⃣ *️⃣ text ☺︎ vs emoji ☺️",
    "Unicode 15/16: \U0001FAE8 shaking, \U0001FA89 harp, \U0001FAAF khanda, \U0001F6DC wireless, \U0001FAE9 tired, "
    "\U0001FAC6 fingerprint, \U0001FABE leafless tree, \U0001FADC root, \U0001FA8F shovel, \U0001FADF splatter",
    "🚀🚀🚀🔥💯✨🎉🎉 " * 3 + "😀😃😄😁😆😅🤣😂🙂🙃🫠😉😊😇🥰😍🤩😘",
    # CJK and new scripts
    "CJK Ext. B/G/H/I: 𠀀𠀁𪚥𰀀𰀁 " + "".join(chr(c) for c in range(0x31350, 0x31360)) + " "
    + "".join(chr(c) for c in range(0x2EBF0, 0x2EC00)),
    "Garay: " + "".join(chr(c) for c in range(0x10D40, 0x10D66)) + " Todhri: "
    + "".join(chr(c) for c in range(0x105C0, 0x105E0)) + " Kirat Rai: " + "".join(chr(c) for c in range(0x16D40, 0x16D60)),
    "Sunuwar " + "".join(chr(c) for c in range(0x11BC0, 0x11BD0)) + " Tulu-Tigalari "
    + "".join(chr(c) for c in range(0x11380, 0x11390)) + " Ol Onal " + "".join(chr(c) for c in range(0x1E5D0, 0x1E5E0)),
    "我们在北京大学学习自然语言处理。机器学习和深度学习是人工智能的重要分支，大模型的分词器很重要！",
    "你好，世界！这是一个测试。「引号」『双引号』【括号】《书名》、顿号；分号：冒号？……——～·",
    "東京は日本の首都です。カタカナ、ひらがな、漢字を混ぜて書きます。ｶﾀｶﾅ ﾊﾝｶｸ 〜ー〃々〆",
    "안녕하세요, 세계! 한국어 형태소 분석은 어렵습니다. 위키백과에 오신 것을 환영합니다.",
    "Jamo: \u1100\u1161\u11a8 \u1112\u1161\u11ab\u1100\u1173\u11af (conjoining) vs ㄱㅏㄱ ㅎㅏㄴ (compatibility) vs 각 한글",
    "สวัสดีครับ ภาษาไทยไม่มีช่องว่างระหว่างคำ เช่น ฉันรักประเทศไทยมาก ๑๒๓",
    "مرحبا بالعالم، هذا اختبار. مَرْحَبًا بِكُمْ ﷺ ﷽ لا إله — «اقرأ» ؟",
    "שָׁלוֹם עוֹלָם! זוהי בדיקה עם ניקוד. Mixed RTL: abc עברית 123 عربي def",
    "नमस्ते दुनिया। यह एक परीक्षण है॥ क्षत्रिय ज्ञान श्री क़ ख़ ग़ — हिन्दी और संस्कृतम्",
    "বাংলা ভাষা, தமிழ் மொழி, తెలుగు, ಕನ್ನಡ, മലയാളം, ગુજરાતી, ਪੰਜਾਬੀ, ଓଡ଼ିଆ, සිංහල, བོད་ཡིག, မြန်မာ, ខ្មែរ, ລາວ",
    "Ελληνικά: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Ⴀ ქართული ენა, Հայերեն, አማርኛ, ᏣᎳᎩ, ᐃᓄᒃᑎᑐᑦ, ᚠᚢᚦᚨᚱᚲ",
    # compatibility characters
    "Ligatures: ﬁnance ﬂow ﬀ ﬃ ﬄ ﬅ ﬆ; circled ①②③⑩⑳ ⓐⓑ; full-width ＡＢＣ ａｂｃ １２３！？",
    "Letterlike: ℌℍℕℙℚℝℤ ℃ ℉ № ™ ℡ Ω K Å; squares ㎏㎞㎡㍿㌔; roman ⅠⅡⅢⅣⅻ; fractions ⅓⅔⅛; super x⁴ⁿ",
    "Segmented digits: " + "".join(chr(c) for c in range(0x1FBF0, 0x1FBFA)) + "; math 𝐀𝐁𝐂 𝑥𝑦𝑧 𝔄𝔅 𝕏𝕐 𝟘𝟙𝟚; ǆ ǈ ǋ Ǳ",
    "Half-width: ｶﾞｷﾞｸﾞ ﾟ ｰ; vertical ︵︶ ︐︑; small ﹏﹐﹑; ⁉ ‼ ⁇ … ‥ ′″‴ ‹›«» „“”‚‘’",
    # NFD-decomposed text (built below as well)
    # whitespace
    "a \t b\n\r\nc\u00a0d\u3000e\u2028f\u2029g\u200bh\u0085i\u000bj\u000ck\u2003l\u2009m\u202fn\u205fo\u1680p\u180eq",
    "word" + " " * 30 + "word" + "\t" * 8 + "word" + "\n" * 6 + "end",
    "   leading spaces and trailing spaces   ",
    "\n\nleading newlines\n\n\n",
    "\t\tindented\n\t\t\tmore\n\tless\n",
    "a  b   c    d     e      f       g        h         i          j",
    "windows\r\nline\r\nendings\r\n\r\nand old mac\rline\rendings\r",
    " \n \n \t\n  \n\n   \r\n",
    "nbsp:\u00a0\u00a0\u00a0x ideographic:\u3000\u3000y thin:\u2009z figure:\u2007w zero-width:\u200b\u200b\u200bv",
    "trailing newline only\n",
    # control characters
    "nul\x00byte\x01\x02\x03\x04\x05\x06\x07\x08 bell and backspace, \x0e\x0f\x10\x11\x12\x13\x14\x15\x16\x17",
    "\x18\x19\x1a\x1b[31mred\x1b[0m\x1c\x1d\x1e\x1f unit separators, del\x7f, c1\x80\x9f",
    "\ufeffBOM at start, \u200eLTR\u200f RTL marks, \u202aembed\u202c, \u2066isolate\u2069, soft\u00adhyphen, word\u2060joiner",
    "Private use: \ue000\ue001\uf8ff \U000F0000\U0010FFFD; noncharacters \ufdd0\ufffe; replacement \ufffd; tag \U000E0041",
    "\u0301\u0301 leading combining marks, a\u0300\u0301\u0302\u0303\u0304\u0305\u0306\u0307\u0308 stacked, Z\u0335\u0321a\u0337l\u0336g\u0334o",
    # case and accents
    "İstanbul iİıI ǅemal Ǆǅǆ ǈ ǋ; STRASSE Straße ẞ ß; ΟΔΟΣ ὈΔΥΣΣΕΎΣ σοφός Σ ς; ŉ ΐ ﬃ K Å",
    "Accents: Ça va? Über naïve résumé café Ñandú Ångström Ærø øre Łódź Dvořák Ştefan Tiếng Việt İğdır ǅ Ǆ ǯ",
    "MiXeD CaSe WORDS and ALLCAPS, camelCaseIdentifier, snake_case_identifier, SCREAMING_SNAKE, kebab-case-id",
    "It's IT'S it’s we'll WE'LL they're THEY'RE I'd I'D you've YOU'VE I'm I'M 's 't 're",
    # special-token strings
    "<s>Hello world</s>",
    " <s> spaced specials </s> ",
    "<unk><pad><mask>x<mask> <mask> a <mask>b",
    "[CLS] what is it? [SEP] a test. [SEP]",
    "[MASK]ed word[UNK] [PAD][PAD] [cls] [Sep] [ CLS ]",
    "previous doc<|endoftext|>next doc <|endoftext|> <|endoftext|><|endoftext|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<0x41><0x0A> byte pieces <0xFF><0x00> and <0x4> and <0xGG>",
    "▁leading▁meta ▁ ▁▁ ▁▁▁x word▁ ▁▁▁",
    "<extra_id_0> span one <extra_id_1> span two <extra_id_9><extra_id_99>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhello<|im_end|>",
    "<｜begin▁of▁sentence｜>Hi<｜end▁of▁sentence｜> <｜▁pad▁｜> <｜User｜>q<｜Assistant｜>",
    "<bos><eos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "[INST] hi [/INST] answer</s>[INST]again[/INST]",
    "<|padding|><|padding|> <fim_prefix>def f(<fim_suffix>):<fim_middle> <|endofprompt|>",
    "partial: <s <|endoftext| [CLS <extra_id_ <|im_start <｜begin▁of and nested <<s>> [[SEP]] <</s>>",
]

# Emoji / script pieces the random mixes draw from, next to the lines above and the corpus.
FRAGMENTS = SPECIAL_STRINGS + [
    "the", " ", "  ", "\n", "\t", "\u00a0", "\u3000", "3.5", "2024", "0", "abc", "ABC", "Ab", "é", "e\u0301", "ß",
    "👍🏽", "👨‍👩‍👧", "🇫🇷", "\U0001FAE8", "中文", "日本語", "한국어", "ไทย", "عربى", "עברית", "हिन्दी", "ﬁ", "①",
    "Ｆｕｌｌ", "\x00", "\x1b", "\u200b", "\ufeff", "...", "!!!", "?!", "—", "«»", "'s", "'LL", "\\n", "\r\n",
    "x" * 40, "0123456789" * 3, "http://a.b/c", "İ", "Σ", "ǅ", "\U00031350", "\U00010D40", "\U000105C0", "\U00016D40",
]


def load_multilingual():
    with open(MULTILINGUAL, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def make_corpus(multilingual):
    docs = ["", " ", "\n", " \t\n\u3000 ", "\u200b"]  # empty / whitespace-only documents
    docs += HAND_WRITTEN
    nfd_sources = [
        "Crème brûlée, façade, naïve, coöperate, jalapeño, Ærøskøbing, São Paulo, Dvořák, Ångström.",
        "Tiếng Việt có nhiều dấu: Hà Nội, Đà Nẵng, Huế, Phở bò, Nguyễn Thị Minh Khai.",
        "한국어 문장을 NFD로 분해하면 자모가 됩니다. 서울특별시",
        "Ελληνικά με τόνους: άέήίόύώ ΐΰ, Ῥόδος; Devanagari क़ ख़; Å Ω K ﬁ ①",
        "Ça, Ö, Ü, Ñ, Ÿ, ǅ, Ǆ, ẞ and precomposed ḍ ṣ ṭ ṇ ā ī ū (IAST): Rāmāyaṇa, Mahābhārata.",
        "日本語の濁点：がぎぐげご、パピプペポ、ヴ; half-width ｶﾞ",
    ]
    docs += [unicodedata.normalize("NFD", t) for t in nfd_sources]
    docs += [unicodedata.normalize("NFKD", nfd_sources[3])]
    # Special-token strings glued to words and surrounded by spaces.
    docs.append(" ".join(SPECIAL_STRINGS))
    docs.append("word".join(SPECIAL_STRINGS) + "word")
    docs.append("".join(SPECIAL_STRINGS))
    # Multilingual prose sampled from the shared corpus.
    sample = multilingual[7::23]
    docs += [t[:200] for t in sample[:200 - len(docs) - 40]]
    # Random mixes of everything above.
    rng = random.Random(20240601)
    pool = HAND_WRITTEN + FRAGMENTS + multilingual[::50]
    seps = [" ", "", "\n", "  ", "\t", "\u00a0", ". ", ", ", "\r\n", "   "]
    while len(docs) < 200:
        parts = [rng.choice(pool) for _ in range(rng.randint(2, 4))]
        text = ""
        for p in parts:
            if len(p) > 160:
                start = rng.randrange(0, len(p) - 80)
                p = p[start:start + rng.randint(20, 80)]
            text += p + rng.choice(seps)
        docs.append(text)
    assert len(docs) == 200
    return docs


# --------------------------------------------------------------------------------------------
# Writers


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
    """One line per top-level entry (compact, still diffable)."""
    def dumps(x):
        return json.dumps(x, ensure_ascii=False, separators=(",", ":"))
    items = list(obj.items())
    lines = ["{"] + [f" {dumps(k)}: {dumps(v)}" + ("," if i + 1 < len(items) else "") for i, (k, v) in enumerate(items)]
    path.write_text("\n".join(lines + ["}"]) + "\n", encoding="utf-8")


def save_tokenizer(tok, folder):
    """tokenizer.json as `tokenizers` writes it, but compact (the hub files are indented; sizes matter here)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = json.loads(tok.to_str())
    (folder / "tokenizer.json").write_text(json.dumps(state, ensure_ascii=False, separators=(",", ":")) + "\n",
                                           encoding="utf-8")


def compact_tokenizer_json(folder):
    path = folder / "tokenizer.json"
    state = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps(state, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")


def added_tokens_decoder(folder):
    state = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    return {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for t in state["added_tokens"]}


def write_config(folder, config, special_tokens_map=None):
    """tokenizer_config.json with the added_tokens_decoder of tokenizer.json, keys sorted as save_pretrained does."""
    config = dict(config)
    config["added_tokens_decoder"] = added_tokens_decoder(folder)
    text = json.dumps(dict(sorted(config.items())), ensure_ascii=False, indent=2).replace('"HUGE"', str(HUGE))
    (folder / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")
    if special_tokens_map is not None:
        write_json(folder / "special_tokens_map.json", special_tokens_map)


def token_dict(content, lstrip=False, rstrip=False, normalized=False, single_word=False):
    return {"content": content, "lstrip": lstrip, "normalized": normalized, "rstrip": rstrip, "single_word": single_word}


# --------------------------------------------------------------------------------------------
# Families trained with `tokenizers`


ALPHABET_SIZE = 400


def alphabet(texts, normalizer):
    """The ALPHABET_SIZE most frequent characters of the normalized texts (ties by code point): given as the
    initial alphabet with limit_alphabet=ALPHABET_SIZE, the trainers keep exactly these, where limit_alphabet
    alone breaks ties between equally frequent characters differently from run to run."""
    counts = {}
    for t in texts:
        for c in (normalizer.normalize_str(t) if normalizer is not None else t):
            if not c.isspace():
                counts[c] = counts.get(c, 0) + 1
    return sorted(counts, key=lambda c: (-counts[c], ord(c)))[:ALPHABET_SIZE]


def train_bpe(texts, pre_tokenizer, vocab_size=BYTE_LEVEL_VOCAB, special_tokens=(), normalizer=None,
              byte_level=True, unk=None, decoder="byte_level"):
    tok = Tokenizer(models.BPE(unk_token=unk))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    if decoder == "byte_level":
        tok.decoder = decoders.ByteLevel()
    if byte_level:
        kwargs = dict(initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        kwargs = dict(initial_alphabet=alphabet(texts, normalizer), limit_alphabet=ALPHABET_SIZE)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[AddedToken(s, special=True, normalized=False) for s in special_tokens],
                                  **kwargs)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def bl_split(pattern):
    return pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)


def bl_last():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)


STARCODER_SPECIALS = [
    "<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<filename>", "<gh_stars>",
    "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>", "<jupyter_code>",
    "<jupyter_output>", "<empty_output>", "<commit_before>", "<commit_msg>", "<commit_after>", "<reponame>",
]


def build_starcoder(texts, folder):
    tok = train_bpe(texts, pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ]), special_tokens=STARCODER_SPECIALS)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    save_tokenizer(tok, folder)
    eot = "<|endoftext|>"
    write_config(folder, {
        "add_prefix_space": False, "additional_special_tokens": STARCODER_SPECIALS, "bos_token": eot,
        "clean_up_tokenization_spaces": True, "eos_token": eot, "model_max_length": "HUGE",
        "tokenizer_class": "GPT2Tokenizer", "unk_token": eot, "vocab_size": 49152,
    }, {"additional_special_tokens": STARCODER_SPECIALS, "bos_token": eot, "eos_token": eot, "unk_token": eot})


FALCON_SPECIALS = [">>TITLE<<", ">>ABSTRACT<<", ">>INTRODUCTION<<", ">>SUMMARY<<", ">>COMMENT<<", ">>ANSWER<<",
                   ">>QUESTION<<", ">>DOMAIN<<", ">>PREFIX<<", ">>SUFFIX<<", ">>MIDDLE<<", "<|endoftext|>"]


def build_falcon(texts, folder):
    # Falcon's pre-tokenizer order: Punctuation, then ByteLevel, then Digits and a three-digit Split,
    # which therefore see the byte-level characters (e.g. the UTF-8 byte 0xB2 is shown as '²', a
    # numeric character that Digits splits off).
    tok = train_bpe(texts, pre_tokenizers.Sequence([
        pre_tokenizers.Punctuation(behavior="contiguous"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.Split(Regex("[0-9][0-9][0-9]"), behavior="isolated", invert=False),
    ]), special_tokens=FALCON_SPECIALS)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    save_tokenizer(tok, folder)
    eot = "<|endoftext|>"
    write_config(folder, {
        "add_prefix_space": False, "eos_token": eot, "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True,
        "model_input_names": ["input_ids", "attention_mask"],
    }, {"additional_special_tokens": FALCON_SPECIALS[:-1], "eos_token": eot})


TEKKEN_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "<pad>", "[PREFIX]", "[MIDDLE]", "[SUFFIX]"]
TEKKEN_SPECIALS += [f"<SPECIAL_{i}>" for i in range(len(TEKKEN_SPECIALS), 24)]


def tiktoken_style(tok):
    """What transformers' TikTokenConverter gives: ignore_merges, ByteLevel(trim_offsets=False) post-processor."""
    state = json.loads(tok.to_str())
    state["model"]["ignore_merges"] = True
    tok = Tokenizer.from_str(json.dumps(state))
    return tok


def build_tekken(texts, folder):
    tok = tiktoken_style(train_bpe(texts, pre_tokenizers.Sequence([bl_split(TEKKEN_PATTERN), bl_last()]),
                                   special_tokens=TEKKEN_SPECIALS))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    save_tokenizer(tok, folder)
    write_config(folder, {
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "clean_up_tokenization_spaces": False,
        "eos_token": "</s>", "legacy": True, "model_max_length": "HUGE", "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
    }, {"bos_token": token_dict("<s>"), "eos_token": token_dict("</s>"), "unk_token": token_dict("<unk>")})


def build_gpt4o(texts, folder):
    tok = tiktoken_style(train_bpe(texts, pre_tokenizers.Sequence([bl_split(O200K_PATTERN), bl_last()])))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ["<|endoftext|>", "<|endofprompt|>"]])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    save_tokenizer(tok, folder)
    write_config(folder, {
        "bos_token": "<|endoftext|>", "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>",
        "model_max_length": 128000, "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<|endoftext|>",
    })


DEEPSEEK_BOS, DEEPSEEK_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def build_deepseek_v3(texts, folder):
    tok = train_bpe(texts, pre_tokenizers.Sequence([bl_split(p) for p in DEEPSEEK_PATTERNS] + [bl_last()]),
                    special_tokens=[DEEPSEEK_BOS, DEEPSEEK_EOS, "<｜▁pad▁｜>"])
    tok.normalizer = normalizers.Sequence([])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in [
        "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>", "<｜User｜>", "<｜Assistant｜>", "<|EOT|>",
        "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"]])
    tok.add_tokens([AddedToken(f"<｜place▁holder▁no▁{i}｜>", special=False, normalized=True) for i in range(4)])
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    save_tokenizer(tok, folder)
    write_config(folder, {
        "add_bos_token": True, "add_eos_token": False,
        "bos_token": dict(__type="AddedToken", **token_dict(DEEPSEEK_BOS, normalized=True)),
        "clean_up_tokenization_spaces": False,
        "eos_token": dict(__type="AddedToken", **token_dict(DEEPSEEK_EOS, normalized=True)),
        "legacy": True, "model_max_length": 131072,
        "pad_token": dict(__type="AddedToken", **token_dict(DEEPSEEK_EOS, normalized=True)),
        "sp_model_kwargs": {}, "unk_token": None, "tokenizer_class": "LlamaTokenizerFast",
    })


def build_gptneox(texts, folder, add_bos):
    tok = train_bpe(texts, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
                    special_tokens=["<|endoftext|>", "<|padding|>"], normalizer=normalizers.NFC())
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=True)
    # GPT-NeoX-20B's runs of spaces: non-special, normalized added tokens.
    tok.add_tokens([AddedToken(" " * n, normalized=True, special=False) for n in range(24, 1, -1)])
    save_tokenizer(tok, folder)
    eot = "<|endoftext|>"
    write_config(folder, {
        "add_bos_token": add_bos, "add_eos_token": False, "add_prefix_space": False, "bos_token": eot,
        "clean_up_tokenization_spaces": True, "eos_token": eot, "model_max_length": "HUGE", "pad_token": None,
        "tokenizer_class": "GPTNeoXTokenizer", "unk_token": eot,
    }, {"bos_token": eot, "eos_token": eot, "unk_token": eot})


def build_roberta(texts, folder):
    tok = train_bpe(texts, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
                    special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True, normalized=False)])
    tok.post_processor = processors.RobertaProcessing(sep=("</s>", 2), cls=("<s>", 0), trim_offsets=True,
                                                      add_prefix_space=False)
    save_tokenizer(tok, folder)
    names = dict(bos_token="<s>", cls_token="<s>", eos_token="</s>", pad_token="<pad>", sep_token="</s>",
                 unk_token="<unk>")
    write_config(folder, dict(names, add_prefix_space=False, clean_up_tokenization_spaces=False, errors="replace",
                              mask_token="<mask>", model_max_length=512, tokenizer_class="RobertaTokenizer",
                              trim_offsets=True),
                 dict({k: token_dict(v) for k, v in names.items()}, mask_token=token_dict("<mask>", lstrip=True)))


def build_bloom(texts, folder):
    tok = train_bpe(texts, pre_tokenizers.Sequence([bl_split(BLOOM_PATTERN), bl_last()]),
                    special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=False)
    state = json.loads(tok.to_str())
    state["model"]["unk_token"] = "<unk>"
    tok = Tokenizer.from_str(json.dumps(state))
    save_tokenizer(tok, folder)
    names = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    write_config(folder, dict(names, add_prefix_space=False, clean_up_tokenization_spaces=False,
                              model_max_length="HUGE", padding_side="left", tokenizer_class="BloomTokenizerFast"),
                 names)


def build_bert(texts, folder, lowercase):
    tok = BertWordPieceTokenizer(clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase)
    tok.train_from_iterator(texts, vocab_size=1500, min_frequency=2, limit_alphabet=ALPHABET_SIZE,
                            initial_alphabet=alphabet(texts, tok._tokenizer.normalizer), show_progress=False,
                            special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    # The implementation sets BertProcessing only when [CLS]/[SEP] are known before training.
    tok.post_processor = processors.BertProcessing(sep=("[SEP]", tok.token_to_id("[SEP]")),
                                                   cls=("[CLS]", tok.token_to_id("[CLS]")))
    save_tokenizer(tok._tokenizer, folder)
    names = dict(cls_token="[CLS]", mask_token="[MASK]", pad_token="[PAD]", sep_token="[SEP]", unk_token="[UNK]")
    write_config(folder, dict(names, clean_up_tokenization_spaces=True, do_basic_tokenize=True,
                              do_lower_case=lowercase, model_max_length=512, never_split=None, strip_accents=None,
                              tokenize_chinese_chars=True, tokenizer_class="BertTokenizer"), names)


def build_unigram(texts, folder):
    tok = SentencePieceUnigramTokenizer(replacement="▁", add_prefix_space=True)
    tok.train_from_iterator(texts, vocab_size=1500, show_progress=False, special_tokens=["<pad>", "</s>", "<unk>"],
                            unk_token="<unk>")
    save_tokenizer(tok._tokenizer, folder)
    write_config(folder, {"clean_up_tokenization_spaces": False, "eos_token": "</s>", "model_max_length": "HUGE",
                          "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"})


def build_pretok_sequences(texts, folder):
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase(),
                                           normalizers.Strip(left=True, right=True)])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Punctuation(behavior="isolated"),
                                                 pre_tokenizers.Digits(individual_digits=False)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    trainer = trainers.WordPieceTrainer(vocab_size=1500, min_frequency=2, limit_alphabet=ALPHABET_SIZE,
                                        initial_alphabet=alphabet(texts, tok.normalizer), show_progress=False,
                                        special_tokens=["[UNK]", "[PAD]"])
    tok.train_from_iterator(texts, trainer=trainer)
    save_tokenizer(tok, folder)
    write_config(folder, {"clean_up_tokenization_spaces": False, "model_max_length": "HUGE", "pad_token": "[PAD]",
                          "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"})


def build_whitespace(texts, folder):
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    tok = train_bpe(texts, pre_tokenizers.Whitespace(), vocab_size=1500, special_tokens=specials,
                    normalizer=normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents(),
                                                     normalizers.Lowercase()]),
                    byte_level=False, unk="[UNK]", decoder=None)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    save_tokenizer(tok, folder)
    write_config(folder, {"clean_up_tokenization_spaces": True, "cls_token": "[CLS]", "mask_token": "[MASK]",
                          "model_max_length": "HUGE", "pad_token": "[PAD]", "sep_token": "[SEP]",
                          "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"})


# --------------------------------------------------------------------------------------------
# Families converted from SentencePiece models by transformers (the .model file is deleted afterwards)


def sp_sentences(texts):
    return [t.replace("\n", " ").replace("\r", " ") for t in texts if t.strip()]


def train_sp(texts, prefix, **options):
    defaults = dict(vocab_size=SP_VOCAB, character_coverage=0.98, num_threads=1, minloglevel=2,
                    max_sentence_length=8192, shuffle_input_sentence=False)
    defaults.update(options)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sp_sentences(texts)), model_prefix=str(prefix), **defaults)
    Path(str(prefix) + ".vocab").unlink()
    return Path(str(prefix) + ".model")


def llama_sp(texts, tmp):
    # Llama-2's trainer spec: BPE, identity normalization, byte_fallback, digits split, whitespace kept.
    return train_sp(texts, tmp / "llama", model_type="bpe", normalization_rule_name="identity", byte_fallback=True,
                    split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
                    add_dummy_prefix=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)


def finish_sp_folder(folder, config_updates=None):
    for p in folder.glob("*.model"):
        p.unlink()
    compact_tokenizer_json(folder)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(config_updates or {})
    # A saved add_prefix_space makes the Llama/T5 classes convert from the (deleted) .model file again.
    config.pop("add_prefix_space", None)
    text = json.dumps(dict(sorted(config.items())), ensure_ascii=False, indent=2).replace('"HUGE"', str(HUGE))
    path.write_text(text + "\n", encoding="utf-8")


def build_llama2(texts, folder, legacy):
    from transformers import LlamaTokenizerFast
    with tempfile.TemporaryDirectory() as tmp:
        model = llama_sp(texts, Path(tmp))
        # add_prefix_space=True explicitly: left out, the slow tokenizer handed to the converter gets None and
        # the conversion drops the Prepend normalizer / the Strip decoder (transformers 4.57).
        tok = LlamaTokenizerFast(vocab_file=str(model), legacy=legacy, from_slow=True, add_bos_token=True,
                                 add_eos_token=False, add_prefix_space=True)
        tok.save_pretrained(str(folder))
    finish_sp_folder(folder, {"legacy": legacy, "clean_up_tokenization_spaces": False, "model_max_length": "HUGE",
                              "tokenizer_class": "LlamaTokenizer"})


def build_gemma(texts, folder):
    from transformers import GemmaTokenizerFast
    with tempfile.TemporaryDirectory() as tmp:
        model = train_sp(texts, Path(tmp) / "gemma", model_type="bpe", normalization_rule_name="identity",
                         byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
                         remove_extra_whitespaces=False, add_dummy_prefix=False, pad_id=0, eos_id=1, bos_id=2,
                         unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
                         user_defined_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>", "\n", "\n\n", "\t",
                                               "▁▁", "▁▁▁▁"])
        tok = GemmaTokenizerFast(vocab_file=str(model), from_slow=True,
                                 additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
        tok.save_pretrained(str(folder))
    finish_sp_folder(folder, {"clean_up_tokenization_spaces": False, "model_max_length": "HUGE",
                              "spaces_between_special_tokens": False, "tokenizer_class": "GemmaTokenizer"})


def build_t5(texts, folder, rule):
    from transformers import T5TokenizerFast
    with tempfile.TemporaryDirectory() as tmp:
        model = train_sp(texts, Path(tmp) / "spiece", model_type="unigram", normalization_rule_name=rule,
                         vocab_size=1500, character_coverage=0.99, pad_id=0, eos_id=1, unk_id=2,
                         bos_id=-1)
        tok = T5TokenizerFast(vocab_file=str(model), extra_ids=10, from_slow=True, legacy=True, add_prefix_space=True)
        tok.save_pretrained(str(folder))
    finish_sp_folder(folder, {"model_max_length": 512, "tokenizer_class": "T5Tokenizer"})


def build_xlm_roberta(texts, folder):
    from transformers import XLMRobertaTokenizerFast
    with tempfile.TemporaryDirectory() as tmp:
        model = train_sp(texts, Path(tmp) / "sentencepiece.bpe", model_type="unigram",
                         normalization_rule_name="identity", vocab_size=1500, character_coverage=0.99)
        tok = XLMRobertaTokenizerFast(vocab_file=str(model), from_slow=True)
        tok.save_pretrained(str(folder))
    finish_sp_folder(folder, {"model_max_length": 512, "tokenizer_class": "XLMRobertaTokenizer"})


FAMILIES = {
    "starcoder_style": build_starcoder,
    "tekken_style": build_tekken,
    "gpt4o_style": build_gpt4o,
    "deepseek_v3_style": build_deepseek_v3,
    "gptneox_style": lambda texts, folder: build_gptneox(texts, folder, add_bos=False),
    "gptneox_bos_style": lambda texts, folder: build_gptneox(texts, folder, add_bos=True),
    "roberta_style": build_roberta,
    "llama2_style": lambda texts, folder: build_llama2(texts, folder, legacy=True),
    "mistral_style": lambda texts, folder: build_llama2(texts, folder, legacy=False),
    "gemma_style": build_gemma,
    "bert_style": lambda texts, folder: build_bert(texts, folder, lowercase=True),
    "bert_cased_style": lambda texts, folder: build_bert(texts, folder, lowercase=False),
    "t5_style": lambda texts, folder: build_t5(texts, folder, "identity"),
    "t5_nmt_style": lambda texts, folder: build_t5(texts, folder, "nmt_nfkc"),
    "xlm_roberta_style": build_xlm_roberta,
    "unigram_style": build_unigram,
    "pretok_sequences_style": build_pretok_sequences,
    "whitespace_style": build_whitespace,
    "bloom_style": build_bloom,
    "falcon_style": build_falcon,
}


# --------------------------------------------------------------------------------------------
# Expected outputs


def expected(name, folder, corpus):
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(folder))
    rows = []
    for text in corpus:
        ids = hf(text)["input_ids"]
        row = {"ids": ids}
        raw_ids = raw.encode(text).ids
        if raw_ids != ids:
            row["raw_ids"] = raw_ids
        row["decoded"] = hf.decode(ids)
        decoded_raw = raw.decode(ids, skip_special_tokens=False)
        if decoded_raw != row["decoded"]:
            row["decoded_raw"] = decoded_raw
        rows.append(row)
    write_jsonl(OUT / "expected" / f"{name}.jsonl", rows)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    facts = {
        "class": type(hf).__name__,
        "tokenizer_class": config.get("tokenizer_class"),
        "vocab_size": hf.vocab_size,
        "len": len(hf),
        "all_special_ids": hf.all_special_ids,
        "all_special_tokens": hf.all_special_tokens,
        "bos_token_id": hf.bos_token_id,
        "eos_token_id": hf.eos_token_id,
        "pad_token_id": hf.pad_token_id,
        "unk_token_id": hf.unk_token_id,
        "empty_ids": hf("")["input_ids"],
        "raw_empty_ids": raw.encode("").ids,
        "model_max_length": hf.model_max_length if hf.model_max_length < 1e20 else None,
    }
    n_raw = sum("raw_ids" in r for r in rows)
    n_dec = sum("decoded_raw" in r for r in rows)
    print(f"{name:24} {type(hf).__name__:26} vocab {hf.vocab_size:5} len {len(hf):5} "
          f"tokens {sum(len(r['ids']) for r in rows):6}  raw_ids!=ids {n_raw:3}  decoded_raw!=decoded {n_dec:3}")
    return facts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fixtures", type=Path, nargs="?", default=FIXTURES,
                    help="Modalities fixtures directory holding data/tokenizer/hf_gpt2 (default: ../shared/fixtures/modalities beside the checkout)")
    ap.add_argument("--retrain", action="store_true", help="rebuild the corpus and retrain the tokenizers even if present")
    ap.add_argument("--only", nargs="*", help="(re)build only these families (implies retraining them)")
    args = ap.parse_args()
    print(f"tokenizers {tokenizers.__version__}, transformers {transformers.__version__}, sentencepiece {spm.__version__}")
    multilingual = load_multilingual()
    corpus_path = OUT / "corpus.jsonl"
    if args.retrain or not corpus_path.exists():
        write_jsonl(corpus_path, [{"text": t} for t in make_corpus(multilingual)])
    with open(corpus_path, encoding="utf-8") as f:
        corpus = [json.loads(line)["text"] for line in f]
    train_texts = multilingual + [t for t in corpus if t.strip()]

    for name, build in FAMILIES.items():
        folder = OUT / name
        rebuild = args.retrain or not (folder / "tokenizer.json").exists() or (args.only and name in args.only)
        if rebuild:
            for p in folder.glob("*"):
                p.unlink()
            build(train_texts, folder)
            AutoTokenizer.from_pretrained(str(folder))  # must load without a .model / vocab file

    folders = {
        "gpt2": args.fixtures / "data/tokenizer/hf_gpt2",
        "llama3_style": HF_DATA / "llama3_style",
        "qwen2_style": HF_DATA / "qwen2_style",
    }
    folders.update({name: OUT / name for name in FAMILIES})
    facts = {name: expected(name, folder, corpus) for name, folder in folders.items()}
    write_rows_json(OUT / "expected" / "facts.json", facts)


if __name__ == "__main__":
    sys.exit(main())
