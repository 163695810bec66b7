#!/usr/bin/env python3
"""Runs the tests of a pack made by tests/gpu/devpack.sh on a machine without meson's build tree.

The pack's tests.json holds `meson introspect --tests` of the build plus the absolute source and
build paths it was made with. The tests name those paths (PD_SOURCE_ROOT, PD_BUILD_ROOT), so the
runner unpacks the payload, links those paths to this source copy and to the pack's executables when they do not exist here,
then runs every test with its environment and timeout: the unit and integration suites in
parallel, the gpu suite one test at a time (each may take most of the device's memory).
Exit status 77 counts as skipped. Ends with "N passed, M failed, K skipped".
--test NAME (repeatable) runs only those tests; --case NAME (repeatable) only those cases of
them (the harness takes case names as arguments); --verbose prints every test's output, e.g.
    run_tests.py --test gpu/cuda_engine --case cuda_engine_tp2_nccl_matches_tp1_f32_mode
"""
import argparse
import concurrent.futures as cf
import glob
import io
import json
import site
import os
import subprocess
import sys
import tarfile
import time

here = os.path.dirname(os.path.abspath(__file__))
ap = argparse.ArgumentParser()
ap.add_argument("--suite", action="append", help="unit, integration or gpu (default: all)")
ap.add_argument("--test", action="append", help="only this test (e.g. gpu/cuda_split)")
ap.add_argument("--case", action="append", default=[], help="only this case of the tests run")
ap.add_argument("--verbose", action="store_true", help="print every test's whole output")
ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
ap.add_argument("--timeout-multiplier", type=float, default=1.0)
ap.add_argument("--logs", help="write every test's output into this .tar.gz")
ap.add_argument("--source", default=os.getcwd(), help="the source tree here (default: cwd)")
ap.add_argument("--unpack", default="/tmp/pdserve-pack", help="where the payload is unpacked")
args = ap.parse_args()

meta = json.load(open(os.path.join(here, "tests.json")))


def link(target, path):
    if os.path.exists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.symlink(target, path)


unpacked = os.path.join(args.unpack, "build")
if not os.path.isdir(unpacked):
    with tarfile.open(os.path.join(here, "payload.tar.xz")) as t:
        t.extractall(args.unpack, filter="tar")
    # The carried libraries only fill gaps: where this machine has a library of the same name
    # (often newer, e.g. libstdc++), its own is used.
    known = subprocess.run(["ldconfig", "-p"], stdout=subprocess.PIPE, text=True).stdout
    have = {line.split()[0] for line in known.splitlines()[1:] if line.strip()}
    for name in os.listdir(os.path.join(args.unpack, "lib")):
        if name in have:
            os.remove(os.path.join(args.unpack, "lib", name))
link(os.path.abspath(args.source), meta["source_root"])
link(unpacked, meta["build_root"])
npm_dir = os.path.join(args.unpack, "npm")

libs = [os.path.join(args.unpack, "lib"), "/usr/local/cuda/lib64"]
# NCCL may come only with a Python wheel (nvidia-nccl-*) on such a machine.
for sp in site.getsitepackages():
    libs += sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib")))
base_env = dict(os.environ)
base_env["LD_LIBRARY_PATH"] = ":".join(libs + [os.environ.get("LD_LIBRARY_PATH", "")])

tests = [t for t in meta["tests"]
         if (not args.suite or any(s.split(":")[-1] in args.suite for s in t["suite"]))
         and (not args.test or t["name"] in args.test)]
results = {}


def fix_path(arg):
    """BUILD/../x names x in the source tree, also when BUILD is a link to the unpacked pack."""
    prefix = meta["build_root"] + "/../"
    if arg.startswith(prefix):
        return os.path.join(meta["source_root"], arg[len(prefix):])
    return arg


def run(t):
    env = dict(base_env)
    env.update(t["env"])
    if os.path.isdir(npm_dir):
        env["PD_NPM_CACHE"] = npm_dir
    t0 = time.time()
    limit = t["timeout"] * args.timeout_multiplier if t["timeout"] else None
    try:
        p = subprocess.run([fix_path(a) for a in t["cmd"]] + args.case, env=env, cwd=t["workdir"] or meta["build_root"], timeout=limit,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", (e.stdout or b"")
    except OSError as e:  # the test's interpreter or tool is missing on this machine
        rc, out = "not run", str(e).encode()
    dt = time.time() - t0
    status = "SKIP" if rc == 77 else "OK" if rc == 0 else "FAIL"
    print(f"{status:4} {t['name']:32} {dt:7.1f} s  (rc {rc})", flush=True)
    results[t["name"]] = (status, out.decode(errors="replace"))


gpu = [t for t in tests if any(s.endswith(":gpu") for s in t["suite"])]
rest = [t for t in tests if t not in gpu]
with cf.ThreadPoolExecutor(max_workers=args.jobs) as ex:
    list(ex.map(run, rest))
for t in gpu:
    run(t)

counts = {s: sum(1 for v in results.values() if v[0] == s) for s in ("OK", "FAIL", "SKIP")}
for name, (status, out) in sorted(results.items()):
    if args.verbose:
        print(f"\n===== {name} ({status})")
        print(out)
    elif status == "FAIL":
        print(f"\n===== {name} (last 60 lines)")
        print("\n".join(out.splitlines()[-60:]))
if args.logs:
    with tarfile.open(args.logs, "w:gz") as tar:
        for name, (status, out) in results.items():
            data = out.encode()
            info = tarfile.TarInfo(name.replace("/", "_") + ".log")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
print(f"{counts['OK']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
sys.exit(1 if counts["FAIL"] else 0)
