#!/usr/bin/env python3
"""Unicode tables for the hf_tokenizer plugin, probed from Hugging Face `tokenizers`.

Each Hugging Face component classifies code points with its own Unicode data, and
none of them matches the C++ side's PCRE2 10.42 (Unicode 14) or utf8proc 2.8
(Unicode 15.0) for newer code points. This script does not read any Unicode data
file: it runs the real library (`tokenizers` 0.22.2, pinned in
scripts/bench-requirements.txt) over every code point U+0000..U+10FFFF except the
surrogates (which cannot occur in UTF-8 text) and records what each component does:

  A. Oniguruma (onig crate; `Split`/`Replace` regexes, ByteLevel's GPT-2 regex):
     \\p{X} for every general category, \\s \\w \\d \\h, \\p{Alphabetic},
     \\p{White_Space} and some scripts, probed with Split(Regex(p), "removed") over
     one string holding every code point (the kept pieces are the non-matches);
     each class is probed again under (?i).
  B. Rust std (the compiler's Unicode): char::is_numeric (`Digits`),
     char::is_whitespace (`WhitespaceSplit`, `Strip`, `BertPreTokenizer`),
     char::to_lowercase (`Lowercase`, BertNormalizer's lowercase), probed per code
     point and on the whole text (context: final sigma, ...).
  C. The `unicode_categories` crate (`Punctuation`, `BertPreTokenizer`,
     `BertNormalizer`): punctuation, what clean_text removes or turns into ' ',
     which characters handle_chinese_chars pads, which strip_accents drops after
     NFD (Mn), and the order of BertNormalizer's steps. Also the `StripAccents`
     normalizer, which drops unicode-normalization-alignments' combining marks.
  D. The Rust `regex` crate: \\w and \\s of the `Whitespace` pre-tokenizer
     (\\w+|[^\\w\\s]+) and of added tokens (single_word uses ^\\w / \\w$,
     lstrip/rstrip use \\s*$ / ^\\s*), probed through both.
  E. `unicode-normalization-alignments` (NFC/NFD/NFKC/NFKD normalizers): every code
     point alone and in contexts that expose combining classes, composition and
     Hangul, compared with utf8proc 2.8 (libutf8proc.so.2 through ctypes, called
     with the C++ side's flags). kHfNormalizationUnknown holds the code points
     utf8proc treats as non-inert (combining class, decomposition or composition)
     while HF treats them as inert starters; the plan "split at those, pass them
     through, utf8proc the rest" is checked against HF on every probe.

Writes plugins/hf_tokenizer/src/unicode_tables.inc (sorted, merged [first, last]
ranges and the lowercase map) and plugins/hf_tokenizer/tests/data/unicode_probe_facts.json
(the Unicode version each component corresponds to, semantics found, and sample
code points where the tables differ from PCRE2 10.42 / utf8proc 2.8, for tests).
Versions are inferred by comparing each probed set with the code points assigned
up to each Unicode version (ages: perl's Unicode::UCD up to 14.0, plus the
AGES_15_TO_17 list below); the PCRE2 / utf8proc comparisons need Debian's
libpcre2-32.so.0 and libutf8proc.so.2 and are skipped when those are missing.

Usage (about three minutes, one core; deterministic):

    TOKENIZERS_PARALLELISM=false .deps/bench/bin/python scripts/reference/make_unicode_tables.py
"""

import argparse
import ctypes
import ctypes.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"

import tokenizers  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT_INC = ROOT / "plugins/hf_tokenizer/src/unicode_tables.inc"
OUT_FACTS = ROOT / "plugins/hf_tokenizer/tests/data/unicode_probe_facts.json"
EXPECTED_TOKENIZERS = "0.22.2"

MAX_CP = 0x110000
CPS = [c for c in range(MAX_CP) if not 0xD800 <= c <= 0xDFFF]
TEXT = "".join(map(chr, CPS))

# Code points assigned in Unicode 15.0 .. 17.0 (first-last:version:general category),
# from the UCD (via unicodedata2 15.0.0 .. 17.0.0). Ages up to 14.0 come from perl.
AGES_15_TO_17 = """
88F:17.0:Lo 897:16.0:Mn C5C:17.0:Lo CDC:17.0:Lo CF3:15.0:Mc ECE:15.0:Mn 1ACF-1ADD:17.0:Mn 1AE0-1AEB:17.0:Mn
1B4E-1B4F:16.0:Po 1B7F:16.0:Po 1C89:16.0:Lu 1C8A:16.0:Ll 20C1:17.0:Sc 2427-2429:16.0:So 2B96:17.0:So
2FFC-2FFF:15.1:So 31E4-31E5:16.0:So 31EF:15.1:So A7CB-A7CC:16.0:Lu A7CD:16.0:Ll A7CE:17.0:Lu A7CF:17.0:Ll
A7D2:17.0:Lu A7D4:17.0:Lu A7DA:16.0:Lu A7DB:16.0:Ll A7DC:16.0:Lu A7F1:17.0:Lm FBC3-FBD2:17.0:So
FD90-FD91:17.0:So FDC8-FDCE:17.0:So 105C0-105F3:16.0:Lo 10940-10959:17.0:Lo 10D40-10D49:16.0:Nd
10D4A-10D4D:16.0:Lo 10D4E:16.0:Lm 10D4F:16.0:Lo 10D50-10D65:16.0:Lu 10D69-10D6D:16.0:Mn 10D6E:16.0:Pd
10D6F:16.0:Lm 10D70-10D85:16.0:Ll 10D8E-10D8F:16.0:Sm 10EC2-10EC4:16.0:Lo 10EC5:17.0:Lm 10EC6-10EC7:17.0:Lo
10ED0:17.0:Po 10ED1-10ED8:17.0:So 10EFA-10EFB:17.0:Mn 10EFC:16.0:Mn 10EFD-10EFF:15.0:Mn 1123F-11240:15.0:Lo
11241:15.0:Mn 11380-11389:16.0:Lo 1138B:16.0:Lo 1138E:16.0:Lo 11390-113B5:16.0:Lo 113B7:16.0:Lo
113B8-113BA:16.0:Mc 113BB-113C0:16.0:Mn 113C2:16.0:Mc 113C5:16.0:Mc 113C7-113CA:16.0:Mc 113CC-113CD:16.0:Mc
113CE:16.0:Mn 113CF:16.0:Mc 113D0:16.0:Mn 113D1:16.0:Lo 113D2:16.0:Mn 113D3:16.0:Lo 113D4-113D5:16.0:Po
113D7-113D8:16.0:Po 113E1-113E2:16.0:Mn 116D0-116E3:16.0:Nd 11B00-11B09:15.0:Po 11B60:17.0:Mn 11B61:17.0:Mc
11B62-11B64:17.0:Mn 11B65:17.0:Mc 11B66:17.0:Mn 11B67:17.0:Mc 11BC0-11BE0:16.0:Lo 11BE1:16.0:Po
11BF0-11BF9:16.0:Nd 11DB0-11DD8:17.0:Lo 11DD9:17.0:Lm 11DDA-11DDB:17.0:Lo 11DE0-11DE9:17.0:Nd
11F00-11F01:15.0:Mn 11F02:15.0:Lo 11F03:15.0:Mc 11F04-11F10:15.0:Lo 11F12-11F33:15.0:Lo 11F34-11F35:15.0:Mc
11F36-11F3A:15.0:Mn 11F3E-11F3F:15.0:Mc 11F40:15.0:Mn 11F41:15.0:Mc 11F42:15.0:Mn 11F43-11F4F:15.0:Po
11F50-11F59:15.0:Nd 11F5A:16.0:Mn 1342F:15.0:Lo 13439-1343F:15.0:Cf 13440:15.0:Mn 13441-13446:15.0:Lo
13447-13455:15.0:Mn 13460-143FA:16.0:Lo 16100-1611D:16.0:Lo 1611E-16129:16.0:Mn 1612A-1612C:16.0:Mc
1612D-1612F:16.0:Mn 16130-16139:16.0:Nd 16D40-16D42:16.0:Lm 16D43-16D6A:16.0:Lo 16D6B-16D6C:16.0:Lm
16D6D-16D6F:16.0:Po 16D70-16D79:16.0:Nd 16EA0-16EB8:17.0:Lu 16EBB-16ED3:17.0:Ll 16FF2-16FF3:17.0:Lm
16FF4-16FF6:17.0:Nl 187F8-187FF:17.0:Lo 18CFF:16.0:Lo 18D09-18D1E:17.0:Lo 18D80-18DF2:17.0:Lo 1B132:15.0:Lo
1B155:15.0:Lo 1CC00-1CCEF:16.0:So 1CCF0-1CCF9:16.0:Nd 1CCFA-1CCFC:17.0:So 1CD00-1CEB3:16.0:So
1CEBA-1CED0:17.0:So 1CEE0-1CEEF:17.0:So 1CEF0:17.0:Sm 1D2C0-1D2D3:15.0:No 1DF25-1DF2A:15.0:Ll
1E030-1E06D:15.0:Lm 1E08F:15.0:Mn 1E4D0-1E4EA:15.0:Lo 1E4EB:15.0:Lm 1E4EC-1E4EF:15.0:Mn 1E4F0-1E4F9:15.0:Nd
1E5D0-1E5ED:16.0:Lo 1E5EE-1E5EF:16.0:Mn 1E5F0:16.0:Lo 1E5F1-1E5FA:16.0:Nd 1E5FF:16.0:Po 1E6C0-1E6DE:17.0:Lo
1E6E0-1E6E2:17.0:Lo 1E6E3:17.0:Mn 1E6E4-1E6E5:17.0:Lo 1E6E6:17.0:Mn 1E6E7-1E6ED:17.0:Lo 1E6EE-1E6EF:17.0:Mn
1E6F0-1E6F4:17.0:Lo 1E6F5:17.0:Mn 1E6FE:17.0:Lo 1E6FF:17.0:Lm 1F6D8:17.0:So 1F6DC:15.0:So 1F774-1F776:15.0:So
1F777-1F77A:17.0:So 1F77B-1F77F:15.0:So 1F7D9:15.0:So 1F8B2-1F8BB:16.0:So 1F8C0-1F8C1:16.0:So
1F8D0-1F8D8:17.0:Sm 1FA54-1FA57:17.0:So 1FA75-1FA77:15.0:So 1FA87-1FA88:15.0:So 1FA89:16.0:So 1FA8A:17.0:So
1FA8E:17.0:So 1FA8F:16.0:So 1FAAD-1FAAF:15.0:So 1FABB-1FABD:15.0:So 1FABE:16.0:So 1FABF:15.0:So 1FAC6:16.0:So
1FAC8:17.0:So 1FACD:17.0:So 1FACE-1FACF:15.0:So 1FADA-1FADB:15.0:So 1FADC:16.0:So 1FADF:16.0:So 1FAE8:15.0:So
1FAE9:16.0:So 1FAEA:17.0:So 1FAEF:17.0:So 1FAF7-1FAF8:15.0:So 1FBCB-1FBEF:16.0:So 1FBFA:17.0:So 2B739:15.0:Lo
2B73A-2B73F:17.0:Lo 2CEA2-2CEAD:17.0:Lo 2EBF0-2EE5D:15.1:Lo 31350-323AF:15.0:Lo 323B0-33479:17.0:Lo
"""

UNICODE_VERSIONS = ["1.1", "2.0", "2.1", "3.0", "3.1", "3.2", "4.0", "4.1", "5.0", "5.1", "5.2", "6.0",
                    "6.1", "6.2", "6.3", "7.0", "8.0", "9.0", "10.0", "11.0", "12.0", "12.1", "13.0",
                    "14.0", "15.0", "15.1", "16.0", "17.0"]
VKEY = {v: i for i, v in enumerate(UNICODE_VERSIONS)}
UNASSIGNED = len(UNICODE_VERSIONS)  # age index of a code point not assigned in 17.0


# ----------------------------------------------------------------------------- sets and ranges

def flags_of(cps):
    f = bytearray(MAX_CP)
    for c in cps:
        f[c] = 1
    return f


def members(flags):
    return [c for c in CPS if flags[c]]


def to_ranges(flags):
    out = []
    for c in CPS:
        if not flags[c]:
            continue
        if out and out[-1][1] + 1 == c:
            out[-1][1] = c
        else:
            out.append([c, c])
    return out


def count(flags):
    return sum(flags[c] for c in CPS)


def diff(a, b):
    """Code points in a but not in b (both flag arrays)."""
    return [c for c in CPS if a[c] and not b[c]]


def samples(cps, k=8):
    """Up to k code points spread over the sorted list (deterministic)."""
    if len(cps) <= k:
        return [f"U+{c:04X}" for c in cps]
    step = (len(cps) - 1) / (k - 1)
    return [f"U+{cps[round(i * step)]:04X}" for i in range(k)]


# ----------------------------------------------------------------------------- probing helpers

def split_removed(pattern):
    """Code points matched by an Oniguruma pattern: Split(..., "removed") drops the matches."""
    kept = bytearray(len(CPS))
    for _, (a, b) in pre_tokenizers.Split(Regex(pattern), "removed").pre_tokenize_str(TEXT):
        kept[a:b] = b"\x01" * (b - a)
    f = bytearray(MAX_CP)
    for i, c in enumerate(CPS):
        if not kept[i]:
            f[c] = 1
    return f


def isolate(pretok, sep):
    """Run pretok over sep X0 sep X1 sep ... and classify each code point X:
    'removed' (in no piece), 'alone' (a piece of its own) or 'merged' (part of a
    longer piece). Returns three flag arrays."""
    text = sep + sep.join(map(chr, CPS)) + sep  # X_i sits at char offset 1 + 2 i
    covered = bytearray(len(text))
    alone = bytearray(len(text))
    for _, (a, b) in pretok.pre_tokenize_str(text):
        covered[a:b] = b"\x01" * (b - a)
        if b - a == 1:
            alone[a] = 1
    removed_f, alone_f, merged_f = bytearray(MAX_CP), bytearray(MAX_CP), bytearray(MAX_CP)
    for i, c in enumerate(CPS):
        p = 1 + 2 * i
        if not covered[p]:
            removed_f[c] = 1
        elif alone[p]:
            alone_f[c] = 1
        else:
            merged_f[c] = 1
    return removed_f, alone_f, merged_f


def per_cp(fn):
    return {c: fn(chr(c)) for c in CPS}


# ----------------------------------------------------------------------------- Unicode ages

def load_ages():
    """Age index (into UNICODE_VERSIONS) per code point, or None when perl is missing."""
    try:
        out = subprocess.run(
            ["perl", "-MUnicode::UCD", "-e",
             'my ($l,$m)=Unicode::UCD::prop_invmap("Age"); print Unicode::UCD::UnicodeVersion(),"\\n";'
             ' for my $i (0..$#$l){print "$l->[$i] $m->[$i]\\n"}'],
            capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return None, None
    perl_version = out[0]
    age = [UNASSIGNED] * MAX_CP
    rows = [line.split() for line in out[1:] if line.strip()]
    for i, (start, v) in enumerate(rows):
        end = int(rows[i + 1][0]) if i + 1 < len(rows) else MAX_CP
        if v == "Unassigned":
            continue
        if v.startswith("V"):  # older perls spell V1_1
            v = v[1:].replace("_", ".")
        k = VKEY[v]
        for c in range(int(start), end):
            age[c] = k
    for c in list(range(0xFDD0, 0xFDF0)) + [p * 0x10000 + k for p in range(17) for k in (0xFFFE, 0xFFFF)]:
        age[c] = UNASSIGNED  # noncharacters have an age but general category Cn: count them as unassigned
    cat17 = {}
    for item in AGES_15_TO_17.split():
        span, v, cat = item.split(":")
        a, _, b = span.partition("-")
        for c in range(int(a, 16), int(b or a, 16) + 1):
            if age[c] == UNASSIGNED or age[c] > VKEY[v]:
                age[c] = VKEY[v]
            cat17[c] = cat
    return age, {"perl_unicode": perl_version, "cat17": cat17}


def _age_name(age, c):
    if age is None:
        return "?"
    return UNICODE_VERSIONS[age[c]] if age[c] < UNASSIGNED else "unassigned"


def infer_version(probed, reference, age, lo="1.1"):
    """The Unicode version V minimising |probed xor (reference and age <= V)|; reference is a
    flag array of the code points that belong to the class in current Unicode (17.0)."""
    if age is None:
        return None
    base = 0  # probed but not in the reference: a mismatch for every V
    hist_in = [0] * (UNASSIGNED + 1)  # reference code points by age: probed / not probed
    hist_out = [0] * (UNASSIGNED + 1)
    for c in CPS:
        if reference[c]:
            (hist_in if probed[c] else hist_out)[age[c]] += 1
        elif probed[c]:
            base += 1
    counts = {}
    for v in UNICODE_VERSIONS[VKEY[lo]:]:
        k = VKEY[v]
        # probed reference members newer than V, plus unprobed ones not newer than V
        counts[v] = base + sum(hist_in[k + 1:]) + sum(hist_out[:k + 1])
    low = min(counts.values())
    tied = [v for v in counts if counts[v] == low]  # consecutive: the count is unimodal in practice
    keys = UNICODE_VERSIONS[max(VKEY[tied[0]] - 1, VKEY[lo]):VKEY[tied[-1]] + 2]
    version = tied[0] if len(tied) == 1 else f"{tied[0]}..{tied[-1]}"
    return {"version": version, "mismatches": {v: counts[v] for v in keys}}


# ----------------------------------------------------------------------------- PCRE2 / utf8proc

class Pcre2:
    """Code points matched by a pattern in PCRE2 (32-bit library, UTF | UCP)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libpcre2-32.so.0")
        L = self.lib
        L.pcre2_compile_32.restype = ctypes.c_void_p
        L.pcre2_compile_32.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32,
                                       ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_size_t),
                                       ctypes.c_void_p]
        L.pcre2_match_data_create_from_pattern_32.restype = ctypes.c_void_p
        L.pcre2_match_data_create_from_pattern_32.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        L.pcre2_match_32.restype = ctypes.c_int
        L.pcre2_match_32.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                     ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p]
        L.pcre2_get_ovector_pointer_32.restype = ctypes.POINTER(ctypes.c_size_t)
        L.pcre2_get_ovector_pointer_32.argtypes = [ctypes.c_void_p]
        L.pcre2_code_free_32.argtypes = [ctypes.c_void_p]
        L.pcre2_match_data_free_32.argtypes = [ctypes.c_void_p]
        L.pcre2_config_32.argtypes = [ctypes.c_uint32, ctypes.c_void_p]
        buf = ctypes.create_string_buffer(64 * 4)
        L.pcre2_config_32(11, buf)  # PCRE2_CONFIG_VERSION
        self.version = buf.raw.decode("utf-32-le").split("\0")[0]
        L.pcre2_config_32(10, buf)  # PCRE2_CONFIG_UNICODE_VERSION
        self.unicode = buf.raw.decode("utf-32-le").split("\0")[0]
        self.subject = (ctypes.c_uint32 * len(CPS))(*CPS)

    def matches(self, pattern):
        pattern = f"(?:{pattern})+"  # one match per run keeps the number of calls small
        pat = (ctypes.c_uint32 * len(pattern))(*map(ord, pattern))
        err, off = ctypes.c_int(), ctypes.c_size_t()
        code = self.lib.pcre2_compile_32(pat, len(pattern), 0x00080000 | 0x00020000, ctypes.byref(err),
                                         ctypes.byref(off), None)
        if not code:
            return None
        md = self.lib.pcre2_match_data_create_from_pattern_32(code, None)
        f = bytearray(MAX_CP)
        start = 0
        while start < len(CPS):
            no_utf_check = 0x40000000 if start else 0  # the subject is checked once
            rc = self.lib.pcre2_match_32(code, self.subject, len(CPS), start, no_utf_check, md, None)
            if rc < 0:
                break
            ov = self.lib.pcre2_get_ovector_pointer_32(md)
            a, b = ov[0], ov[1]
            for i in range(a, b):
                f[CPS[i]] = 1
            start = b if b > a else b + 1
        self.lib.pcre2_match_data_free_32(md)
        self.lib.pcre2_code_free_32(code)
        return f


class Utf8proc:
    STABLE, COMPAT, COMPOSE, DECOMPOSE = 1 << 1, 1 << 2, 1 << 3, 1 << 4
    FORMS = {"NFC": STABLE | COMPOSE, "NFD": STABLE | DECOMPOSE,
             "NFKC": STABLE | COMPOSE | COMPAT, "NFKD": STABLE | DECOMPOSE | COMPAT}

    class Property(ctypes.Structure):
        _fields_ = [("category", ctypes.c_int16), ("combining_class", ctypes.c_int16),
                    ("bidi_class", ctypes.c_int16), ("decomp_type", ctypes.c_int16),
                    ("decomp_seqindex", ctypes.c_uint16), ("casefold_seqindex", ctypes.c_uint16),
                    ("uppercase_seqindex", ctypes.c_uint16), ("lowercase_seqindex", ctypes.c_uint16),
                    ("titlecase_seqindex", ctypes.c_uint16), ("comb_index", ctypes.c_uint16)]

    def __init__(self):
        L = self.lib = ctypes.CDLL("libutf8proc.so.2")
        self.libc = ctypes.CDLL(ctypes.util.find_library("c"))
        self.libc.free.argtypes = [ctypes.c_void_p]
        L.utf8proc_version.restype = ctypes.c_char_p
        L.utf8proc_unicode_version.restype = ctypes.c_char_p
        self.version = L.utf8proc_version().decode()
        self.unicode = L.utf8proc_unicode_version().decode()
        L.utf8proc_map.restype = ctypes.c_ssize_t
        L.utf8proc_map.argtypes = [ctypes.c_char_p, ctypes.c_ssize_t, ctypes.POINTER(ctypes.c_void_p),
                                   ctypes.c_int]
        L.utf8proc_get_property.restype = ctypes.POINTER(self.Property)
        L.utf8proc_get_property.argtypes = [ctypes.c_int32]
        L.utf8proc_tolower.restype = ctypes.c_int32
        L.utf8proc_tolower.argtypes = [ctypes.c_int32]

    def map(self, s, options):
        b = s.encode("utf-8")
        p = ctypes.c_void_p()
        n = self.lib.utf8proc_map(b, len(b), ctypes.byref(p), options)
        if n < 0:
            raise RuntimeError(f"utf8proc_map failed ({n}) on {s!r}")
        out = ctypes.string_at(p.value, n).decode("utf-8")
        self.libc.free(p)
        return out

    def prop(self, c):
        return self.lib.utf8proc_get_property(c).contents


def is_hangul(c):
    return 0x1100 <= c <= 0x11FF or 0xA960 <= c <= 0xA97F or 0xD7B0 <= c <= 0xD7FF or 0xAC00 <= c <= 0xD7A3


# ----------------------------------------------------------------------------- A: Oniguruma

ONIG_CATEGORIES = ["L", "Lu", "Ll", "Lt", "Lm", "Lo", "M", "Mn", "Mc", "Me", "N", "Nd", "Nl", "No",
                   "P", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "S", "Sm", "Sc", "Sk", "So",
                   "Z", "Zs", "Zl", "Zp", "C", "Cc", "Cf", "Co", "Cn"]
ONIG_SCRIPTS = ["Han", "Hiragana", "Katakana", "Hangul", "Latin", "Cyrillic", "Greek", "Arabic", "Hebrew",
                "Thai", "Devanagari", "Common"]
# (table suffix, Oniguruma pattern, PCRE2 pattern to compare with or None)
ONIG_CLASSES = ([(c, rf"\p{{{c}}}", rf"\p{{{c}}}") for c in ONIG_CATEGORIES]
                + [("Space", r"\s", r"\s"), ("Word", r"\w", r"\w"), ("Digit", r"\d", r"\d"),
                   ("HexDigit", r"\h", r"[0-9A-Fa-f]"), ("Alphabetic", r"\p{Alphabetic}", r"\p{Alphabetic}"),
                   ("WhiteSpace", r"\p{White_Space}", r"\p{White_Space}")]
                + [(f"Script{s}", rf"\p{{{s}}}", rf"\p{{{s}}}") for s in ONIG_SCRIPTS])


def probe_onig(tables, facts, ctx):
    age = ctx["age"]
    out = {}
    caseless = {}
    for name, pat, _ in ONIG_CLASSES:
        f = split_removed(pat)
        out[name] = f
        fi = split_removed("(?i)" + pat)
        if fi != f:
            caseless[name] = {"extra_under_(?i)": len(diff(fi, f)), "missing_under_(?i)": len(diff(f, fi)),
                              "samples_extra": samples(diff(fi, f), 6)}
            out[name + "Caseless"] = fi
    # The general categories must partition the code points (surrogates excluded).
    majors = ["L", "M", "N", "P", "S", "Z", "C"]
    for c in CPS:
        assert sum(out[m][c] for m in majors) == 1, f"U+{c:04X} is in {sum(out[m][c] for m in majors)} majors"
    for m in majors:
        subs = [n for n in ONIG_CATEGORIES if len(n) == 2 and n[0] == m]
        for c in CPS:
            assert out[m][c] == any(out[s][c] for s in subs), (m, hex(c))
    assigned = bytearray(MAX_CP)
    for c in CPS:
        assigned[c] = 0 if out["Cn"][c] else 1
    ctx["onig"] = out
    ctx["cat"] = {c: next(n for n in ONIG_CATEGORIES if len(n) == 2 and out[n][c]) for c in CPS}
    if age is not None:
        for c, cat in ctx["age_extra"]["cat17"].items():
            if out["Cn"][c]:
                ctx["cat"][c] = cat  # newer than Oniguruma: category from AGES_15_TO_17
    comments = {
        "Space": r"\s", "Word": r"\w", "Digit": r"\d", "HexDigit": r"\h (Oniguruma: hex digit, not PCRE2's "
        r"horizontal space)", "Alphabetic": r"\p{Alphabetic}", "WhiteSpace": r"\p{White_Space}"}
    for name, pat, _ in ONIG_CLASSES:
        what = comments.get(name, pat)
        tables.append((f"kOnig{name}", out[name],
                       f"Oniguruma {what} as matched by Split/Replace regexes (and ByteLevel's regex); probed "
                       f"with Split(Regex(r\"{pat}\"), \"removed\") over all code points."))
        if name + "Caseless" in out:
            tables.append((f"kOnig{name}Caseless", out[name + "Caseless"],
                           f"Oniguruma (?i){pat}: differs from {pat} under case-insensitive matching; probed "
                           f"like kOnig{name} with the pattern r\"(?i){pat}\"."))
    facts["oniguruma"] = {
        "unicode_version": infer_version(assigned, flags_of(CPS), age),
        "assigned_code_points": count(assigned),
        "caseless_differences": caseless,
        "cn_note": "\\p{Cn} holds exactly the unassigned code points incl. noncharacters (U+FDD0, U+FFFE, "
                   "U+10FFFF); surrogates cannot reach the regex (text is UTF-8).",
        "markers": {f"U+{c:04X} ({_age_name(age, c)})": ("assigned" if not out["Cn"][c] else "unassigned")
                    for c in (0x1FAE8, 0x1FAE9, 0x10D40, 0x1FAEA, 0x20C1, 0x2EBF0)},
    }
    print(f"A oniguruma: {len(ONIG_CLASSES)} classes, caseless differences in {sorted(caseless)}, "
          f"version {facts['oniguruma']['unicode_version']}")


# ----------------------------------------------------------------------------- B: Rust std

def probe_rust_std(tables, facts, ctx):
    age, onig = ctx["age"], ctx["onig"]
    # is_numeric: Digits(individual_digits=True) isolates each numeric char.
    removed, alone, merged = isolate(pre_tokenizers.Digits(individual_digits=True), "a")
    assert count(removed) == 0
    numeric = alone
    _, alone2, _ = isolate(pre_tokenizers.Digits(individual_digits=False), "a")
    assert alone2 == numeric
    # is_whitespace: WhitespaceSplit removes it.
    ws, alone, _ = isolate(pre_tokenizers.WhitespaceSplit(), "a")
    assert count(alone) == 0
    # Strip (normalizer): trims char::is_whitespace on both ends.
    strip = normalizers.Strip()
    strip_ws = bytearray(MAX_CP)
    for c in CPS:
        x = chr(c)
        r = strip.normalize_str(x + "a" + x)
        if r == "a":
            strip_ws[c] = 1
        else:
            assert r == x + "a" + x, (hex(c), r)
    assert strip_ws == ws, "Strip and WhitespaceSplit disagree"
    strip_cases = {s: normalizers.Strip(left=l, right=r).normalize_str(s)
                   for s in [" \u3000\t a b \u2029\u0085 ", "\u200b a \u200b", "\x1c a \x1f"]
                   for l, r in [(True, True)]}
    strip_cases["left only: ' a '"] = normalizers.Strip(left=True, right=False).normalize_str(" a ")
    strip_cases["right only: ' a '"] = normalizers.Strip(left=False, right=True).normalize_str(" a ")
    # Lowercase: per code point, then the whole text at once (context dependence).
    low = normalizers.Lowercase()
    lower = {}
    for c in CPS:
        r = low.normalize_str(chr(c))
        if r != chr(c):
            lower[c] = r
    whole = low.normalize_str(TEXT)
    assert whole == "".join(lower.get(c, chr(c)) for c in CPS), "Lowercase depends on context"
    assert max(len(v) for v in lower.values()) <= 3
    sigma_cases = {s: low.normalize_str(s) for s in ["ΑΣ Σ ΑΣΑ", "ΌΣΟΣ.", "İstanbul", "ẞ", "ǅ", "ΐ"]}
    ctx["lower"] = lower
    lower_flags = flags_of(lower)
    facts["rust_std"] = {
        "is_numeric": {"count": count(numeric),
                       "unicode_version": infer_version(numeric, onig["N"] if age is None else
                                                        _cats(ctx, ("Nd", "Nl", "No")), age, "6.0")},
        "is_whitespace": {"count": count(ws), "code_points": [f"U+{c:04X}" for c in members(ws)],
                          "equals_oniguruma_White_Space": ws == onig["WhiteSpace"]},
        "lowercase": {"count": len(lower),
                      "multi_char": {f"U+{c:04X}": [f"U+{ord(x):04X}" for x in v]
                                     for c, v in lower.items() if len(v) > 1},
                      "per_char_no_context": True,
                      "examples": sigma_cases,
                      "unicode_version": infer_version(lower_flags, _lower_ref(ctx), age, "6.0")},
        "strip": {"whitespace_set": "char::is_whitespace (same set as WhitespaceSplit)",
                  "examples": strip_cases},
    }
    tables.append(("kRustIsNumeric", numeric,
                   "Rust char::is_numeric (Nd|Nl|No of the compiler's Unicode): Digits pre-tokenizer; probed with "
                   "Digits(individual_digits=True) over 'a'-separated code points (numeric ones come out alone)."))
    tables.append(("kRustIsWhitespace", ws,
                   "Rust char::is_whitespace (White_Space): WhitespaceSplit, normalizers.Strip, BertPreTokenizer, "
                   "ByteLevel/Roberta trim_offsets, BertNormalizer clean_text; probed with WhitespaceSplit (removed "
                   "chars) and Strip on X+'a'+X (identical sets)."))
    ctx["lowercase_table"] = lower
    print(f"B rust std: numeric {count(numeric)}, whitespace {count(ws)}, lowercase {len(lower)} "
          f"({sum(len(v) > 1 for v in lower.values())} multi-char)")
    ctx["rust_ws"] = ws


def _lower_ref(ctx):
    """Code points with a lowercase mapping: utf8proc's (Unicode 15.0), plus Lu/Lt assigned later."""
    u8, age = ctx["utf8proc"], ctx["age"]
    f = _cats(ctx, ("Lu", "Lt"))
    for c in CPS:
        if u8.lib.utf8proc_tolower(c) != c:
            f[c] = 1
        elif f[c] and age is not None and age[c] <= VKEY["15.0"]:
            f[c] = 0
    return f


def _cats(ctx, cats):
    f = bytearray(MAX_CP)
    for c, cat in ctx["cat"].items():
        if cat in cats:
            f[c] = 1
    return f


# ----------------------------------------------------------------------------- C: Bert / Punctuation

def probe_bert(tables, facts, ctx):
    age = ctx["age"]
    removed, punc, _ = isolate(pre_tokenizers.Punctuation(), "a")
    assert count(removed) == 0
    bws, bpunc, _ = isolate(pre_tokenizers.BertPreTokenizer(), "a")
    assert bpunc == punc, "BertPreTokenizer and Punctuation disagree on punctuation"
    assert bws == ctx["rust_ws"], "BertPreTokenizer whitespace is not char::is_whitespace"

    def bert(**kw):
        n = normalizers.BertNormalizer(**kw)
        return {c: n.normalize_str(chr(c)) for c in CPS}

    off = dict(clean_text=False, handle_chinese_chars=False, strip_accents=False, lowercase=False)
    clean = bert(**{**off, "clean_text": True})
    clean_remove, clean_space = bytearray(MAX_CP), bytearray(MAX_CP)
    for c, r in clean.items():
        if r == "":
            clean_remove[c] = 1
        elif r == " " and c != 0x20:
            clean_space[c] = 1
        else:
            assert r == chr(c), (hex(c), r)
    chinese_out = bert(**{**off, "handle_chinese_chars": True})
    chinese = bytearray(MAX_CP)
    for c, r in chinese_out.items():
        if r == f" {chr(c)} ":
            chinese[c] = 1
        else:
            assert r == chr(c), (hex(c), r)
    nfd = normalizers.NFD()
    strip_out = bert(**{**off, "strip_accents": True})
    strip_mn = bytearray(MAX_CP)
    for c, r in strip_out.items():
        d = nfd.normalize_str(chr(c))
        if d == chr(c) and r == "":
            strip_mn[c] = 1
    for c, r in strip_out.items():
        d = nfd.normalize_str(chr(c))
        assert r == "".join(x for x in d if not strip_mn[ord(x)]), (hex(c), r, d)
    lower_out = bert(**{**off, "lowercase": True})
    for c, r in lower_out.items():
        assert r == ctx["lower"].get(c, chr(c)), (hex(c), r)

    # Order: compare the all-on normalizer with the compositions of the steps in each order.
    steps = {
        "clean": lambda s: "".join("" if clean_remove[ord(x)] else " " if clean_space[ord(x)] else x for x in s),
        "chinese": lambda s: "".join(f" {x} " if chinese[ord(x)] else x for x in s),
        "strip": lambda s: "".join(x for x in nfd.normalize_str(s) if not strip_mn[ord(x)]),
        "lower": lambda s: "".join(ctx["lower"].get(ord(x), x) for x in s),
    }
    full = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=True,
                                      lowercase=True)
    orders = [("clean", "chinese", "strip", "lower"), ("clean", "chinese", "lower", "strip"),
              ("strip", "clean", "chinese", "lower"), ("lower", "strip", "clean", "chinese")]
    order_mismatch = {}
    hf_full = {c: full.normalize_str(chr(c)) for c in CPS}
    for order in orders:
        bad = []
        for c in CPS:
            s = chr(c)
            for st in order:
                s = steps[st](s)
            if s != hf_full[c]:
                bad.append(c)
        order_mismatch[" -> ".join(order)] = {"mismatches": len(bad), "samples": samples(bad, 6)}
    assert order_mismatch["clean -> chinese -> strip -> lower"]["mismatches"] == 0
    default_cases = {s: normalizers.BertNormalizer().normalize_str(s)
                     for s in ["İ Å\u2000x", "Héllo\u00a0\u200b世界\x00\ufffd\t\n\x0b\x0c\x85", "\uf900\u0301",
                               "한국어 ǅ ΑΣ", "e\u200b\u0301"]}

    old = ctx["cat"]
    ref_punc = bytearray(MAX_CP)
    for c in CPS:
        ref_punc[c] = old[c][0] == "P"
    non_ascii_punc = bytearray(punc)
    for c in range(0x80):
        non_ascii_punc[c] = 0
    ref_other = bytearray(MAX_CP)
    for c in CPS:
        ref_other[c] = old[c] in ("Cc", "Cf", "Co") or c in (0, 0xFFFD)
    for c in (0x09, 0x0A, 0x0D):
        ref_other[c] = 0
    facts["unicode_categories_crate"] = {
        "punctuation": {"count": count(punc), "is": "char::is_ascii_punctuation || unicode_categories P*",
                        "unicode_version": infer_version(non_ascii_punc, ref_punc, age, "6.0")},
        "strip_accents_Mn": {"count": count(strip_mn),
                             "unicode_version": infer_version(strip_mn, _cats(ctx, ("Mn",)), age, "6.0")},
        "clean_text_remove": {"count": count(clean_remove),
                              "is": "U+0000, U+FFFD and unicode_categories is_other (Cc|Cf|Co of its old "
                                    "Unicode; unassigned code points are kept), except \\t \\n \\r",
                              "unicode_version": infer_version(clean_remove, ref_other, age, "6.0")},
        "clean_text_to_space": {
            "code_points": [f"U+{c:04X}" for c in members(clean_space)],
            "note": "char::is_whitespace except U+000B, U+000C, U+0085 (Cc: is_control is tested first, so "
                    "they are removed) and U+0020 (unchanged)"},
        "order_note": "source order clean_text -> handle_chinese_chars -> strip_accents -> lowercase; the "
                      "steps commute on every single code point (all four orders tried give identical output), "
                      "so only clean_text-before-anything is observable; strip_accents leaves NFD text "
                      "(Hangul syllables come out as jamo)",
        "chinese_ranges": [[f"U+{a:04X}", f"U+{b:04X}"] for a, b in to_ranges(chinese)],
        "order": order_mismatch,
        "default_examples": default_cases,
    }
    tables.append(("kHfPunctuation", punc,
                   "is_punc = char::is_ascii_punctuation || unicode_categories is_punctuation (P*, the crate's old "
                   "Unicode): Punctuation and BertPreTokenizer; probed with Punctuation() and BertPreTokenizer() "
                   "over 'a'-separated code points (punctuation comes out alone; both agree)."))
    tables.append(("kBertCleanTextRemove", clean_remove,
                   "BertNormalizer clean_text: removed (U+0000, U+FFFD, unicode_categories is_other but not "
                   "\\t\\n\\r); probed with BertNormalizer(clean_text only) per code point (result '')."))
    tables.append(("kBertCleanTextToSpace", clean_space,
                   "BertNormalizer clean_text: replaced by ' ' (\\t\\n\\r and char::is_whitespace; U+0020 itself is "
                   "left out); probed per code point (result ' ')."))
    tables.append(("kBertChineseChars", chinese,
                   "BertNormalizer handle_chinese_chars: padded with ' ' on both sides (fixed CJK ranges); probed per "
                   "code point (result ' X ')."))
    tables.append(("kBertStripAccentsRemove", strip_mn,
                   "BertNormalizer strip_accents: after NFD (HF's tables) these are dropped (unicode_categories "
                   "is_mark_nonspacing, old Unicode); probed per NFD-stable code point (result ''). BertNormalizer "
                   "order: clean_text, handle_chinese_chars, strip_accents (default: = lowercase), lowercase "
                   "(kRustLowercase)."))
    # StripAccents normalizer: filter(!is_combining_mark) of unicode-normalization-alignments (no NFD of its own).
    sa = normalizers.StripAccents()
    sa_remove = bytearray(MAX_CP)
    for c in CPS:
        r = sa.normalize_str(chr(c))
        if r == "":
            sa_remove[c] = 1
        else:
            assert r == chr(c), (hex(c), r)
    assert sa.normalize_str(TEXT) == "".join(chr(c) for c in CPS if not sa_remove[c])
    facts["strip_accents_normalizer"] = {
        "count": count(sa_remove),
        "is": "filter(!unicode_normalization_alignments::char::is_combining_mark) (Mn|Mc|Me), no NFD of its own",
        "unicode_version": infer_version(sa_remove, _cats(ctx, ("Mn", "Mc", "Me")), age, "6.0"),
        "examples": {s_: sa.normalize_str(s_) for s_ in ["e\u0301", "\u00e9", "\u0915\u093f", "\u1734"]},
    }
    tables.append(("kStripAccentsRemove", sa_remove,
                   "StripAccents normalizer: removed (unicode-normalization-alignments is_combining_mark, Mn|Mc|Me "
                   "of Unicode 9.0; the normalizer does no NFD itself); probed with StripAccents() per code point "
                   "(result '') and on the whole text."))
    print(f"C bert: punc {count(punc)}, clean remove {count(clean_remove)}, to-space {count(clean_space)}, "
          f"chinese {count(chinese)}, strip Mn {count(strip_mn)}")


# ----------------------------------------------------------------------------- D: Rust regex crate

def probe_rust_regex(tables, facts, ctx):
    age, onig = ctx["age"], ctx["onig"]
    space, punct, word = isolate(pre_tokenizers.Whitespace(), "a")
    space2, word2, punct2 = isolate(pre_tokenizers.Whitespace(), "!")
    assert (space, punct, word) == (space2, punct2, word2), "Whitespace probes with 'a' and '!' disagree"

    # Added tokens: single_word (regex ^\w / \w$), lstrip (\s*$), rstrip (^\s*).
    def added_probe(token, make_text, where):
        tok = Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
        tok.add_tokens([token])
        tid = tok.token_to_id("@")
        f = bytearray(MAX_CP)
        chunk = 4096
        for s in range(0, len(CPS), chunk):
            part = CPS[s:s + chunk]
            enc = tok.encode("".join(make_text(chr(c)) for c in part))
            got = {o for i, o in zip(enc.ids, enc.offsets) if i == tid}
            for j, c in enumerate(part):
                if where(j) in got:
                    f[c] = 1
        return f

    sw_left = added_probe(AddedToken("@", single_word=True), lambda x: x + "@ ", lambda j: (3 * j + 1, 3 * j + 2))
    sw_right = added_probe(AddedToken("@", single_word=True), lambda x: " @" + x, lambda j: (3 * j + 1, 3 * j + 2))
    # matched = not a word char
    for f in (sw_left, sw_right):
        for c in CPS:
            f[c] ^= 1
    lstrip = added_probe(AddedToken("@", lstrip=True), lambda x: "a" + x + "@", lambda j: (3 * j + 1, 3 * j + 3))
    rstrip = added_probe(AddedToken("@", rstrip=True), lambda x: "@" + x + "a", lambda j: (3 * j, 3 * j + 2))
    facts["rust_regex"] = {
        "word_count": count(word), "space_count": count(space),
        "single_word_left_equals_whitespace_word": sw_left == word,
        "single_word_right_equals_whitespace_word": sw_right == word,
        "lstrip_equals_whitespace_space": lstrip == space, "rstrip_equals_whitespace_space": rstrip == space,
        "space_equals_rust_is_whitespace": space == ctx["rust_ws"],
        "word_unicode_version": infer_version(word, _word_ref(ctx), age, "6.0"),
    }
    for k in ("single_word_left_equals_whitespace_word", "single_word_right_equals_whitespace_word",
              "lstrip_equals_whitespace_space", "rstrip_equals_whitespace_space"):
        if not facts["rust_regex"][k]:
            print(f"  warning: {k} is false")
    tables.append(("kRustRegexWord", word,
                   "Rust regex crate \\w (Unicode word): Whitespace pre-tokenizer (\\w+|[^\\w\\s]+) and added tokens' "
                   "single_word check (^\\w, \\w$); probed with Whitespace() over 'a'- and '!'-separated code points "
                   "and with single_word added tokens (X@ and @X)."))
    tables.append(("kRustRegexSpace", space,
                   "Rust regex crate \\s (White_Space): Whitespace pre-tokenizer (dropped) and added tokens' "
                   "lstrip/rstrip (\\s*$, ^\\s*); probed with Whitespace() (removed chars) and lstrip/rstrip tokens."))
    print(f"D rust regex: word {count(word)}, space {count(space)}, punct {count(punct)}; "
          f"added-token probes agree: {[facts['rust_regex'][k] for k in list(facts['rust_regex'])[2:6]]}")


def _word_ref(ctx):
    f = bytearray(ctx["onig"]["Word"])
    for c, cat in ctx["age_extra"]["cat17"].items() if ctx["age"] is not None else []:
        if ctx["onig"]["Cn"][c] and (cat[0] in "LM" or cat in ("Nd", "Pc", "Nl")):
            f[c] = 1
    return f


# ----------------------------------------------------------------------------- E: normalization

CONTEXTS = {
    "x": lambda x: x,
    "a+x+acute": lambda x: "a" + x + "\u0301",
    "acute+x": lambda x: "\u0301" + x,
    "x+acute": lambda x: x + "\u0301",
    "x+tilde_overlay+acute": lambda x: x + "\u0334\u0301",
    "e+x": lambda x: "e" + x,
    "acute+x+grave_below": lambda x: "\u0301" + x + "\u0316",
    "x+x": lambda x: x + x,
    "hangul_L+x": lambda x: "\u1100" + x,
    "hangul_LV+x": lambda x: "\uac00" + x,
    "x+hangul_V": lambda x: x + "\u1161",
}
SEP = "\n"  # inert in both libraries, and no normalization produces it


def probe_normalization(tables, facts, ctx):
    age = ctx["age"]
    u8 = ctx["utf8proc"]
    hf = {"NFC": normalizers.NFC(), "NFD": normalizers.NFD(), "NFKC": normalizers.NFKC(), "NFKD": normalizers.NFKD()}
    t0 = time.time()

    # Per code point: decomposes (NFD/NFKD) or has a combining class (reorders against U+0301 U+0316).
    def decomp_and_ccc(nfd, nfkd):
        dec, ccc = bytearray(MAX_CP), bytearray(MAX_CP)
        for c in CPS:
            x = chr(c)
            if nfkd(x) != x or nfd(x) != x:
                dec[c] = 1
            elif nfd("\u0301" + x + "\u0316") != "\u0301" + x + "\u0316":
                ccc[c] = 1
        return dec, ccc

    hf_dec, hf_ccc = decomp_and_ccc(hf["NFD"].normalize_str, hf["NFKD"].normalize_str)
    u_dec, u_ccc = decomp_and_ccc(lambda s: u8.map(s, u8.FORMS["NFD"]), lambda s: u8.map(s, u8.FORMS["NFKD"]))
    # Composition: the canonical decomposition of every composite either library knows, composed again.
    composites = [(c, u8.map(chr(c), u8.FORMS["NFD"])) for c in CPS if u_dec[c] or hf_dec[c]]
    composites = [(c, d) for c, d in composites if d != chr(c)]
    hf_comp, u_comp = bytearray(MAX_CP), bytearray(MAX_CP)
    for c, d in composites:
        for flags, nfc in ((hf_comp, hf["NFC"].normalize_str), (u_comp, lambda s: u8.map(s, u8.FORMS["NFC"]))):
            if nfc(d) != d:
                for x in d:
                    flags[ord(x)] = 1
    hf_noninert, u_noninert, by_props = bytearray(MAX_CP), bytearray(MAX_CP), bytearray(MAX_CP)
    for c in CPS:
        hf_noninert[c] = hf_dec[c] or hf_ccc[c] or hf_comp[c] or is_hangul(c)
        u_noninert[c] = u_dec[c] or u_ccc[c] or u_comp[c] or is_hangul(c)
        by_props[c] = u_noninert[c] and not hf_noninert[c]

    contexts = list(CONTEXTS.items()) + [
        ("nfd(composite)", None), ("hf_nfd(composite)", None)]

    def items_of(name, f):
        if name == "nfd(composite)":
            return composites
        if name == "hf_nfd(composite)":
            return [(c, hf["NFD"].normalize_str(chr(c))) for c, _ in composites]
        return [(c, f(chr(c))) for c in CPS]

    def batches(items):
        out = [[it] for it in items if SEP in it[1]]  # contexts holding SEP go alone
        rest = [it for it in items if SEP not in it[1]]
        return out + [rest[s:s + 4096] for s in range(0, len(rest), 4096)]

    def run(fn):
        """fn(form, text) per batch; yields (form, context, code point, text, hf, other) where they differ."""
        for name, f in contexts:
            items = items_of(name, f)
            for form, n in hf.items():
                for part in batches(items):
                    text = SEP.join(t for _, t in part)
                    h, o = n.normalize_str(text), fn(form, text)
                    if h == o:
                        continue
                    hs, os_ = ([h], [o]) if len(part) == 1 else (h.split(SEP), o.split(SEP))
                    assert len(hs) == len(os_) == len(part)
                    for (c, t), hh, oo in zip(part, hs, os_):
                        if hh != oo:
                            yield form, name, c, t, hh, oo

    # Pass 1: HF against plain utf8proc.
    per_cp_diff = {f: bytearray(MAX_CP) for f in hf}
    ctx_diff = {f: {} for f in hf}
    diff_cps = bytearray(MAX_CP)
    for form, name, c, t, hh, uu in run(lambda form, text: u8.map(text, u8.FORMS[form])):
        if name == "x":
            per_cp_diff[form][c] = 1
        ctx_diff[form].setdefault(name, []).append(c)
        if name in CONTEXTS:
            diff_cps[c] = 1
        else:
            for x in t:
                if by_props[ord(x)]:
                    diff_cps[ord(x)] = 1
    # Differences not explained by the property comparison (utf8proc bugs): pass those through too.
    unexplained = [c for c in CPS if diff_cps[c] and not by_props[c]]
    unknown = bytearray(by_props)
    for c in unexplained:
        unknown[c] = 1
    unknown_re = re.compile("([" + "".join(re.escape(chr(c)) for c in members(unknown)) + "])")

    def plan(form, s):
        opts = u8.FORMS[form]
        if not unknown_re.search(s):
            return u8.map(s, opts)
        parts = unknown_re.split(s)  # odd indices are the unknown code points
        return "".join(p if i % 2 else u8.map(p, opts) for i, p in enumerate(parts))

    # Pass 2: HF against the plan.
    plan_fail = {f: [] for f in hf}
    for form, name, c, t, hh, pp in run(plan):
        plan_fail[form].append({"context": name, "cp": f"U+{c:04X}", "text": t, "hf": hh, "plan": pp})

    ref_noninert = bytearray(MAX_CP)
    for c in CPS:
        ref_noninert[c] = u_dec[c] or u_ccc[c] or 0xAC00 <= c <= 0xD7A3
    hf_known = bytearray(MAX_CP)
    for c in CPS:
        hf_known[c] = hf_dec[c] or hf_ccc[c]
    version = infer_version(hf_known, ref_noninert, age, "6.0")
    facts["normalization"] = {
        "crate": "unicode-normalization-alignments",
        "unicode_version": version,
        "utf8proc": f"{u8.version} (Unicode {u8.unicode})",
        "probes_per_form": sum(len(items_of(n, f)) for n, f in contexts),
        "contexts": [n for n, _ in contexts],
        "unknown_count": count(unknown),
        "unknown_by_properties": count(by_props),
        "unknown_from_utf8proc_bugs": {f"U+{c:04X}": _bug_note(c) for c in unexplained},
        "per_code_point_differences": {f: count(per_cp_diff[f]) for f in hf},
        "context_differences": {f: {k: len(v) for k, v in sorted(ctx_diff[f].items())} for f in hf},
        "plan_failure_counts": {f: len(plan_fail[f]) for f in hf},
        "plan_failures": {f: plan_fail[f][:20] for f in hf},
        "samples_unknown": samples(members(unknown), 12),
        "samples_per_cp_diff": {f: samples(members(per_cp_diff[f]), 8) for f in hf},
        "examples": {f"{form}({t!r})": {"hf": hf[form].normalize_str(t), "utf8proc": u8.map(t, u8.FORMS[form])}
                     for form, t in [("NFD", "\U00011938"), ("NFKC", "\u32ff"), ("NFC", "a\u0ebb\u0301"),
                                     ("NFC", "\uac00\u11a7")]},
    }
    if age is not None:
        ages = sorted({age[c] for c in CPS if by_props[c]})
        facts["normalization"]["unknown_by_properties_ages"] = [
            UNICODE_VERSIONS[a] if a < UNASSIGNED else "unassigned" for a in ages]
    tables.append(("kHfNormalizationUnknown", unknown,
                   "NFC/NFD/NFKC/NFKD (unicode-normalization-alignments, Unicode "
                   f"{version['version'] if version else '?'}): code points utf8proc 2.8 treats as non-inert "
                   "(combining class, decomposition, composition, Hangul) while HF treats them as inert starters "
                   "(class 0, no decomposition, no composition), plus U+11A7 (utf8proc 2.8 composes LV + U+11A7, "
                   "dropping it). Plan: split the text at these code points, pass them through unchanged and "
                   "utf8proc the rest; reproduces HF on every code point alone, in "
                   f"{len(CONTEXTS) - 1} contexts (a+X+U+0301, U+0301+X, X+U+0334+U+0301, Hangul, ...) and on "
                   "the decomposition of every composite."))
    print(f"E normalization ({time.time() - t0:.0f} s): unknown {count(unknown)} ({len(unexplained)} from utf8proc "
          f"bugs), per-cp diffs {facts['normalization']['per_code_point_differences']}, version {version}, "
          f"plan failures {facts['normalization']['plan_failure_counts']}")


def _bug_note(c):
    if c == 0x11A7:
        return ("utf8proc 2.8 composes an LV syllable with U+11A7 (T index 0, not a trailing consonant) and "
                "drops it; HF keeps it")
    return "differs from HF although both treat it alike by properties"


# ----------------------------------------------------------------------------- comparisons

def compare_with_c_libs(tables, facts, ctx):
    """Per table: code points where HF differs from PCRE2 10.42 / utf8proc 2.8 (samples for tests)."""
    pcre, u8 = ctx.get("pcre2"), ctx["utf8proc"]
    out = {}
    pcre_patterns = {f"kOnig{name}": p for name, _, p in ONIG_CLASSES}
    pcre_patterns.update({"kRustIsNumeric": r"\p{N}", "kRustIsWhitespace": r"\p{White_Space}",
                          "kHfPunctuation": r"[\p{P}!-/:-@\[-`{-~]", "kBertStripAccentsRemove": r"\p{Mn}",
                          "kStripAccentsRemove": r"\p{M}",
                          "kRustRegexWord": r"\w", "kRustRegexSpace": r"\s"})
    pcre_patterns["kBertCleanTextRemove"] = r"(?![\t\n\r])[\x00\x{FFFD}\p{Cc}\p{Cf}\p{Co}]"
    for name, flags, _ in tables:
        pat = pcre_patterns.get(name)
        if pat is None or pcre is None:
            continue
        pf = pcre.matches(pat)
        if pf is None:
            out[name] = {"pcre2_pattern": pat, "error": "PCRE2 cannot compile it"}
            continue
        only_hf, only_pcre = diff(flags, pf), diff(pf, flags)
        out[name] = {"pcre2_pattern": pat, "only_hf": len(only_hf), "only_pcre2": len(only_pcre),
                     "samples_only_hf": samples(only_hf), "samples_only_pcre2": samples(only_pcre)}
    # Lowercase vs utf8proc_tolower (simple mapping).
    lower = ctx["lowercase_table"]
    bad = [c for c in CPS if lower.get(c, chr(c)) != chr(u8.lib.utf8proc_tolower(c))]
    out["kRustLowercase"] = {"compared_with": "utf8proc_tolower", "differ": len(bad), "samples": samples(bad, 12)}
    facts["differences_from_c_libraries"] = out


# ----------------------------------------------------------------------------- output

def write_inc(path, tables, lower, header_facts):
    lines = [
        "// Generated by scripts/reference/make_unicode_tables.py from tokenizers "
        f"{tokenizers.__version__} (probed); do not edit.",
        "// Data derived from the Unicode Character Database (Unicode License v3, see",
        "// https://www.unicode.org/license.txt) as implemented by the libraries Hugging Face",
        "// `tokenizers` uses: Oniguruma (Unicode " + header_facts["onig"] + "), Rust std (Unicode "
        + header_facts["std"] + "), the unicode_categories crate (Unicode " + header_facts["cats"] + "),",
        "// the regex crate (Unicode " + header_facts["regex"] + ") and unicode-normalization-alignments (Unicode "
        + header_facts["norm"] + ").",
        "// Every table lists sorted, merged, inclusive [first, last] code point ranges; surrogates",
        "// (U+D800..U+DFFF) were not probed and never appear.",
        "// (Included inside a namespace that the including file opens.)",
        "",
        "struct CodePointRange {",
        "  char32_t first, last;",
        "};",
        "",
    ]
    for name, flags, comment in tables:
        rs = to_ranges(flags)
        lines.append(f"// {comment}")
        lines.append(f"// {len(rs)} ranges, {count(flags)} code points.")
        lines.append(f"inline constexpr CodePointRange {name}[] = {{")
        items = [f"{{0x{a:X},0x{b:X}}}" for a, b in rs] or ["{0x110000,0x110000}"]
        lines.extend(_wrap(items))
        lines.append("};")
        lines.append("")
    lines += [
        "// Rust char::to_lowercase as applied by normalizers.Lowercase and BertNormalizer(lowercase):",
        "// per code point, no context (no final-sigma rule: \"ΑΣ\" -> \"ασ\"); İ (U+0130) -> i + U+0307.",
        "// Every code point whose lowercase differs from itself; unused slots of `lower` are 0.",
        "// Probed with Lowercase().normalize_str(chr(X)) per code point (and checked on the whole text).",
        "struct LowercaseEntry {",
        "  char32_t cp;",
        "  char32_t lower[3];",
        "};",
        f"// {len(lower)} entries.",
        "inline constexpr LowercaseEntry kRustLowercase[] = {",
    ]
    items = []
    for c in sorted(lower):
        v = [ord(x) for x in lower[c]] + [0] * (3 - len(lower[c]))
        items.append("{0x%X,{0x%X,0x%X,0x%X}}" % (c, *v))
    lines.extend(_wrap(items))
    lines.append("};")
    text = "\n".join(lines).replace(",0x0}", ",0}").replace(",0x0,", ",0,") + "\n"
    path.write_text(text, encoding="utf-8")
    return len(text.encode("utf-8"))


def _wrap(items, width=110):
    out, cur = [], "   "
    for it in items:
        if len(cur) + len(it) + 2 > width:
            out.append(cur.rstrip())
            cur = "   "
        cur += " " + it + ","
    if cur.strip():
        out.append(cur.rstrip())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inc", type=Path, default=OUT_INC)
    ap.add_argument("--facts", type=Path, default=OUT_FACTS)
    args = ap.parse_args()
    if tokenizers.__version__ != EXPECTED_TOKENIZERS:
        sys.exit(f"tokenizers {tokenizers.__version__} found, {EXPECTED_TOKENIZERS} expected")
    t0 = time.time()
    age, age_extra = load_ages()
    ctx = {"age": age, "age_extra": age_extra, "utf8proc": Utf8proc()}
    try:
        ctx["pcre2"] = Pcre2()
    except OSError:
        ctx["pcre2"] = None
    facts = {"tokenizers": tokenizers.__version__,
             "python": sys.version.split()[0],
             "pcre2": None if ctx["pcre2"] is None else f"{ctx['pcre2'].version} (Unicode {ctx['pcre2'].unicode})",
             "utf8proc": f"{ctx['utf8proc'].version} (Unicode {ctx['utf8proc'].unicode})",
             "ages_from": None if age is None else f"perl Unicode::UCD {age_extra['perl_unicode']} + AGES_15_TO_17",
             "code_points_probed": len(CPS)}
    tables = []
    for step in (probe_onig, probe_rust_std, probe_bert, probe_rust_regex, probe_normalization,
                 compare_with_c_libs):
        t = time.time()
        step(tables, facts, ctx)
        print(f"  {step.__name__}: {time.time() - t:.0f} s", flush=True)

    def ver(v):
        return "?" if v is None else v["version"]
    header = {"onig": ver(facts["oniguruma"]["unicode_version"]),
              "std": ver(facts["rust_std"]["is_numeric"]["unicode_version"]),
              "cats": ver(facts["unicode_categories_crate"]["punctuation"]["unicode_version"]),
              "regex": ver(facts["rust_regex"]["word_unicode_version"]),
              "norm": ver(facts["normalization"]["unicode_version"])}
    facts["other_components"] = {
        "ByteLevel pre-tokenizer": "its GPT-2 regex runs in Oniguruma (kOnig* tables); trim_offsets of the "
                                   "ByteLevel/Roberta processors uses char::is_whitespace (kRustIsWhitespace)",
        "added tokens": "single_word: regex crate ^\\w / \\w$ (kRustRegexWord); lstrip/rstrip: regex crate "
                        "\\s*$ / ^\\s* (kRustRegexSpace)",
        "UnicodeScripts pre-tokenizer": "own script table (pre_tokenizers/unicode_scripts/scripts.rs, generated from "
                                        "SentencePiece's list; not probed here: the plugin does not support it)",
        "Precompiled normalizer": "spm_precompiled walks grapheme clusters (unicode-segmentation crate); not probed",
        "Metaspace, CharDelimiterSplit, Split(String), Prepend, Replace(String), decoders": "no Unicode data",
    }
    facts["table_sizes"] = {name: {"ranges": len(to_ranges(f)), "code_points": count(f)} for name, f, _ in tables}
    facts["table_sizes"]["kRustLowercase"] = {"entries": len(ctx["lowercase_table"])}
    size = write_inc(args.inc, tables, ctx["lowercase_table"], header)
    args.facts.parent.mkdir(parents=True, exist_ok=True)
    args.facts.write_text(json.dumps(facts, indent=1, ensure_ascii=True, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {args.inc} ({size} bytes, {len(tables) + 1} tables) and {args.facts} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
