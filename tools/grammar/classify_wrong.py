#!/usr/bin/python3
"""Which keyword each instance pd-maskbench misjudged breaks, by an independent validator
(python3-jsonschema, the validator of the schema's $schema draft, format checks on): the lines
of `pd-maskbench --dump-wrong FILE` are counted by cause. "oneOf: more than one branch" is the
documented loose enforcement (oneOf as anyOf, also inside another keyword); anything else is
printed, and makes the exit status 1.

    pd-maskbench --tokenizer npm:llama3 --quiet --dump-wrong wrong.jsonl INPUT...
    tools/grammar/classify_wrong.py wrong.jsonl"""
import collections, json, sys
import jsonschema


def multi(e):
    if e.validator == "oneOf" and "is valid under each of" in e.message:
        return True
    return any(multi(c) for c in e.context or [])


causes = collections.Counter()
other = 0
for line in open(sys.argv[1]):
    w = json.loads(line)
    cls = jsonschema.validators.validator_for(w["schema"])
    v = cls(w["schema"], format_checker=cls.FORMAT_CHECKER)
    try:
        errs = list(v.iter_errors(json.loads(w["text"])))
    except jsonschema.exceptions.RefResolutionError as e:
        causes["not checked: python-jsonschema cannot resolve a $ref"] += 1
        print(f"{w['doc']}: not checked ({str(e)[:120]})")
        continue
    if w["valid"]:
        cause = "valid instance refused" + (" (invalid per jsonschema)" if errs else "")
    elif not errs:
        cause = "invalid instance accepted, valid per jsonschema (a label of the data set)"
    elif all(multi(e) for e in errs):
        cause = "invalid instance accepted: oneOf matched by more than one branch (documented)"
    else:
        cause = "invalid instance accepted: " + ", ".join(sorted({e.validator for e in errs}))
    causes[cause] += 1
    if "documented" not in cause and "data set" not in cause:
        other += 1
        print(f"{w['doc']}: {cause}\n  {w['text'][:300]}")
for cause, n in causes.most_common():
    print(f"{n:6d}  {cause}")
sys.exit(1 if other else 0)
