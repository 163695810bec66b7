#!/usr/bin/python3
"""Structured output end to end: every schema of a MaskBench-style .jsonl(.xz) file is sent as
guided_json to a running pd-scheduler (/v1/completions); every answer that finishes with "stop"
must parse and validate against its schema (python3-jsonschema, the validator of the schema's
$schema draft, else Draft 2020-12); refused schemas (400) are counted with their first words.

    tools/grammar/serve_validate.py --url http://127.0.0.1:PORT [--max-tokens 400]
        [--seeds 2] [--limit N] tests/data/grammar/maskbench-subset.jsonl.xz
Exit status 1 when any finished answer is invalid."""
import argparse, collections, json, lzma, sys, urllib.error, urllib.request
import jsonschema

ap = argparse.ArgumentParser()
ap.add_argument("--url", required=True)
ap.add_argument("--model", default=None)
ap.add_argument("--max-tokens", type=int, default=400)
ap.add_argument("--seeds", type=int, default=2)
ap.add_argument("--limit", type=int, default=0)
ap.add_argument("file")
a = ap.parse_args()
op = lzma.open if a.file.endswith(".xz") else open
n = ok = stop = length = bad = refused = errors = 0
why = collections.Counter()
with op(a.file, "rt") as f:
    for line in f:
        if a.limit and n >= a.limit:
            break
        d = json.loads(line)
        schema = d["schema"]
        n += 1
        for seed in range(a.seeds):
            body = {"prompt": "JSON:", "max_tokens": a.max_tokens, "seed": seed,
                    "temperature": 1.0, "guided_json": schema}
            if a.model:
                body["model"] = a.model
            req = urllib.request.Request(a.url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            try:
                r = json.load(urllib.request.urlopen(req, timeout=120))
            except urllib.error.HTTPError as e:
                msg = json.load(e)["error"]["message"]
                if e.code == 400:
                    refused += 1
                    why[" ".join(msg.split()[:4])] += 1
                else:
                    errors += 1
                    print(f"{d.get('description')}: HTTP {e.code} {msg}", file=sys.stderr)
                break
            c = r["choices"][0]
            if c["finish_reason"] != "stop":
                length += 1
                continue
            stop += 1
            try:
                inst = json.loads(c["text"])
                cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
                cls(schema, format_checker=cls.FORMAT_CHECKER).validate(inst)
                ok += 1
            except Exception as e:  # invalid JSON or a schema violation
                bad += 1
                print(f"INVALID {d.get('description')} seed {seed}: {str(e)[:300]}\n  {c['text'][:300]}",
                      file=sys.stderr)
print(f"schemas {n}, refused {refused} (requests), answers: stop {stop} (valid {ok}, invalid {bad}), "
      f"length {length}, errors {errors}")
for k, v in why.most_common(8):
    print(f"  refused {v}: {k}")
sys.exit(1 if bad or errors else 0)
