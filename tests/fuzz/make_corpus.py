#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/seed_*).

Standard library only. The seeds are the repository's own valid files (configs, the sample
corpus' .idx/.pbin/.jsonl files, the tiny worked example, tokenizer.json variants, the checkpoint fixture, the SentencePiece test
model) and hand-made adversarial inputs, one per defect class of issue 16 (deep TOML nesting, a
flipped pickle FRAME byte, code-running pickles, truncated files, contradicting checkpoint
manifests, ...). Inputs found by scripts/fuzz.sh and kept are stored beside them under other
names; this script replaces only files named seed_*.

    python3 tests/fuzz/make_corpus.py          # rewrite the seeds
"""
import json
import pickle
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "fuzz" / "corpus"
SAMPLE = ROOT / "data" / "sample"  # our own corpus; its .idx/.pbin were written by Modalities 0.5.0
# The worked example of the data formats (two documents "Hello" and "World!", GPT-2 ids), the same
# bytes as core/testing/shared_fixtures.cpp writes for the tests.
TINY_JSONL = b'{"text": "Hello"}\n{"text": "World!"}\n'
TINY_IDX = bytes.fromhex("80049511000000000000005d94284b004b1186944b124b128694652e")
TINY_PBIN = bytes.fromhex("0a0000000000000002000000883c50c46b29000050c4"
                          "80049511000000000000005d94284b004b0486944b044b068694652e")
CKPT = ROOT / "plugins" / "checkpointing" / "tests" / "data"
CKPT_FOLDER = CKPT / "eid_pyref-seen_steps_2-seen_tokens_64-target_steps_10-target_tokens_320"
TOK = ROOT / "plugins" / "hf_tokenizer" / "tests" / "data" / "variants"


def put(target: str, name: str, data) -> None:
    folder = CORPUS / target
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    (folder / f"seed_{name}").write_bytes(data)


def copy(target: str, name: str, source: Path) -> None:
    put(target, name, source.read_bytes())


def config_seeds() -> None:
    for toml in sorted((ROOT / "configs").rglob("*.toml")):
        rel = toml.relative_to(ROOT / "configs").as_posix().replace("/", "_")
        copy("config", rel, toml)
    deep = 40_000  # issue 16: about 40,000 parts overflowed the stack inside toml::parse
    put("config", "deep_dotted_key.toml", "a" + ".a" * (deep - 1) + " = 1\n")
    put("config", "deep_table_header.toml", "[" + ".".join(["t"] * deep) + "]\nx = 1\n")
    put("config", "deep_array_of_tables.toml", "[[" + ".".join(["t"] * deep) + "]]\nx = 1\n")
    put("config", "deep_inline_key.toml", "a = { " + ".".join(["k"] * deep) + " = 1 }\n")
    put("config", "deep_inline_arrays.toml", "a = " + "[" * 5000 + "]" * 5000 + "\n")
    put("config", "deep_inline_tables.toml", "a = " + "{ b = " * 5000 + "1" + " }" * 5000 + "\n")
    put("config", "key_depth_65.toml", ".".join(["k"] * 65) + " = 1\n")
    put("config", "interpolation_cycle.toml", 'a = "${b}"\nb = "${a}"\n')
    put("config", "interpolation_unknown_resolver.toml", 'a = "${no_such_resolver:x}"\n')
    put("config", "interpolation_unterminated.toml", 'a = "${b"\nb = 1\n')
    put("config", "interpolation_nested.toml", 'a = "${modalities_env:${b}}"\nb = "config_file_path"\n')
    put("config", "invalid_utf8.toml", b'a = "\xff\xfe"\n')
    put("config", "unterminated_string.toml", 'a = """never closed\n')
    put("config", "component_without_variant.toml",
        '[model]\ncomponent_key = "model"\n[model.config]\nn_layer = 2\n')
    put("config", "reference_to_nothing.toml",
        '[settings]\n[loss_fn]\ncomponent_key = "loss"\nvariant_key = "clm_cross_entropy_loss"\n'
        '[loss_fn.config]\nother = { instance_key = "missing", pass_type = "BY_REFERENCE" }\n')


def pickle_seeds() -> None:
    copy("pickle_index", "sample_eval.idx", SAMPLE / "eval.idx")
    copy("pickle_index", "sample_train.idx", SAMPLE / "train.idx")
    # (No byte-for-byte copy of the worked example: ../shared/fixtures holds the same bytes, and the
    # provenance check refuses any tracked file equal to a file there.)
    put("pickle_index", "tiny_plus_one.idx", pickle.dumps([(0, 17), (18, 18), (37, 15)], protocol=4))
    index = [(0, 10), (10, 300), (310, 70000), (70310, 5)]
    for protocol in range(0, 6):
        put("pickle_index", f"protocol_{protocol}.idx", pickle.dumps(index, protocol=protocol))
    put("pickle_index", "empty_list.idx", pickle.dumps([], protocol=4))
    put("pickle_index", "negative_offsets.idx", pickle.dumps([(-12, 10), (-2, 8)], protocol=4))
    put("pickle_index", "big_ints.idx", pickle.dumps([(2**63, 1), (2**70, 2**64)], protocol=4))
    # Issue 16: one 0x94 (MEMOIZE) turned into 0x95 (FRAME) made our old reader skip an entry.
    raw = bytearray((SAMPLE / "eval.idx").read_bytes())
    flip = raw.index(0x94, 20)
    raw[flip] = 0x95
    put("pickle_index", "flipped_memoize_to_frame.idx", bytes(raw))
    put("pickle_index", "truncated.idx", (SAMPLE / "eval.idx").read_bytes()[:40])
    put("pickle_index", "data_after_stop.idx", (SAMPLE / "eval.idx").read_bytes() + b"\x80\x04N.")

    class RunsCode:  # never unpickled here: only its bytes (GLOBAL/STACK_GLOBAL + REDUCE) are written
        def __reduce__(self):
            return (print, ("an index must never run code",))

    for protocol in (0, 2, 4):
        put("pickle_index", f"reduce_protocol_{protocol}.idx", pickle.dumps([RunsCode()], protocol=protocol))


def pbin_seeds() -> None:
    copy("pbin", "sample_eval.pbin", SAMPLE / "eval.pbin")
    tiny = TINY_PBIN
    put("pbin", "header_only.pbin", tiny[:12])
    put("pbin", "truncated_index.pbin", tiny[:-3])
    put("pbin", "huge_data_length.pbin", b"\xff" * 8 + tiny[8:])
    put("pbin", "token_size_3.pbin", tiny[:8] + (3).to_bytes(4, "little") + tiny[12:])
    # A Modalities-merged file of two copies of tiny.pbin: data concatenated, index runs shifted
    # the way Modalities' merge writes them (each later run's offsets 12 bytes short per input).
    data_len = int.from_bytes(tiny[:8], "little")
    token_size = tiny[8:12]
    data = tiny[12:12 + data_len]
    entries = pickle.loads(tiny[12 + data_len:])
    merged_index = list(entries) + [(o + data_len - 12, n) for o, n in entries]
    merged = (2 * data_len).to_bytes(8, "little") + token_size + data + data + pickle.dumps(merged_index, protocol=4)
    put("pbin", "merged_like_modalities.pbin", merged)


def jsonl_seeds() -> None:
    put("jsonl", "tiny_plus_one.jsonl", TINY_JSONL + b'{"text": "Bye"}\n')
    # Nine documents of the sample corpus without the last newline.
    put("jsonl", "sample_without_last_newline.jsonl",
        b"".join((SAMPLE / "eval.jsonl").read_bytes().splitlines(keepends=True)[:9]).rstrip(b"\n"))
    put("jsonl", "lone_surrogates.jsonl",
        '{"text": "ok", "meta": "\\ud800"}\n{"text": "bad \\udc00 text"}\n{"text": "pair \\ud83d\\ude00"}\n')
    put("jsonl", "mixed_faults.jsonl",
        '{"text": "a"}\n\n{"text": 1}\n{"txt": "b"}\n{"text": "c"\n{"text": "d"}\r\n \n{"text": "\\u0000"}')
    put("jsonl", "invalid_utf8.jsonl", b'{"text": "\xc3\x28"}\n{"text": "fine"}\n')
    put("jsonl", "deep_nesting.jsonl", '{"text": "x", "deep": ' + "[" * 3000 + "]" * 3000 + "}\n")
    put("jsonl", "jq_first_line.jsonl", '.meta.title\n{"meta": {"title": "t"}, "text": "x"}\n')


def tokenizer_seeds() -> None:
    for name in ("bl_gpt2_regex", "bl_bert", "bl_nfkc", "bl_classes", "ch_byte_fallback", "ch_unk"):
        copy("tokenizer_json", f"{name}.json", TOK / f"{name}.json")
    base = json.loads((TOK / "bl_gpt2_regex.json").read_text(encoding="utf-8"))
    bad_padding = dict(base, padding={"strategy": "Nonsense", "direction": "Sideways"})
    put("tokenizer_json", "bad_padding.json", json.dumps(bad_padding))
    bad_truncation = dict(base, truncation={"max_length": -1})
    put("tokenizer_json", "bad_truncation.json", json.dumps(bad_truncation))
    classes = json.loads(json.dumps(base))
    classes["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "[\\p{P}\\p{S}]+|\\s+|[^\\p{P}\\p{S}\\s]+"},
                                "behavior": "Isolated", "invert": False}
    put("tokenizer_json", "property_classes.json", json.dumps(classes))
    put("tokenizer_json", "not_json.json", "{ this is not json")


def checkpoint_seeds() -> None:
    manifest = (CKPT_FOLDER / "manifest.json").read_bytes()
    put("checkpoint", "manifest_plain", b"\x00" + manifest)
    put("checkpoint", "manifest_named", b"\x01" + manifest)
    m = json.loads(manifest)
    m["training_progress"]["num_seen_steps_total"] = 4  # contradicts the folder name seen_steps_2
    put("checkpoint", "manifest_contradicts_name", b"\x01" + json.dumps(m, indent=2).encode())
    m = json.loads(manifest)
    m["training_progress"]["num_seen_tokens_total"] = "64"
    put("checkpoint", "manifest_string_progress", b"\x01" + json.dumps(m, indent=2).encode())
    m = json.loads(manifest)
    del m["tensors"]
    put("checkpoint", "manifest_without_tensors", b"\x00" + json.dumps(m).encode())
    put("checkpoint", "manifest_truncated", b"\x00" + manifest[: len(manifest) // 2])
    app_state = (CKPT_FOLDER / "app_state.safetensors").read_bytes()
    put("checkpoint", "safetensors_app_state", b"\x02" + app_state)
    put("checkpoint", "safetensors_after_step_3", b"\x02" + (CKPT / "after_step_3.safetensors").read_bytes())
    put("checkpoint", "safetensors_truncated", b"\x02" + app_state[:100])
    put("checkpoint", "safetensors_huge_header", b"\x02" + (2**62).to_bytes(8, "little") + app_state[8:])


def sentencepiece_seeds() -> None:
    model = (ROOT / "plugins" / "sp_tokenizer" / "tests" / "data" / "tiny_bpe.model").read_bytes()
    put("sentencepiece", "tiny_bpe.model", model)
    put("sentencepiece", "tiny_bpe_truncated.model", model[: len(model) // 2])
    put("sentencepiece", "empty.model", b"")


def yaml_seeds() -> None:
    config = (
        "settings:\n  experiment_id: ${modalities_env:experiment_id}\n  step_profile: &profile\n"
        "    sequence_length: 256\n    local_train_micro_batch_size: 4\n  copy: *profile\n"
        "model:\n  component_key: model\n  variant_key: gpt2\n  config:\n    n_layer: 2\n"
        "    dropout: 0.0\n    bias: yes\n    eps: 1e-5\n    rope: ~\n    hex: 0x1A\n    sexagesimal: 1:30\n"
        "    tagged: !!float 3\n    quoted: \"42\"\n    items: [1, 2.5, null, true]\n")
    put("yaml", "config.yaml", config)
    put("yaml", "cr_line_breaks.yaml", config.replace("\n", "\r"))
    put("yaml", "nel_line_breaks.yaml", config.replace("\n", "\u0085"))
    put("yaml", "second_document.yaml", config + "---\nother: 1\n")
    put("yaml", "recursive_anchor.yaml", "a: &a [*a]\n")
    put("yaml", "recursive_map_anchor.yaml", "a: &a {b: *a}\n")
    laughs = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, "
        f"*a{i - 1}, *a{i - 1}]\n" for i in range(1, 9))
    put("yaml", "billion_laughs.yaml", laughs)
    put("yaml", "long_number.yaml", "n: " + "9" * 27000 + "\n")
    put("yaml", "bad_numbers.yaml", "a: 0b_\nb: 0x_\nc: 1e999\nd: -9223372036854775808\n")
    put("yaml", "unknown_tag.yaml", "a: !!binary aGVsbG8=\n")
    put("yaml", "merge_key.yaml", "base: &b {x: 1}\nd:\n  <<: *b\n")
    put("yaml", "not_a_mapping.yaml", "- 1\n- 2\n")


def jinja_seeds() -> None:
    import tomllib
    cfg = tomllib.loads((ROOT / "configs" / "instruction_tuning" / "apply_chat_template.toml").read_text(encoding="utf-8"))
    put("jinja", "apply_chat_template.jinja", cfg["jinja2_chat_template"])
    put("jinja", "loop_and_filters.jinja",
        "{% for m in messages %}{{ loop.index }}/{{ loop.length }} {{ m.role|upper }}: {{ m.content|trim|e }}"
        "{% if not loop.last %}\n{% endif %}{% endfor %}{{ (1, 2) + (3,) }}{{ [1] + [2] }}{{ 7 // -2 }}")
    put("jinja", "namespace_and_set.jinja",
        "{% set ns = namespace(n=0) %}{% for m in messages if m.role != 'system' %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{{ ns.n }}{{ messages|map(attribute='role')|join(',') }}{{ {'a': 1}|tojson }}")
    put("jinja", "overflow.jinja", "{{ 9223372036854775807 + 1 }}")
    put("jinja", "division_by_zero.jinja", "{{ 1 // 0 }}")
    put("jinja", "big_range.jinja", "{{ range(10**9)|length }}")
    put("jinja", "string_repeat.jinja", "{{ 'ab' * 9223372036854775807 }}")
    put("jinja", "deep_parentheses.jinja", "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}")
    put("jinja", "deep_blocks.jinja", "{% if true %}" * 600 + "x" + "{% endif %}" * 600)
    put("jinja", "unterminated.jinja", "{% for x in messages %}{{ x")
    put("jinja", "raise.jinja", "{{ raise_exception('bad role') }}")


def hf_config_seeds() -> None:
    for cfg in sorted((ROOT / "plugins" / "gpt2" / "tests" / "data" / "hf").glob("import_*/config.json")):
        copy("hf_config", f"{cfg.parent.name}.json", cfg)
    llama = json.loads((ROOT / "plugins/gpt2/tests/data/hf/import_llama/config.json").read_text())
    put("hf_config", "rope_theta_null.json", json.dumps(dict(llama, rope_theta=None)))
    put("hf_config", "huge_hidden.json", json.dumps(dict(llama, hidden_size=2147483648)))
    put("hf_config", "huge_layers.json", json.dumps(dict(llama, num_hidden_layers=2147483648)))
    put("hf_config", "rope_type_conflict.json",
        json.dumps(dict(llama, rope_scaling={"type": "linear", "rope_type": "llama3", "factor": 2.0})))
    text = json.dumps(llama)
    put("hf_config", "duplicated_key.json", text[:-1] + ', "rope_theta": 5.0}')
    put("hf_config", "not_an_object.json", "[1, 2, 3]")
    put("hf_config", "truncated.json", text[: len(text) // 2])


def manifest_seeds() -> None:
    # valid_manifest.json is the manifest of the sharded folder the target writes itself: make it with
    #   MODALITIES_FUZZ_MANIFEST_SEED=tests/fuzz/corpus/manifest/valid_manifest.json \
    #       build/bin/modalities_fuzz_replay_test --gtest_filter='*manifest*'
    # The seeds here are edits of it (what issue 31 found accepted silently).
    put("manifest", "not_an_object.json", "[]")
    valid = CORPUS / "manifest" / "valid_manifest.json"
    if not valid.exists():
        print(f"note: {valid.relative_to(ROOT)} is missing; manifest seeds not derived (see make_corpus.py)")
        return
    text = valid.read_text(encoding="utf-8")
    m = json.loads(text)
    put("manifest", "flipped_digit.json", text.replace('"offsets": [2', '"offsets": [3', 1) if '"offsets": [2' in text
        else text.replace("2", "3", 1))
    put("manifest", "truncated.json", text[: len(text) * 2 // 3])
    def edited(fn):
        d = json.loads(text)
        fn(d)
        return json.dumps(d, indent=1)
    def swap_chunks(d):
        for t in d.get("tensors", {}).values() if isinstance(d.get("tensors"), dict) else []:
            ch = t.get("chunks") if isinstance(t, dict) else None
            if isinstance(ch, list) and len(ch) >= 2:
                ch[0]["offsets"], ch[1]["offsets"] = ch[1]["offsets"], ch[0]["offsets"]
    def duplicate_chunk(d):
        for t in d.get("tensors", {}).values() if isinstance(d.get("tensors"), dict) else []:
            ch = t.get("chunks") if isinstance(t, dict) else None
            if isinstance(ch, list) and ch:
                ch.append(dict(ch[0]))
    put("manifest", "swapped_chunks.json", edited(swap_chunks))
    put("manifest", "duplicated_chunk.json", edited(duplicate_chunk))
    put("manifest", "no_checksum.json", edited(lambda d: d.pop("manifest_sha256", None)))


def main() -> None:
    for old in CORPUS.glob("*/seed_*"):
        old.unlink()
    config_seeds()
    pickle_seeds()
    pbin_seeds()
    jsonl_seeds()
    tokenizer_seeds()
    checkpoint_seeds()
    sentencepiece_seeds()
    yaml_seeds()
    jinja_seeds()
    hf_config_seeds()
    manifest_seeds()
    total = sum(f.stat().st_size for f in CORPUS.rglob("*") if f.is_file())
    print(f"seeds written to {CORPUS.relative_to(ROOT)} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
