#!/usr/bin/env python3
"""Render chat templates with Jinja2 the way Hugging Face `transformers` does.

The reference side of node-pod/tests/template_diff.rs. It replicates
`transformers.utils.chat_template_utils._compile_jinja_template` and
`render_jinja_template` (transformers 4.5x): an `ImmutableSandboxedEnvironment`
with `trim_blocks`, `lstrip_blocks` and the `loopcontrols` extension, the
`raise_exception` and `strftime_now` globals and the `tojson` filter override.
transformers' `{% generation %}` tag (AssistantTracker, which marks assistant
text for training masks) is kept with its tracking left out: it renders its
body unchanged, as in transformers.

Input on stdin (JSON):
    {"now": "2025-01-15T10:30:00",          # what strftime_now() sees
     "templates": {"<name>": "<source>", ...},
     "cases": [{"id": "...", "template": "<name>", "messages": [...],
                "tools": [...] | null, "add_generation_prompt": bool,
                "bos_token": str | null, "eos_token": str | null,
                "extra": {...} | null}, ...]}
Output on stdout (JSON):
    {"jinja2": "<version>",
     "results": {"<id>": {"ok": true, "output": "..."} |
                         {"ok": false, "error": "<ExceptionType>: <message>"}}}
"""
import json
import sys
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class AssistantTracker(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`, without the tracking."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context, caller):
        return caller()


def make_environment(now):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    # transformers overrides Jinja2's tojson: no HTML escaping, and the
    # json.dumps options are exposed. Keep the signature exactly as theirs.
    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return now.strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def describe(exc):
    return f"{type(exc).__name__}: {exc}"


def main():
    request = json.load(sys.stdin)
    env = make_environment(datetime.fromisoformat(request["now"]))

    compiled = {}
    for name, source in request["templates"].items():
        try:
            compiled[name] = env.from_string(source)
        except Exception as exc:  # a template Jinja2 cannot compile fails every case
            compiled[name] = exc

    results = {}
    for case in request["cases"]:
        template = compiled[case["template"]]
        if isinstance(template, Exception):
            results[case["id"]] = {"ok": False, "error": describe(template)}
            continue
        # transformers: template_kwargs = {**special_tokens_map, **kwargs}, then
        # render(messages=, tools=, documents=, add_generation_prompt=, **template_kwargs).
        kwargs = {}
        if case.get("bos_token") is not None:
            kwargs["bos_token"] = case["bos_token"]
        if case.get("eos_token") is not None:
            kwargs["eos_token"] = case["eos_token"]
        kwargs.update(case.get("extra") or {})
        try:
            output = template.render(
                messages=case["messages"],
                tools=case.get("tools"),
                documents=None,
                add_generation_prompt=case["add_generation_prompt"],
                **kwargs,
            )
            results[case["id"]] = {"ok": True, "output": output}
        except Exception as exc:
            results[case["id"]] = {"ok": False, "error": describe(exc)}

    json.dump({"jinja2": jinja2.__version__, "results": results}, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
