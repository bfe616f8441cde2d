#!/usr/bin/env python3
"""Reference renderings for tests/data/jinja_test.cpp: each case's template rendered by jinja2 in
the environment Modalities uses for chat templates (ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, a tojson filter with ensure_ascii=False, raise_exception).

    .deps/bench/bin/python scripts/reference/make_jinja_reference.py tests/data/jinja/reference.json
"""
import json
import sys
from pathlib import Path

import jinja2
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def env():
    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    e = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    e.filters["tojson"] = tojson
    e.globals["raise_exception"] = raise_exception
    return e


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there, \"friend\" — ça va? 😀"},
    {"role": "assistant", "content": "Fine.\nThanks!"},
    {"role": "user", "content": "  Tabs\tand spaces  "},
]

MODALITIES = (
    "{{ chat_template_data.system_instruction + '\\n' }}\n"
    "{% for turn in messages %}\n"
    "{{ turn.role + ':' }}\n"
    "{% if turn.role == chat_template_data.assistant_role %}\n"
    "{{ chat_template_data.special_tokens.b_include_to_loss_token}}\n"
    "{% else %}\n"
    "{{ \" \" }}\n"
    "{% endif %}\n"
    "{{ turn.content + '\\n'}}\n"
    "{% if turn.role == chat_template_data.assistant_role %}\n"
    "{{ chat_template_data.special_tokens.e_assistant_token}}\n"
    "{{ chat_template_data.special_tokens.e_include_to_loss_token}}\n"
    "{% endif %}\n"
    "{% endfor %}\n"
)
CTD = {"assistant_role": "Assistant", "system_instruction": "You are Mody.",
       "special_tokens": {"b_include_to_loss_token": "<|im_start|>", "e_include_to_loss_token": "<|im_end|>",
                          "e_assistant_token": "<|endoftext|>"}}
MAPPED = [{"role": {"system": "System", "user": "User", "assistant": "Assistant"}[m["role"]], "content": m["content"]}
          for m in CHAT]

CASES = [
    # Modalities' tutorial template, after its "}\n{" -> "}{" rewrite.
    ("modalities_tutorial", MODALITIES.replace("}\n{", "}{"), {"messages": MAPPED, "chat_template_data": CTD}),
    ("modalities_tutorial_raw", MODALITIES, {"messages": MAPPED, "chat_template_data": CTD}),
    ("chatml", "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
               "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
               "{% endif %}", {"messages": CHAT, "add_generation_prompt": True}),
    ("llama3_style", "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                     "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
                     "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                     "{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
                     "<|end_header_id|>\\n\\n' }}{% endif %}",
     {"messages": CHAT, "bos_token": "<|begin_of_text|>", "add_generation_prompt": False}),
    ("alternation_check", "{% for message in messages[1:] %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) "
                          "%}{{ raise_exception('roles must alternate') }}{% endif %}[{{ loop.index }}/{{ loop.length }}"
                          "{{ '|last' if loop.last }}]{{ message.content|length }} {% endfor %}", {"messages": CHAT}),
    ("alternation_error", "{% for message in messages %}{% if message.role == 'assistant' %}{{ raise_exception("
                          "'no assistant: ' ~ loop.index) }}{% endif %}{% endfor %}", {"messages": CHAT}),
    ("whitespace_control", "A  \n  {%- if x -%}  \n B {{- y -}}  \n{% endif %}\n    {% if x %}\n  C\n    {% endif %}\n"
                           "    {%+ if x %}D{% endif %}\n{# comment #}\nE {{ y }}\n{{ y }}  \n  {#- c -#}  F\n",
     {"x": True, "y": "why"}),
    ("loop_else_filter", "{% for m in messages if m.role != 'system' %}{{ m.role|upper }}{{ ',' if not loop.last }}"
                         "{% else %}none{% endfor %}|{% for x in [] %}x{% else %}empty{% endfor %}", {"messages": CHAT}),
    ("namespace", "{% set ns = namespace(system='', n=0) %}{% for m in messages %}{% if m.role == 'system' %}"
                  "{% set ns.system = m.content %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                  "{{ ns.system }}/{{ ns.n }}", {"messages": CHAT}),
    ("scoping", "{% set a = 1 %}{% for i in range(3) %}{% set a = a + i %}{{ a }}{% endfor %}:{{ a }}", {}),
    ("values_str", "{{ none }} {{ true }} {{ 1.0 }} {{ 2.5e-7 }} {{ 1e16 }} {{ 10 // 3 }} {{ -7 % 3 }} {{ 7 / 2 }} "
                   "{{ [1, 'a', none, true] }} {{ {'k': [1.5, 'it\\'s']} }} {{ 'x' * 3 }} {{ 2 ** 10 }} {{ undefined_var }}"
                   "|{{ (1, 2) }}", {}),
    ("tojson", "{{ messages[1] | tojson }} {{ {'a': 1.0, 'b': [none, false], 'c': 'tab\\t'} | tojson }} "
               "{{ 0.1 | tojson }} {{ 123456789012345678 | tojson }}", {"messages": CHAT}),
    ("tests_and_ops", "{{ x is defined }} {{ y is defined }} {{ x is string }} {{ 3 is odd }} {{ none is none }} "
                      "{{ 'a' in 'cat' }} {{ 'z' not in ['a'] }} {{ 1 if x else 2 }} {{ 'k' in {'k': 1} }} "
                      "{{ not x and 0 or 'fallback' }} {{ x is not none }} {{ 2 < 3 <= 3 }} {{ 'b' ~ 1 ~ none }}",
     {"x": "s"}),
    ("filters", "{{ '  pad ' | trim }}|{{ 'hello world' | title }}|{{ 'HeLLo' | capitalize }}|{{ [3, 1, 2] | sort | "
                "join(',') }}|{{ [1, 2, 2, 3] | unique | list | length }}|{{ messages | map(attribute='role') | join(' ') }}"
                "|{{ messages | selectattr('role', 'equalto', 'user') | list | length }}|{{ messages | rejectattr('role', "
                "'eq', 'user') | map(attribute='role') | first }}|{{ 'a-b-c' | replace('-', '+') }}|{{ x | default('d') }}"
                "|{{ '' | default('e', true) }}|{{ [1, 2, 3] | last }}|{{ [1, 2, 3] | reverse | list }}|{{ 2.567 | round(1) }}"
                "|{{ -3 | abs }}|{{ '42' | int + 1 }}|{{ 'x\\ny' | indent(2) }}|{{ {'b': 1, 'a': 2} | items | list }}",
     {"messages": CHAT}),
    ("methods_slices", "{{ s.strip() }}|{{ s.split() }}|{{ 'a,b'.split(',') }}|{{ s.startswith('  a') }}|{{ s.upper() }}"
                       "|{{ d.get('k') }}|{{ d.get('z', 'dflt') }}|{{ d.keys() | list }}|{{ d.values() | list }}"
                       "|{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|{{ 'abcdef'[1:4] }}|{{ [1,2,3,4][::-1] }}"
                       "|{{ 'abc'[-1] }}|{{ messages[-1]['content'][:5] }}",
     {"s": "  a b  c ", "d": {"k": "v", "n": 2}, "messages": CHAT}),
    ("unicode_strings", "{{ s | trim }}|{{ s.strip() }}|{{ s.split() }}|{{ s.split(None, 1) }}|{{ t[1] }}|{{ t[-1] }}"
                        "|{{ t[:2] }}|{{ t[::-1] }}|{{ t | reverse }}|{{ t | length }}|{{ 'a b c'.split(' ', 1) }}"
                        "|{{ 'x'.startswith(('y', 'x')) }}|{{ 'aXbXc'.replace('X', '-', 1) }}|{{ '--x--'.strip('-') }}"
                        "|{{ 'xyx' | trim('x') }}|{{ ['b', 'A', 'a'] | sort }}|{{ ['a', 'A', 'b'] | unique | list }}"
                        "|{{ '3.5' | float }}|{{ '12abc' | int }}|{{ ' 7 ' | int }}|{{ true is number }}"
                        "|{{ '\\u00e9\\x41' }}|{{ 2 * 3 ~ 4 }}",
     {"s": "\u3000 hi\u00a0 there \u3000\x1c", "t": "héllo wörld 😀"}),
    ("undefined_attribute_error", "{{ missing.attr }}", {}),
]


def main(out: Path):
    e = env()
    cases = []
    for name, template, ctx in CASES:
        case = {"name": name, "template": template, "context": ctx}
        try:
            case["output"] = e.from_string(template).render(**ctx)
        except Exception as ex:  # noqa: BLE001 (every jinja2 error is a case outcome)
            case["error"] = f"{type(ex).__name__}: {ex}"
        cases.append(case)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"jinja2": jinja2.__version__, "cases": cases}, ensure_ascii=False, indent=1) + "\n")
    print(f"{len(cases)} cases, jinja2 {jinja2.__version__} -> {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("tests/data/jinja/reference.json"))
