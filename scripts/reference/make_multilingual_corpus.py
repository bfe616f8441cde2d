#!/usr/bin/env python3
"""Writes data/multilingual/multilingual.jsonl, the tokenizer verification corpus.

Deterministic (fixed seed, no external input): every run produces the same bytes.
The sentences below were written for this project; see data/multilingual/README.md.
Each output line is one JSON object {"text": ...} (json.dumps, ensure_ascii=False).

Usage: python3 scripts/reference/make_multilingual_corpus.py [output.jsonl]
"""

import json
import random
import sys
from pathlib import Path

SEED = 20260121
NUM_DOCUMENTS = 1500

# --- Sentences per script (our own text) -----------------------------------------------------

LATIN = [
    "The quick brown fox doesn't jump over the lazy dog; it's far too tired.",
    "We're testing tokenizers, and they'll have to cope with everything we've got.",
    "I'd say the results are fine, but you'LL want to check them twice.",
    "She said: \"Don't touch that!\" and then left the room.",
    "Crème brûlée, façade, naïve, coöperate, jalapeño, smörgåsbord and Ærøskøbing.",
    "Straße, Maß, Größe, Übermut und Äpfel gehören zusammen.",
    "Le cœur a ses raisons que la raison ne connaît point, dit-on à l'école.",
    "¿Dónde está la biblioteca? ¡Allí, junto al árbol!",
    "Český jazyk má háčky: ř, ž, š, č, ě, ů a také ď, ť, ň.",
    "Zażółć gęślą jaźń — to zdanie zawiera wszystkie polskie znaki.",
    "Vietnamese uses many marks: Tiếng Việt có nhiều dấu như ă, â, ê, ô, ơ, ư, đ.",
    "Türkçe: ığüşöç İĞÜŞÖÇ; dotted and dotless i are different letters.",
    "Íslenska hefur þ, ð og æ; færeyskt hevur eisini ø.",
    "Lietuvių kalba: ą, č, ę, ė, į, š, ų, ū, ž.",
    "Română are ș și ț (cu virgulă), nu ş și ţ (cu sedilă).",
    "THE MEETING IS AT NOON, ISN'T IT? YES, IT'S AT NOON.",
    "Mr. O'Neil's dog's bone wasn't where he'd left it.",
]

CYRILLIC = [
    "Съешь же ещё этих мягких французских булок да выпей чаю.",
    "Привет, мир! Как дела? Всё хорошо, спасибо.",
    "Україна має свої літери: ї, є, ґ та апостроф у слові «м'ята».",
    "Български език: Ъъ, Щщ и Юю се срещат често.",
    "Српски: Љубав, Њива, Ђак, Ћуприја и Џеп.",
    "В 2025 году было 365 дней, а в 2028-м будет 366.",
]

GREEK = [
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "Καλημέρα σας! Τι κάνετε σήμερα;",
    "Η γλώσσα έχει τόνους: ά, έ, ή, ί, ό, ύ, ώ και διαλυτικά: ϊ, ϋ, ΐ, ΰ.",
    "Το π είναι περίπου 3,14159 και το φ περίπου 1,618.",
]

ARABIC = [
    "مرحبا بالعالم! كيف حالك اليوم؟",
    "اللغة العربية تكتب من اليمين إلى اليسار.",
    "الأرقام العربية: ٠١٢٣٤٥٦٧٨٩ والأرقام الغربية: 0123456789.",
    "قال المعلم: «اقرأ الكتاب قبل الامتحان».",
    "فارسی هم با این خط نوشته می‌شود: پ، چ، ژ، گ و ۱۲۳۴.",
]

HEBREW = [
    "שלום עולם! מה שלומך היום?",
    "העברית נכתבת מימין לשמאל, עם ניקוד: שָׁלוֹם.",
    "יש לי 3 תפוחים ו־12 תפוזים.",
]

DEVANAGARI = [
    "नमस्ते दुनिया! आप कैसे हैं?",
    "हिन्दी भाषा देवनागरी लिपि में लिखी जाती है।",
    "संस्कृतम् एका प्राचीना भाषा अस्ति।",
    "मेरे पास ५ किताबें और 7 कलम हैं।",
]

THAI = [
    "สวัสดีชาวโลก วันนี้อากาศดีมาก",
    "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ",
    "ผมมีแมวสองตัวและสุนัขหนึ่งตัว",
]

CJK = [
    "你好，世界！今天天气很好。",
    "我们正在测试分词器，它必须处理中文、日文和韩文。",
    "漢字は中国から伝わりました。",
    "這是一個繁體中文的句子，包含「引號」和《書名號》。",
    "北京是中国的首都，上海是最大的城市。",
    "价格是１２３元，约合17.5欧元。",
]

HANGUL = [
    "안녕하세요, 세계! 오늘 날씨가 좋네요.",
    "한국어는 한글로 씁니다. 자음과 모음이 모여 음절을 만듭니다.",
    "저는 학생이고, 서울에 삽니다.",
]

JAPANESE = [
    "こんにちは、世界！元気ですか？",
    "カタカナとひらがなと漢字を混ぜて書きます。",
    "東京スカイツリーの高さは634メートルです。",
    "ｶﾀｶﾅ（半角）とカタカナ（全角）は違います。",
    "すもももももももものうち。",
]

OTHER_SCRIPTS = [
    "Հայերեն այբուբենը ստեղծել է Մեսրոպ Մաշտոցը։",
    "ქართული ენა ძალიან ლამაზია.",
    "বাংলা ভাষা খুব সুন্দর।",
    "தமிழ் ஒரு பழமையான மொழி.",
    "ᐃᓄᒃᑎᑐᑦ ᑎᑎᕋᐅᓯᖅ",
    "አማርኛ በግዕዝ ፊደል ይጻፋል።",
    "ᠮᠣᠩᠭᠣᠯ ᠪᠢᠴᠢᠭ",
    "𝔐𝔞𝔱𝔥 𝔣𝔯𝔞𝔨𝔱𝔲𝔯 and 𝐛𝐨𝐥𝐝 letters live outside the BMP.",
]

EMOJI = [
    "I love pizza 🍕 and coffee ☕!",
    "Family: 👨‍👩‍👧‍👦, couple: 👩‍❤️‍👨, rainbow flag: 🏳️‍🌈.",
    "Thumbs up in all tones: 👍 👍🏻 👍🏼 👍🏽 👍🏾 👍🏿",
    "Flags: 🇩🇪 🇫🇷 🇯🇵 🇺🇸 🇧🇷 🇰🇷 🇪🇺",
    "Keycaps: 1️⃣ 2️⃣ #️⃣ and text vs emoji style: ☺ ☺️",
    "🚀🚀🚀 launch! 🔥💯✨",
    "Scientist 🧑🏽‍🔬 and pilot 👩🏿‍✈️ met a 🐈‍⬛.",
]

COMBINING = [
    # decomposed (base letter + combining mark) next to precomposed forms
    "Cafe\u0301 vs Caf\u00e9, n\u0303 vs \u00f1, A\u030a vs \u00c5, \u212b (angstrom sign).",
    "Zalgo: Z\u0351\u0358a\u0316\u034el\u0357\u0301g\u0362o\u0352\u0307!",
    "Hangul jamo: \u1100\u1161\u11a8 vs \uac01; ligature \ufb01 and \ufb02.",
    "Vietnamese decomposed: Vie\u0302\u0323t Nam, precomposed: Vi\u1ec7t Nam.",
    "Full-width: \uff21\uff22\uff23\uff11\uff12\uff13 and superscripts x\u00b2 y\u00b3 \u00bd.",
    "Devanagari with nukta: \u0915\u093c vs \u0958.",
]

CODE = [
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "for (int i = 0; i < n; ++i) {\n\tsum += v[i] * 2;\n}",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "const f = (x) => x ** 2; // squares\nconsole.log(f(12));",
    "if [ -f ~/.bashrc ]; then source ~/.bashrc; fi",
    "#include <vector>\nstd::vector<int> v{1, 2, 3};\nauto it = v.begin();",
    "{\"key\": [1, 2.5, -3e10, true, null], \"nested\": {\"a\": \"b\"}}",
    "x = re.compile(r\"(?i)\\b[a-z]+\\d{2,4}\\b\")",
    "<div class=\"main\"><p>Hello &amp; welcome</p></div>",
    "    indented    with    spaces\n\t\ttabs\n",
]

URLS = [
    "Visit https://example.com/path/to/page?query=1&lang=en#section for details.",
    "Mail me at someone.name+tag@example.org or call +49 (0)30 1234-5678.",
    "ftp://files.example.net/pub/archive-2024_v2.tar.gz and file:///home/user/notes.txt",
    "See http://例え.jp/パス and https://münchen.example/straße?q=ä.",
]

NUMBERS = [
    "0", "7", "42", "123", "2024", "31337", "123456", "3.14159265358979",
    "1,234,567.89", "1.234.567,89", "-273.15", "6.022e23", "0x1F40", "0b101010",
    "007", "1000000000000000000000", "12:34:56", "2026-01-21", "50%", "$19.99", "€5,00",
    "99999999999999", "1st 2nd 3rd 4th", "v1.2.3-rc.4",
]

WHITESPACE = [
    "   leading spaces",
    "trailing spaces   ",
    "many      inner       spaces",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\nline four",
    "windows\r\nline\r\nendings\r\n",
    "non\u00a0breaking\u00a0spaces",
    "ideographic\u3000space\u3000here",
    "mixed \t \n \r\n \u00a0 \u3000 end",
    "thin\u2009space, em\u2003space, zero\u200bwidth and\u2028line separator",
    "\n\n\n",
    "  \n  \n  ",
]

CONTRACTIONS = [
    "It's what they're saying: you've got to, we'll see, I'm sure, he'd know, don't.",
    "IT'S WHAT THEY'RE SAYING: YOU'VE GOT TO, WE'LL SEE, I'M SURE, HE'D KNOW.",
    "Mixed case: It'S, they'Re, you'Ve, we'Ll, I'M, he'D.",
    "Quotes inside words: rock 'n' roll, 'tis, o'clock, ma'am, y'all.",
    "Curly apostrophes: it’s, they’re, don’t.",
]

SPECIAL_LITERALS = [
    "This text contains <|endoftext|> in the middle.",
    "<|endoftext|>",
    "Ends with the marker<|endoftext|>",
    "<|endoftext|>Starts with the marker",
    "Twice: <|endoftext|><|endoftext|> and spaced < |endoftext| >.",
    "Llama style markers: <|begin_of_text|>hello<|eot_id|> and <|start_header_id|>user<|end_header_id|>",
    "Almost markers: <|endoftext| and |endoftext|> and <|ENDOFTEXT|>.",
]

EDGE_CASES = [
    " ",
    "  ",
    "     ",
    "\t",
    "a",
    "🙂",
    "👨‍👩‍👧‍👦",
    "'",
    "''''",
    "'s",
    "...",
    "!!!???",
    "\u0301",
    "x" * 300,
    "ab" * 150,
    "😀" * 40,
    "1" * 64,
    "a\u0301" * 30,
    "\u00a0",
    "\u3000",
    "\r\n",
    "ﷺ",
    "\ufeffBOM at start",
]

POOLS = {
    "latin": LATIN, "cyrillic": CYRILLIC, "greek": GREEK, "arabic": ARABIC, "hebrew": HEBREW,
    "devanagari": DEVANAGARI, "thai": THAI, "cjk": CJK, "hangul": HANGUL, "japanese": JAPANESE,
    "other": OTHER_SCRIPTS, "emoji": EMOJI, "combining": COMBINING, "code": CODE, "urls": URLS,
    "whitespace": WHITESPACE, "contractions": CONTRACTIONS, "special": SPECIAL_LITERALS,
}

SEPARATORS = [" ", " ", " ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u3000", " \n ", ""]


def number(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return rng.choice(NUMBERS)
    digits = rng.randint(1, 25)
    return str(rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1))


def document(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.08:
        return rng.choice(EDGE_CASES)
    pools = list(POOLS)
    if kind < 0.40:
        # Single-script paragraph.
        pool = POOLS[rng.choice(pools)]
        parts = [rng.choice(pool) for _ in range(rng.randint(1, 6))]
    else:
        # Mixed document: sentences from several scripts, numbers, separators.
        parts = []
        for _ in range(rng.randint(2, 10)):
            r = rng.random()
            if r < 0.15:
                parts.append(number(rng))
            elif r < 0.20:
                parts.append(rng.choice(EDGE_CASES))
            else:
                parts.append(rng.choice(POOLS[rng.choice(pools)]))
    out = parts[0]
    for p in parts[1:]:
        out += rng.choice(SEPARATORS) + p
    return out


def main() -> None:
    out_path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "data/multilingual/multilingual.jsonl"
    rng = random.Random(SEED)
    docs = []
    # Every sentence and edge case once on its own, then the random mixes.
    for pool in POOLS.values():
        docs.extend(pool)
    docs.extend(EDGE_CASES)
    docs.extend(NUMBERS)
    docs.append(" ".join(NUMBERS))
    while len(docs) < NUM_DOCUMENTS:
        docs.append(document(rng))
    with open(out_path, "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
