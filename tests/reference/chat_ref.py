#!/usr/bin/python3
"""Reference chat-template renderer: python3-jinja2 configured exactly as Hugging Face
transformers' apply_chat_template does (chat_template_utils._compile_jinja_template):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the loopcontrols
extension and a `generation` tag, tojson = json.dumps(ensure_ascii=False, indent, separators,
sort_keys), globals raise_exception and strftime_now. Messages and tools are normalized as
docs/api.md §13.3 says, written here independently of the C code; continue_final_message
is cut with the transformers algorithm.

Usage:
  chat_ref.py CASES.json            render every template x conversation, print JSON results
  chat_ref.py --snippets SNIPPETS.json   re-render the interpreter snippets (print the file)
  chat_ref.py --render TEMPLATE VARS.json [--now UNIX]   print one rendering (debugging)

CASES.json: {"now": unix seconds for strftime_now, "templates": [{"name", "file" (relative to
the cases file), "config": tokenizer_config-like special tokens}], "conversations": [{"name",
"messages", "tools"?, "documents"?, "add_generation_prompt"?, "continue_final_message"?,
"kwargs"?}]}. Result keys are "template/conversation"; values {"text": ...} or
{"raise": message} (raise_exception) or {"error": "<type>: <message>"}.
SNIPPETS.json: {"now", "vars", "snippets": [[template, expected output], ...]}; expected
is what jinja2 renders with those vars (rewritten by --snippets).
Regenerate the goldens with:
  TZ=UTC /usr/bin/python3 tests/reference/chat_ref.py tests/data/chat/cases.json > tests/data/chat/goldens.json
  TZ=UTC /usr/bin/python3 tests/reference/chat_ref.py --snippets tests/data/chat/snippets.json > /tmp/s.json && mv /tmp/s.json tests/data/chat/snippets.json
"""
import json
import os
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRaise(Exception):
    pass


class GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} renders its body unchanged (HF's AssistantTracker
    without the mask bookkeeping)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def make_env(now):
    def raise_exception(message):
        raise TemplateRaise(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.fromtimestamp(now).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def normalize_messages(messages):
    out = []
    for m in messages:
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            content = "\n".join(p["text"] for p in content if p.get("type") == "text")
        msg = {"role": m["role"], "content": content}
        if m["role"] == "assistant" and isinstance(m.get("tool_calls"), list):
            calls = []
            for c in m["tool_calls"]:
                c = dict(c)
                if isinstance(c.get("function"), dict):
                    f = dict(c["function"])
                    if "arguments" in f:
                        f["arguments"] = json.loads(f["arguments"])
                    c["function"] = f
                calls.append(c)
            msg["tool_calls"] = calls
        if m["role"] == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def normalize_tools(tools):
    out = []
    for t in tools:
        fn = t["function"]
        f = {"name": fn["name"], "description": fn.get("description"),
             "parameters": fn.get("parameters")}
        for k, v in fn.items():
            if k not in f:
                f[k] = v
        tool = {"type": "function", "function": f}
        for k, v in t.items():
            if k not in ("type", "function"):
                tool[k] = v
        out.append(tool)
    return out


def config_vars(config):
    v = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        tok = config.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        if tok is not None:
            v[key] = tok
    if config.get("additional_special_tokens") is not None:
        v["additional_special_tokens"] = [t["content"] if isinstance(t, dict) else t
                                          for t in config["additional_special_tokens"]]
    return v


def build_vars(config, conv):
    v = config_vars(config)
    v["tools"] = normalize_tools(conv["tools"]) if conv.get("tools") is not None else None
    v["documents"] = conv.get("documents")
    agp = conv.get("add_generation_prompt", True)
    if conv.get("continue_final_message"):
        agp = False
    v["add_generation_prompt"] = agp
    v.update(conv.get("default_kwargs") or {})
    v.update(conv.get("kwargs") or {})
    v["messages"] = normalize_messages(conv["messages"])
    return v


def continue_final(rendered, final_message):
    """transformers' apply_chat_template continue_final_message cut."""
    if final_message.strip() not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear "
                         "in the chat after applying the chat template!")
    loc = rendered.rindex(final_message.strip())
    if rendered[loc:loc + len(final_message.lstrip())] == final_message:
        return rendered[:loc + len(final_message.lstrip())]
    return rendered[:loc + len(final_message.strip())]


def render_case(template, config, conv):
    try:
        v = build_vars(config, conv)
        text = template.render(**v)
        if conv.get("continue_final_message"):
            text = continue_final(text, v["messages"][-1]["content"])
        return {"text": text}
    except TemplateRaise as e:
        return {"raise": str(e.args[0]) if e.args else ""}
    except Exception as e:  # any other template error: only the kind is compared
        return {"error": "%s: %s" % (type(e).__name__, e)}


def main():
    args = sys.argv[1:]
    if args and args[0] == "--render":
        now = 0
        if "--now" in args:
            now = int(args[args.index("--now") + 1])
        with open(args[1], encoding="utf-8") as f:
            source = f.read()
        with open(args[2], encoding="utf-8") as f:
            v = json.load(f)
        sys.stdout.write(make_env(now).from_string(source).render(**v))
        return
    if args and args[0] == "--snippets":
        with open(args[1], encoding="utf-8") as f:
            snip = json.load(f)
        env = make_env(snip.get("now", 0))
        snip["snippets"] = [[src, env.from_string(src).render(**snip["vars"])]
                            for src, _ in snip["snippets"]]
        json.dump(snip, sys.stdout, ensure_ascii=False, indent=1)
        sys.stdout.write("\n")
        return
    with open(args[0], encoding="utf-8") as f:
        cases = json.load(f)
    base = os.path.dirname(os.path.abspath(args[0]))
    env = make_env(cases.get("now", 0))
    results = {}
    for t in cases["templates"]:
        with open(os.path.join(base, t["file"]), encoding="utf-8", newline="") as f:
            template = env.from_string(f.read())
        for conv in cases["conversations"]:
            results[t["name"] + "/" + conv["name"]] = render_case(template, t.get("config", {}), conv)
    json.dump(results, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
