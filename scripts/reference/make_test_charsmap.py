#!/usr/bin/env python3
"""Prints a small SentencePiece precompiled charsmap (base64) for the hf_tokenizer tests.

PrecompiledShortcutsChangeNothing needs a charsmap that maps characters which join grapheme
clusters (the real nmt_nfkc one maps none of the Prepend characters): this one maps U+0600 ARABIC
NUMBER SIGN (Prepend) to "X", U+200D ZERO WIDTH JOINER to "Z" and "A" + U+0301 to U+00C1. The
output is the kPrependCharsmap constant of plugins/hf_tokenizer/tests/hf_tokenizer_test.cpp.
Needs sentencepiece and protobuf (the versions of scripts/bench-requirements.txt):

    .deps/bench/bin/python scripts/reference/make_test_charsmap.py
"""
import argparse
import base64
import pathlib
import tempfile

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as model_pb2

RULES = "600\t58\n200D\t5A\n41 301\tC1\n"  # source code points (hex) TAB target code points (hex)


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = pathlib.Path(tmp)
        (d / "rules.tsv").write_text(RULES)
        (d / "corpus.txt").write_text("\n".join(["hello world abc", "X Y Z"] * 50))
        spm.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "m"), vocab_size=30,
                                       normalization_rule_tsv=str(d / "rules.tsv"), model_type="char",
                                       minloglevel=2)
        model = model_pb2.ModelProto()
        model.ParseFromString((d / "m.model").read_bytes())
        print(base64.b64encode(model.normalizer_spec.precompiled_charsmap).decode())


if __name__ == "__main__":
    main()
