#!/usr/bin/env bash
# Checks the deployment files without running them (tests/deploy builds and runs the images):
#  1. deploy/run_instance.sh --dry-run for a generated 1P1D TP2 ranktable set (GPUs 4,5 / 6,7):
#     the docker command of each instance (devices, --net=host, env, read-only mounts, name,
#     pass-through flags), that its env + mounts lead start_servers.sh's own check to the right
#     role, and its errors; with pd-ranktable and with the python3 fallback.
#  2. deploy/k8s: ranktables.yaml is what gen_ranktables.sh makes, its tables pass pd-ranktable
#     check, and the StatefulSets agree with them (replicas, GPUs = TP, ports = NODE_PORTS, each
#     pod's RANK_TABLE_FILE_PATH names its own table, DNS names, hostNetwork, probes, Services);
#     Kubernetes JSON-schema validation (npm kubernetes-models) when the npm cache has it.
#  3. deploy/Dockerfile*: structure (stages, COPY sources, entry point), every RUN through `sh -n`,
#     the packages from install_deps.sh, the ldd -> package step run on our executables,
#     and dockerfile-utils' linter (npm) when the npm cache has it.
#  4. bash -n and shellcheck (warnings and errors, following sourced files) on every deploy script; each one's --help
#     under `sh` (dash, as the guide runs start_servers.sh) and under bash in POSIX mode.
# Prints "harness: P passed, F failed, S skipped"; exit 0 when nothing failed.
set -uo pipefail
src=${PD_SOURCE_ROOT:?} bin=${PD_BUILD_ROOT:?}
py=/usr/bin/python3
rtbin="$bin/ranktable/cli/pd-ranktable"
work=$(mktemp -d "${TMPDIR:-/tmp}/pddeploy.XXXXXX")
trap 'rm -rf "$work"' EXIT
npass=0 nfail=0 nskip=0
ok() { echo "ok   $*"; npass=$((npass + 1)); }
bad() { echo "FAIL $*"; nfail=$((nfail + 1)); }
skip() { echo "skipped: $*"; nskip=$((nskip + 1)); }
indent() { sed 's/^/    /'; }
# check DESCRIPTION COMMAND...: passes when the command exits 0; its output is shown on failure.
check() {
    local d=$1 out; shift
    if out=$("$@" 2>&1); then ok "$d"; else bad "$d"; indent <<<"$out" | tail -n 25; fi
}
# refuses DESCRIPTION EXPECTED-TEXT COMMAND...: passes when the command fails and says EXPECTED-TEXT.
refuses() {
    local d=$1 want=$2 out; shift 2
    if out=$("$@" 2>&1); then bad "$d (accepted)"; indent <<<"$out"
    elif grep -qF -- "$want" <<<"$out"; then ok "$d"
    else bad "$d (unclear message)"; echo "    want: $want"; indent <<<"$out"; fi
}
[ -x "$rtbin" ] || { echo "FAIL pd-ranktable not built at $rtbin"; echo "harness: 0 passed, 1 failed, 0 skipped"; exit 1; }
$py -c 'import yaml' 2>/dev/null || { echo "FAIL python3-yaml missing (deploy/install_deps.sh installs it)"; echo "harness: 0 passed, 1 failed, 0 skipped"; exit 1; }

# ---- 1. run_instance.sh ------------------------------------------------------------------------
rt="$work/rt" model="$work/models/llama"
mkdir -p "$model"
"$rtbin" --mode gen --prefill-server-list 4,5 --decode-server-list 6,7 --api-server \
    --server-ip 10.0.0.5 --save-dir "$rt" >/dev/null || { bad "pd-ranktable gen"; exit 1; }
G="$rt/global_ranktable_10.0.0.5.json"
flags=(--model "$model" --tensor-parallel-size=2 --max-model-len=4096 --max-num-seqs=256
       --max-num-batched-tokens=4096 --host=0.0.0.0 --served-model-name "my model")
ri() { PD_BIN_DIR="$bin/ranktable/cli" NODE_PORTS=8088,8089 USE_OPENAI=1 "$src/deploy/run_instance.sh" "$@"; }
for spec in prefill:45:8088 decode:67:8089 scheduler:host:9000; do
    IFS=: read -r role t port <<<"$spec"
    if ri --dry-run --image pdserve:cuda --global "$G" --local "$rt/local_ranktable_10.0.0.5_$t.json" \
        "${flags[@]}" --port="$port" >"$work/$role.cmd" 2>"$work/$role.err"; then
        ok "run_instance.sh --dry-run $role"
    else
        bad "run_instance.sh --dry-run $role"; indent <"$work/$role.err"
    fi
done
# python3 fallback (no pd-ranktable anywhere): the same commands
mkdir -p "$work/empty"
for spec in prefill:45:8088 decode:67:8089 scheduler:host:9000; do
    IFS=: read -r role t port <<<"$spec"
    PD_BIN_DIR="$work/empty" PATH="/usr/bin:/bin" NODE_PORTS=8088,8089 "$src/deploy/run_instance.sh" --dry-run \
        --image pdserve:cuda --global "$G" --local "$rt/local_ranktable_10.0.0.5_$t.json" \
        "${flags[@]}" --port="$port" >"$work/$role.cmd2" 2>&1
done
# the CPU KV budget reaches the container when it is set (and only then)
VLLM_CPU_KVCACHE_SPACE=2 ri --dry-run --image pdserve:cpu --global "$G" \
    --local "$rt/local_ranktable_10.0.0.5_45.json" "${flags[@]}" --port=8088 >"$work/kvspace.cmd" 2>&1
check "VLLM_CPU_KVCACHE_SPACE passed to the container when set" \
    grep -q -- "-e VLLM_CPU_KVCACHE_SPACE=2" "$work/kvspace.cmd"
check "VLLM_CPU_KVCACHE_SPACE not passed when unset" \
    bash -c '! grep -q VLLM_CPU_KVCACHE_SPACE "$1"' _ "$work/prefill.cmd"
# CPU instances share the host's core budget: its segment is mounted, unless turned off or pinned
ri --dry-run --no-gpus --image pdserve:cpu --global "$G" --local "$rt/local_ranktable_10.0.0.5_67.json" \
    "${flags[@]}" --port=8089 >"$work/budget.cmd" 2>&1
check "CPU instance: the host core budget mounted" \
    grep -q -- "-v /dev/shm/pdserve-cpu-host:/dev/shm/pdserve-cpu-host " "$work/budget.cmd"
PD_CPU_BUDGET=rack1 ri --dry-run --no-gpus --image pdserve:cpu --global "$G" \
    --local "$rt/local_ranktable_10.0.0.5_67.json" "${flags[@]}" --port=8089 >"$work/budget2.cmd" 2>&1
check "CPU instance: a named budget mounted and passed" \
    grep -q -- "-e PD_CPU_BUDGET=rack1 -v /dev/shm/pdserve-cpu-rack1:/dev/shm/pdserve-cpu-rack1 " "$work/budget2.cmd"
VLLM_CPU_OMP_THREADS_BIND=0-3 ri --dry-run --no-gpus --image pdserve:cpu --global "$G" \
    --local "$rt/local_ranktable_10.0.0.5_67.json" "${flags[@]}" --port=8089 >"$work/budget3.cmd" 2>&1
check "CPU instance pinned: the bind list passed, no budget mounted" \
    bash -c 'grep -q -- "-e VLLM_CPU_OMP_THREADS_BIND=0-3 " "$1" && ! grep -q pdserve-cpu "$1"' _ "$work/budget3.cmd"
check "GPU instances: no core budget mounted" \
    bash -c '! grep -q pdserve-cpu "$1"' _ "$work/decode.cmd"
check "python3 fallback gives the same docker commands" \
    cmp <(cat "$work"/{prefill,decode,scheduler}.cmd) <(cat "$work"/{prefill,decode,scheduler}.cmd2)

check "docker commands: devices, --net=host, env, mounts, names, flags" \
    $py - "$work" "$rt" "$model" "$rtbin" <<'PY'
import os, shlex, subprocess, sys
work, rt, model, rtbin = sys.argv[1:5]
flags = ["--model", model, "--tensor-parallel-size=2", "--max-model-len=4096", "--max-num-seqs=256",
         "--max-num-batched-tokens=4096", "--host=0.0.0.0", "--served-model-name", "my model"]
want = {"prefill": ("45", "4,5", 8088, "prefill 0"), "decode": ("67", "6,7", 8089, "decode 0"),
        "scheduler": ("host", None, 9000, "scheduler 0")}
for role, (t, devs, port, ident) in want.items():
    argv = shlex.split(open(f"{work}/{role}.cmd").read())
    assert argv[:3] == ["docker", "run", "-d"], argv[:3]
    i = argv.index("pdserve:cuda")
    opts, passed = argv[3:i], argv[i + 1:]
    assert passed == flags + [f"--port={port}"], f"{role}: pass-through flags changed: {passed}"
    def values(flag):
        return [opts[k + 1] for k in range(len(opts) - 1) if opts[k] == flag]
    assert "--net=host" in opts, f"{role}: no --net=host"
    assert values("--name") == [f"pd-{role}-0-10.0.0.5"], values("--name")
    assert values("--shm-size") == ["16g"], values("--shm-size")
    gpus = values("--gpus")
    if devs:
        assert gpus == [f'"device={devs}"'], f"{role}: --gpus {gpus}"
    else:
        assert gpus == [], f"scheduler must get no GPU: {gpus}"
    env = dict(e.split("=", 1) for e in values("-e"))
    local = f"local_ranktable_10.0.0.5_{t}.json"
    assert env["GLOBAL_RANK_TABLE_FILE_PATH"] == "/etc/pdserve/ranktable/global_ranktable_10.0.0.5.json", env
    assert env["RANK_TABLE_FILE_PATH"] == f"/etc/pdserve/ranktable/{local}", env
    assert env["NODE_PORTS"] == "8088,8089" and env["USE_OPENAI"] == "1", env
    mounts = {}
    for v in values("-v"):
        host, ctr, mode = v.split(":")
        assert mode == "ro", f"{role}: mount {v} is not read-only"
        mounts[ctr] = host
    assert mounts.get(model) == model, f"{role}: model not mounted at the same path: {mounts}"
    assert os.path.samefile(mounts["/etc/pdserve/ranktable/" + local], f"{rt}/{local}"), mounts
    # what start_servers.sh checks inside the container, on the files the mounts bring in
    g_host = mounts[env["GLOBAL_RANK_TABLE_FILE_PATH"]]
    l_host = mounts[env["RANK_TABLE_FILE_PATH"]]
    r = subprocess.run([rtbin, "--mode", "check", "--global-ranktable-list", g_host,
                        "--local-ranktable-list", l_host], capture_output=True, text=True)
    assert r.returncode == 0 and f": {ident} of " in r.stdout, f"{role}: {r.stdout}{r.stderr}"
print("3 instances ok")
PY

L="$rt/local_ranktable_10.0.0.5_45.json"
refuses "scheduler without NODE_PORTS" "needs NODE_PORTS" \
    env -u NODE_PORTS "$src/deploy/run_instance.sh" --dry-run --global "$G" --local "$rt/local_ranktable_10.0.0.5_host.json"
echo '{"version":"1.0","status":"completed","group_id":"0","server_count":"1","server_list":[{"server_id":"9.9.9.9","server_ip":"9.9.9.9","device":[{"device_id":"7","device_ip":"9.9.9.9","rank_id":"0"}]}]}' >"$work/stray.json"
refuses "a table of no instance (pd-ranktable)" "does not match an instance" ri --dry-run --global "$G" --local "$work/stray.json"
refuses "a table of no instance (python3)" "matches no instance" \
    env PD_BIN_DIR="$work/empty" PATH=/usr/bin:/bin "$src/deploy/run_instance.sh" --dry-run --global "$G" --local "$work/stray.json"
refuses "no global ranktable" "no global ranktable" env -u GLOBAL_RANK_TABLE_FILE_PATH "$src/deploy/run_instance.sh" --dry-run --local "$L"
refuses "unreadable ranktable" "cannot read ranktable" ri --dry-run --global "$work/nope.json" --local "$L"
refuses "relative --model" "give an absolute path" bash -c "cd '$work' && PD_BIN_DIR='$bin/ranktable/cli' '$src/deploy/run_instance.sh' --dry-run --global '$G' --local '$L' --model models/llama"
refuses "missing model directory" "is not a directory" ri --dry-run --global "$G" --local "$L" --model "$work/none"
refuses "bad USE_OPENAI" "USE_OPENAI must be 0 or 1" ri --dry-run --global "$G" --local "$L" --use-openai 2
out=$(ri --dry-run --global "$G" --local "$L" --name 'my/name' --shm-size 1g --foreground --no-gpus --docker-arg=--restart=always -- --model "$model" --port 1 2>&1)
check "options: --name sanitised, --shm-size, --foreground, --no-gpus, --docker-arg, flags after --" \
    $py -c 'import shlex,sys; a=shlex.split(sys.argv[1]); i=a.index("pdserve:latest")
assert "-d" not in a and "--gpus" not in a and a[a.index("--name")+1]=="my-name" and a[a.index("--shm-size")+1]=="1g", a
assert a[i-1]=="--restart=always" and a[i+1:]==["--model",sys.argv[2],"--port","1"], a
assert sys.argv[2]+":"+sys.argv[2]+":ro" in a, a' "$out" "$model"

# ---- 2. Kubernetes manifests ---------------------------------------------------------------------
k8s="$src/deploy/k8s"
if PD_BIN_DIR="$bin/ranktable/cli" "$k8s/gen_ranktables.sh" --out "$work/ranktables.yaml" 2>"$work/gen.err"; then
    check "deploy/k8s/ranktables.yaml is what gen_ranktables.sh makes" diff -u "$k8s/ranktables.yaml" "$work/ranktables.yaml"
else
    bad "gen_ranktables.sh"; indent <"$work/gen.err"
fi
refuses "gen_ranktables.sh: bad count" "--decode must be a positive integer" \
    env PD_BIN_DIR="$bin/ranktable/cli" "$k8s/gen_ranktables.sh" --decode 0
PD_BIN_DIR="$bin/ranktable/cli" "$k8s/gen_ranktables.sh" --prefill 2 --decode 3 --prefill-tp 4 --decode-tp 1 \
    --namespace ns2 --out "$work/rt23.yaml" 2>&1
mkdir -p "$work/k8s"
check "manifests agree with their ranktables (and a 2P3D set checks)" \
    $py - "$k8s" "$work/k8s" "$rtbin" "$work/rt23.yaml" <<'PY'
import json, os, re, subprocess, sys, yaml
k8s, out, rtbin, rt23 = sys.argv[1:5]

def tables(cm_file, sub):
    """Writes a ConfigMap's tables out and checks them with pd-ranktable; returns data, roles."""
    cm = yaml.safe_load(open(cm_file))
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "pdserve-ranktables", cm["metadata"]
    d = os.path.join(out, sub); os.makedirs(d)
    for k, v in cm["data"].items():
        if k.endswith(".json"):
            json.loads(v)
            open(os.path.join(d, k), "w").write(v)
    locs = sorted(k for k in cm["data"] if k.startswith("local_ranktable_"))
    r = subprocess.run([rtbin, "--mode", "check", "--global-ranktable-list", f"{d}/global_ranktable.json",
                        "--local-ranktable-list"] + [f"{d}/{k}" for k in locs], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    roles = dict(re.findall(r"local_ranktable_(\S+)\.json: (\w+ \d+) of ", r.stdout))
    return cm, roles

cm23, roles23 = tables(rt23, "rt23")
assert cm23["metadata"]["namespace"] == "ns2" and cm23["data"]["NODE_PORTS"] == "8088,8088,8089,8089,8089"
assert roles23 == {"pdserve-scheduler-0": "scheduler 0", "pdserve-prefill-0": "prefill 0",
                   "pdserve-prefill-1": "prefill 1", "pdserve-decode-0": "decode 0",
                   "pdserve-decode-1": "decode 1", "pdserve-decode-2": "decode 2"}, roles23
g23 = json.loads(cm23["data"]["global_ranktable.json"])
assert [len(s["device"]) for s in g23["server_group_list"][1]["server_list"]] == [4, 4]
assert g23["server_group_list"][2]["server_list"][2]["server_ip"] == "pdserve-decode-2.pdserve-decode.ns2.svc.cluster.local"

cm, roles = tables(os.path.join(k8s, "ranktables.yaml"), "rt")
g = json.loads(cm["data"]["global_ranktable.json"])
ns = cm["metadata"]["namespace"]
kust = yaml.safe_load(open(os.path.join(k8s, "kustomization.yaml")))
objs = []
for f in kust["resources"]:
    objs += [o for o in yaml.safe_load_all(open(os.path.join(k8s, f))) if o]
kinds = [o["kind"] for o in objs]
assert kinds.count("StatefulSet") == 3 and "Namespace" in kinds and "ConfigMap" in kinds, kinds
for o in objs:
    if o["kind"] != "Namespace":
        assert o["metadata"].get("namespace") == ns, f'{o["kind"]} {o["metadata"]["name"]}: namespace'
svcs = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
node_ports = [int(p) for p in cm["data"]["NODE_PORTS"].split(",")]
groups = {"prefill": 1, "decode": 2, "scheduler": 0}
seen_ports = {}
for s in (o for o in objs if o["kind"] == "StatefulSet"):
    name, spec = s["metadata"]["name"], s["spec"]
    role = s["metadata"]["labels"]["app.kubernetes.io/component"]
    insts = g["server_group_list"][groups[role]]["server_list"]
    assert spec["replicas"] == len(insts), f"{name}: replicas {spec['replicas']} but the table has {len(insts)}"
    labels = spec["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in spec["selector"]["matchLabels"].items()), f"{name}: selector"
    hl = svcs[spec["serviceName"]]
    assert hl["spec"].get("clusterIP") == "None" and hl["spec"].get("publishNotReadyAddresses"), f"{name}: headless"
    assert all(labels.get(k) == v for k, v in hl["spec"]["selector"].items()), f"{name}: headless selector"
    pod = spec["template"]["spec"]
    assert pod.get("hostNetwork") is True and pod.get("dnsPolicy") == "ClusterFirstWithHostNet", f"{name}: network"
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    args = c["args"]
    arg = lambda f: args[args.index(f) + 1]
    port = int(arg("--port"))
    assert [p["containerPort"] for p in c["ports"]] == [port], f"{name}: containerPort"
    vols = {v["name"]: v for v in pod["volumes"]}
    mnts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    rtdir = os.path.dirname(env["RANK_TABLE_FILE_PATH"]["value"])
    assert vols[mnts[rtdir]]["configMap"]["name"] == "pdserve-ranktables", f"{name}: ranktable volume"
    assert env["GLOBAL_RANK_TABLE_FILE_PATH"]["value"] == rtdir + "/global_ranktable.json"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["NODE_PORTS"]["valueFrom"]["configMapKeyRef"] == {"name": "pdserve-ranktables", "key": "NODE_PORTS"}
    model = arg("--model")
    assert any(model.startswith(m + "/") for m in mnts), f"{name}: --model {model} is not on a mounted volume"
    gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    for i in range(spec["replicas"]):
        pod_name = f"{name}-{i}"
        key = os.path.basename(env["RANK_TABLE_FILE_PATH"]["value"].replace("$(POD_NAME)", pod_name))
        assert key in cm["data"], f"{pod_name}: RANK_TABLE_FILE_PATH names {key}, not in the ConfigMap"
        assert roles[pod_name] == f"{role} {i}", f"{pod_name}: its table is {roles[pod_name]}"
        inst = insts[i]
        assert inst["server_ip"] == f"{pod_name}.{spec['serviceName']}.{ns}.svc.cluster.local", inst["server_ip"]
        if role != "scheduler":
            tp = len(inst["device"])
            assert [d["device_id"] for d in inst["device"]] == [str(k) for k in range(tp)], inst["device"]
            assert gpus == tp and int(arg("--tensor-parallel-size")) == tp, f"{pod_name}: GPUs {gpus}, TP {tp}"
            seen_ports.setdefault(role, []).append(port)
    if role == "scheduler":
        assert gpus is None, "the scheduler takes no GPU"
        p = c["readinessProbe"]["httpGet"]
        assert p["path"] == "/health" and p["port"] == port, p
        api = [v for v in svcs.values() if v["spec"].get("clusterIP") != "None"
               and all(labels.get(k) == x for k, x in v["spec"]["selector"].items())]
        assert len(api) == 1 and api[0]["spec"]["ports"][0]["targetPort"] == port, "the scheduler Service"
    else:
        assert pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] \
            == "kubernetes.io/hostname", f"{name}: one pod per node (fixed host port)"
        assert vols[mnts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", f"{name}: shm"
assert seen_ports.get("prefill", []) + seen_ports.get("decode", []) == node_ports, (seen_ports, node_ports)
json.dump(objs, open(os.path.join(out, "objects.json"), "w"))
print(f"{len(objs)} objects ok")
PY

cache=${PD_NPM_CACHE:-$src/.cache/npm}
npm_ok=0
if [ -f "$cache/node_modules/kubernetes-models/package.json" ] && [ -f "$cache/node_modules/dockerfile-utils/package.json" ]; then
    npm_ok=1
elif "$src/tests/npm_cache.sh" kubernetes-models@5.1.0 dockerfile-utils@0.16.3 >/dev/null 2>&1; then
    npm_ok=1
fi
if [ $npm_ok = 1 ] && [ -f "$work/k8s/objects.json" ]; then
    cat >"$work/k8s/validate.mjs" <<'JS'
// Validates every object against the Kubernetes JSON schemas shipped by kubernetes-models.
import fs from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
const [cache, file] = process.argv.slice(2);
let bad = 0;
for (const o of JSON.parse(fs.readFileSync(file, 'utf8'))) {
  const [group, version] = o.apiVersion.includes('/') ? o.apiVersion.split('/') : ['', o.apiVersion];
  const mod = path.join(cache, 'node_modules', 'kubernetes-models', group, version, o.kind + '.js');
  const M = (await import(pathToFileURL(mod).href))[o.kind];
  try { new M(o).validate(); } catch (e) { bad++; console.log(`${o.kind} ${o.metadata.name}: ${e.message}`); }
}
console.log(bad ? `${bad} invalid` : 'all valid');
process.exit(bad ? 1 : 0);
JS
    check "Kubernetes JSON schemas (kubernetes-models)" node "$work/k8s/validate.mjs" "$cache" "$work/k8s/objects.json"
elif [ $npm_ok = 1 ]; then
    skip "Kubernetes JSON-schema check: the manifests did not load (see the failure above)"
else
    skip "Kubernetes JSON-schema check: npm packages kubernetes-models and dockerfile-utils are not in $cache"
fi
if command -v kubectl >/dev/null 2>&1; then
    check "kubectl kustomize deploy/k8s renders" kubectl kustomize "$k8s"
fi

# ---- 3. Dockerfiles -------------------------------------------------------------------------------
exes=()
for e in ranktable/cli/pd-ranktable scheduler/pd-scheduler prefill_node/pd-prefill decode_node/pd-decode; do
    [ -x "$bin/$e" ] && exes+=("$bin/$e")
done
check "Dockerfile structure, RUN syntax, packages, runtime-library step" \
    $py - "$src" "$work" "${exes[@]}" <<'PY'
import json, os, re, shlex, subprocess, sys
src, work, exes = sys.argv[1], sys.argv[2], sys.argv[3:]

def instructions(path):
    """(line, KEYWORD, text) with continuation lines joined and comments dropped."""
    out, cur, start = [], "", 0
    for n, raw in enumerate(open(path), 1):
        s = raw.rstrip("\n")
        if not cur and (not s.strip() or s.lstrip().startswith("#")):
            continue
        if cur and s.lstrip().startswith("#"):
            continue
        if not cur:
            start = n
        if s.endswith("\\"):
            cur += s[:-1]   # Docker removes the escape and the newline
            continue
        cur += s
        kw, _, rest = cur.strip().partition(" ")
        out.append((start, kw.upper(), rest.strip()))
        cur = ""
    assert not cur, f"{path}: ends inside a continued line"
    return out

known = {"FROM", "ARG", "ENV", "RUN", "COPY", "WORKDIR", "ENTRYPOINT", "CMD", "LABEL", "EXPOSE", "USER"}
for df, cuda in (("deploy/Dockerfile", True), ("deploy/Dockerfile.cpu", False)):
    ins = instructions(f"{src}/{df}")
    head = open(f"{src}/{df}").readline()
    # a syntax line makes BuildKit pull its frontend image, which fails offline
    assert not head.startswith("# syntax="), f"{df}: a '# syntax=' line"
    bad = [(n, k) for n, k, _ in ins if k not in known]
    assert not bad, f"{df}: unknown instructions {bad}"
    # "# ..." after an instruction is not a comment for Docker (and ends a joined RUN for sh)
    bad = [n for n, _, t in ins if re.search(r"\s#", t)]
    assert not bad, f"{df}: '#' inside an instruction at lines {bad}"
    stages, args_before = [], set()
    for n, k, t in ins:
        if k == "ARG" and not stages:
            args_before.add(t.split("=")[0])
        if k == "FROM":
            m = re.fullmatch(r"(\S+) AS (\w+)", t)
            assert m, f"{df}:{n}: FROM needs 'image AS name'"
            for v in re.findall(r"\$\{(\w+)\}", m.group(1)):
                assert v in args_before, f"{df}:{n}: FROM uses ${{{v}}} not declared before the first FROM"
            stages.append(m.group(2))
    assert stages == ["build", "runtime"], f"{df}: stages {stages}"
    froms = [t for _, k, t in ins if k == "FROM"]
    if cuda:
        assert froms == ["${BUILD_IMAGE} AS build", "${RUNTIME_IMAGE} AS runtime"], froms
        txt = open(f"{src}/{df}").read()
        assert "ARG BUILD_IMAGE=nvidia/cuda:${CUDA_VERSION}-devel-ubuntu" in txt, f"{df}: BUILD_IMAGE"
        assert "ARG RUNTIME_IMAGE=nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu" in txt, f"{df}: RUNTIME_IMAGE"
        assert any('ARG CUDA_VERSION=13.' in l for l in open(f"{src}/{df}")), f"{df}: CUDA 13"
    else:
        assert froms[0].startswith("debian:${DEBIAN_VERSION} ") and "-slim" in froms[1], froms
    stage = None
    for n, k, t in ins:
        if k == "FROM":
            stage = t.split()[-1]
        if k == "COPY":
            words = t.split()
            if words[0].startswith("--from="):
                assert words[0][7:] in stages[:stages.index(stage)], f"{df}:{n}: COPY from a later stage"
                continue
            for p in words[:-1]:
                assert os.path.exists(os.path.join(src, p)), f"{df}:{n}: COPY source {p} does not exist"
        if k == "RUN":
            r = subprocess.run(["sh", "-n", "-c", t], capture_output=True, text=True)
            assert r.returncode == 0, f"{df}:{n}: RUN is not valid sh: {r.stderr}"
    setup = next(t for _, k, t in ins if k == "RUN" and "meson setup" in t)
    assert ("-Dcuda=enabled" in setup) == cuda and ("-Dcuda=disabled" in setup) == (not cuda), setup
    assert "meson install -C /build --destdir /stage" in setup
    ep = next(t for _, k, t in ins if k == "ENTRYPOINT")
    ep = json.loads(ep)
    assert ep == ["/opt/pdserve/deploy/start_servers.sh"], ep
    copied = [t.split()[-1] for _, k, t in ins if k == "COPY"]
    assert "/opt/pdserve/deploy/start_servers.sh" in copied, f"{df}: the entry point is not copied"
    env = " ".join(t for _, k, t in ins if k == "ENV")
    assert "PD_BIN_DIR=/usr/local/bin" in env, f"{df}: PD_BIN_DIR"
    # the build packages come from install_deps.sh (one list)
    assert any(k == "RUN" and "install_deps.sh --build" in t for _, k, t in ins), f"{df}: install_deps.sh --build"
    # the ldd -> package step, run on our own executables (paths substituted)
    step = next(t for _, k, t in ins if k == "RUN" and "ldd" in t and "dpkg-query -S" in t)
    lst = os.path.join(work, os.path.basename(df) + ".pkgs")
    step = step.replace("/stage/usr/local/bin/*", " ".join(shlex.quote(e) for e in exes)) \
               .replace("/runtime-packages.txt", lst)
    r = subprocess.run(["sh", "-c", step], capture_output=True, text=True)
    assert r.returncode == 0, f"{df}: runtime-package step failed: {r.stderr}"
    pkgs = open(lst).read().split()
    for lib in ("libjansson", "libuv"):   # independent: which package owns what ldd shows
        so = next(l.split()[2] for l in subprocess.run(["ldd", exes[1]], capture_output=True,
                  text=True).stdout.splitlines() if l.strip().startswith(lib + ".so"))
        owner = subprocess.run(["dpkg-query", "-S", os.path.realpath(so)], capture_output=True,
                               text=True).stdout.split(":")[0]
        assert owner in pkgs, f"{df}: {owner} (owner of {so}) not in the runtime list {pkgs}"
print("2 Dockerfiles ok")
PY
if [ $npm_ok = 1 ]; then
    cat >"$work/dlint.mjs" <<'JS'
// dockerfile-utils' validator (the Docker language server's): every diagnostic fails.
import fs from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
const [cache, ...files] = process.argv.slice(2);
const du = await import(pathToFileURL(path.join(cache, 'node_modules', 'dockerfile-utils', 'lib', 'main.js')).href);
let n = 0;
for (const f of files) {
  for (const d of du.validate(fs.readFileSync(f, 'utf8'))) {
    n++; console.log(`${f}:${d.range.start.line + 1}: ${d.message}`);
  }
}
process.exit(n ? 1 : 0);
JS
    check "dockerfile-utils lint" node "$work/dlint.mjs" "$cache" "$src/deploy/Dockerfile" "$src/deploy/Dockerfile.cpu" \
        "$src/tests/deploy/cuda_base.Dockerfile"
else
    skip "Dockerfile lint: npm package dockerfile-utils is not in $cache"
fi

# ---- 4. shell scripts -----------------------------------------------------------------------------
scripts=("$src"/deploy/*.sh "$src"/deploy/k8s/*.sh "$src/tests/integration/test_deploy_scripts.sh"
         "$src/tests/deploy/test_docker.sh")
for s in "${scripts[@]}"; do check "bash -n ${s#"$src"/}" bash -n "$s"; done
# help_ok SHELL... SCRIPT: --help exits 0 and prints the script's usage (2 lines or more)
help_ok() { local out; out=$(env -u GLOBAL_RANK_TABLE_FILE_PATH -u RANK_TABLE_FILE_PATH "$@" --help 2>&1) &&
    [ "$(wc -l <<<"$out")" -ge 2 ] || { echo "$out"; return 1; }; }
for s in "$src"/deploy/*.sh; do
    check "sh ${s#"$src"/} --help" help_ok sh "$s"
    check "bash --posix ${s#"$src"/} --help" help_ok bash --posix "$s"
done
if command -v shellcheck >/dev/null 2>&1; then
    for s in "${scripts[@]}"; do check "shellcheck ${s#"$src"/}" shellcheck -x -P "$src" -S warning "$s"; done
else
    skip "shellcheck is not installed (deploy/install_deps.sh installs it)"
fi

echo "harness: $npass passed, $nfail failed, $nskip skipped"
[ $nfail = 0 ]
