#!/usr/bin/python3
"""Counts test results from meson's testlog.json for tests/run.sh.

A test executable that uses tests/unit/harness.h prints "harness: P passed, F failed,
S skipped": its cases are counted one by one. Any other test counts as one, by its
meson result. A crash after some cases still counts as at least one failure. Prints the
failures and skip reasons, then a last line "P F S".
"""
import json
import re
import sys

HARNESS = re.compile(r"^harness: (\d+) passed, (\d+) failed, (\d+) skipped$", re.M)
VERDICT = re.compile(r"^(PASS|FAIL|SKIP) \S+$")

def failure_lines(out):
    """What a failed test printed that says why: the output's last lines (a crash, a
    sanitizer's report), then its failed harness cases, the first five with the lines
    before their verdicts (the assertions). They come last: CI shows a long log's end."""
    lines = out.splitlines()
    cases, since = [], []
    for l in lines:
        m = VERDICT.match(l)
        if m:
            if m.group(1) == "FAIL":
                cases.append(since[-6:] + [l] if len(cases) < 5 else [l])
            since = []
        else:
            since.append(l)
    shown = (["--- the end of its output ---"] if cases else []) + lines[-15:]
    if cases:
        shown.append(f"--- its {len(cases)} failed case(s) ---")
        shown += [l for c in cases for l in c]
    return shown

def main(path):
    p = f = s = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            t = json.loads(line)
            out = (t.get("stdout") or "") + (t.get("stderr") or "")
            result = t.get("result", "ERROR")
            m = HARNESS.findall(out)
            if m:
                tp, tf, ts = (int(x) for x in m[-1])
            elif result == "OK":
                tp, tf, ts = 1, 0, 0
            elif result == "SKIP":
                tp, tf, ts = 0, 0, 1
            else:
                tp, tf, ts = 0, 1, 0
            if result not in ("OK", "SKIP", "EXPECTEDFAIL") and tf == 0:
                tf = 1  # crashed or timed out after its last report
            if tf:
                print(f"FAILED {t['name']} ({result}):")
                for l in failure_lines(out):
                    print("    " + l)
            for reason in re.findall(r"skipped: (.*)", out):
                print(f"skipped {t['name']}: {reason}")
            if result == "SKIP" and not m and "skipped:" not in out:
                print(f"skipped {t['name']}: {out.strip().splitlines()[-1] if out.strip() else 'exit 77'}")
            p, f, s = p + tp, f + tf, s + ts
    print(p, f, s)

if __name__ == "__main__":
    main(sys.argv[1])
