#!/usr/bin/env bash
# The images built and run for real, with a Docker daemon of the test's own (its data under the
# work directory, no bridge, no iptables rules; stopped and removed at exit):
#  1. the base image debian:12 (and :12-slim) from `debootstrap --variant=minbase bookworm`
#     (no registry is reachable), kept as a tarball in .cache/debootstrap/ for the next run;
#  2. deploy/Dockerfile.cpu with the classic builder (DOCKER_BUILDKIT=0);
#  3. deploy/Dockerfile with BuildKit's built-in frontend (Debian's docker client; the classic
#     builder when it lacks BuildKit), on stand-ins for the nvidia/cuda images: Debian 12 with
#     this host's /usr/local/cuda (tests/deploy/cuda_base.Dockerfile); skipped without a toolkit;
#  4. deploy/run_instance.sh --no-gpus starts 1 prefill + 1 decode + the scheduler as three
#     --net=host containers from ranktables made by the image's pd-ranktable: start-to-healthy
#     time, a completion and a stream equal to this build's colocated pd-generate; each container
#     is what `run_instance.sh --dry-run` printed (docker inspect: name, network, shm, mounts,
#     env, image, arguments), and the GPU command of the same instance is that command with
#     --gpus and CUDA_DEVICE_ORDER instead of the CPU core budget; `docker stop` of the scheduler
#     under a stream lets it finish, every container exits 0 and its log is in `docker logs`;
#  5. the same cluster from the GPU image (its executables on the CPU backend: no device here).
# Prints the image sizes and times. Needs root, docker.io and debootstrap
# (deploy/install_deps.sh); exits 77 with the reason otherwise. PD_KEEP_WORK=1 keeps the logs.
set -u
skip() { echo "SKIP: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "dockerd needs root"
for t in docker dockerd debootstrap containerd runc; do
    command -v "$t" >/dev/null 2>&1 || skip "$t is not installed (deploy/install_deps.sh installs docker.io and debootstrap)"
done
# the work directory (removed at exit), fail(), free_port()
# shellcheck source=tests/integration/lib_cluster.sh
. "$(dirname "$0")/../integration/lib_cluster.sh"
[ "$(df -Pk "$work" | awk 'NR == 2 {printf "%d", $4 / 1048576}')" -ge 4 ] ||
    skip "less than 4 GB free under ${TMPDIR:-/tmp} (the daemon's data)"
export DOCKER_HOST="unix://$work/docker.sock"
dpid=""
# The daemon stopped (its containers first), what it left mounted unmounted, then the work
# directory as lib_cluster.sh removes it; the daemon's data goes even with PD_KEEP_WORK.
stop_docker() {
    if [ -n "$dpid" ]; then
        docker ps -aq 2>/dev/null | xargs -r docker rm -f >/dev/null 2>&1
        kill "$dpid" 2>/dev/null
        for _ in $(seq 200); do kill -0 "$dpid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$dpid" 2>/dev/null
    fi
    awk -v w="$work" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null
    rm -rf "$work/data" "$work/exec" "$work/cuda-ctx"
    cleanup
}
trap stop_docker EXIT
trap 'exit 1' TERM INT
now() { date +%s.%N; }
since() { $py -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }
size() { docker image inspect -f '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'; }

# ---- the daemon ------------------------------------------------------------------------------
dockerd --data-root "$work/data" --exec-root "$work/exec" -H "$DOCKER_HOST" \
    --pidfile "$work/dockerd.pid" --bridge=none --iptables=false --ip-masq=false \
    >"$work/dockerd.log" 2>&1 &
dpid=$!
for _ in $(seq 300); do docker version >/dev/null 2>&1 && break; sleep 0.1; done
docker version >/dev/null 2>&1 || fail "dockerd did not answer within 30 s"
docker info 2>/dev/null | grep -q 'Storage Driver: overlay2' ||
    echo "note: storage driver $(docker info -f '{{.Driver}}' 2>/dev/null) (not overlay2): builds are slower"

# ---- 1. the base image -----------------------------------------------------------------------
t=$(now)
cache="$src/.cache/debootstrap" tarball="$src/.cache/debootstrap/bookworm-minbase.tar"
if [ ! -s "$tarball" ]; then
    mkdir -p "$cache"
    debootstrap --variant=minbase bookworm "$work/rootfs" >"$work/debootstrap.log" 2>&1 ||
        fail "debootstrap --variant=minbase bookworm"
    tar -C "$work/rootfs" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball" || fail "tar of the root file system"
    rm -rf "$work/rootfs"
fi
docker import - debian:12 <"$tarball" >/dev/null || fail "docker import"
docker tag debian:12 debian:12-slim
echo "ok base image debian:12 = debootstrap minbase bookworm ($(size debian:12), $(since "$t") s)"

# ---- 2. the CPU image, classic builder -------------------------------------------------------
t=$(now)
DOCKER_BUILDKIT=0 docker build --network host -f "$src/deploy/Dockerfile.cpu" -t pdserve:cpu "$src" \
    >"$work/build-cpu.log" 2>&1 || fail "docker build deploy/Dockerfile.cpu (classic builder)"
echo "ok deploy/Dockerfile.cpu built by the classic builder: pdserve:cpu $(size pdserve:cpu) ($(since "$t") s)"

# ---- 3. the GPU image on the toolkit of this host ---------------------------------------------
gpu_image=""
cuda=/usr/local/cuda
free_gb=$(df -Pk "$work" | awk 'NR == 2 {printf "%d", $4 / 1048576}')
if [ "$free_gb" -lt 10 ]; then
    echo "skipped: the GPU image: $free_gb GB free under $work, it needs 10"
elif [ -x "$cuda/bin/nvcc" ] && [ -f "$cuda/include/nccl.h" ]; then
    t=$(now)
    ctx="$work/cuda-ctx"
    mkdir -p "$ctx/cuda/lib"
    # hard links where the file system allows (same device), else copies
    cp -al "$cuda/bin" "$cuda/nvvm" "$cuda/include" "$ctx/cuda/" 2>/dev/null ||
        cp -a "$cuda/bin" "$cuda/nvvm" "$cuda/include" "$ctx/cuda/"
    [ -d "$cuda/targets" ] && cp -a "$cuda/targets" "$ctx/cuda/"
    for l in "$cuda"/lib64/libcudart* "$cuda"/lib64/libcublas* "$cuda"/lib64/libnccl* "$cuda"/lib64/libcudadevrt.a; do
        cp -a "$l" "$ctx/cuda/lib/" || fail "copy $l"
    done
    cp "$src/tests/deploy/cuda_base.Dockerfile" "$ctx/Dockerfile"
    for stage in devel runtime; do
        DOCKER_BUILDKIT=0 docker build --target "$stage" -t "pdserve-test/cuda:$stage" "$ctx" \
            >>"$work/build-cuda-base.log" 2>&1 || fail "the CUDA $stage stand-in image"
    done
    rm -rf "$ctx"
    echo "ok CUDA stand-in images from $cuda: devel $(size pdserve-test/cuda:devel), runtime $(size pdserve-test/cuda:runtime) ($(since "$t") s)"
    # BuildKit: Debian's docker client (docker.io, 20.10) has it built in; a newer client needs
    # its buildx plugin; without either, the classic builder
    bk=0 client=docker how="classic builder"
    if [ -x /usr/bin/docker ] && /usr/bin/docker version -f '{{.Client.Version}}' 2>/dev/null | grep -q '^20\.'; then
        bk=1 client=/usr/bin/docker how="BuildKit, built-in frontend"
    elif docker buildx version >/dev/null 2>&1; then
        bk=1 how="BuildKit, built-in frontend"
    fi
    t=$(now)
    DOCKER_BUILDKIT=$bk "$client" build --network host -f "$src/deploy/Dockerfile" \
        --build-arg BUILD_IMAGE=pdserve-test/cuda:devel --build-arg RUNTIME_IMAGE=pdserve-test/cuda:runtime \
        -t pdserve:cuda "$src" >"$work/build-gpu.log" 2>&1 || fail "docker build deploy/Dockerfile ($how)"
    gpu_image=pdserve:cuda
    echo "ok deploy/Dockerfile built ($how) on the stand-ins: pdserve:cuda $(size pdserve:cuda) ($(since "$t") s)"
else
    echo "skipped: the GPU image: no CUDA toolkit with NCCL at $cuda"
fi

# ---- 4. three containers per cluster ---------------------------------------------------------
# the small synthetic model: about 3.5 ms a token here, so a long stream is still running when
# docker stop comes
model="$work/small" rt="$work/rt"
"$bin/tools/mkmodel/pd-mkmodel" --preset small --out "$model" >/dev/null || fail "pd-mkmodel"
mkdir -p "$rt"
docker run --rm -v "$rt:/rt" --entrypoint pd-ranktable pdserve:cpu --mode gen --prefill-server-list 0 \
    --decode-server-list 1 --api-server --server-ip 127.0.0.1 --save-dir /rt >"$work/ranktable.log" 2>&1 ||
    fail "pd-ranktable gen in the image"
pp=$(free_port) dp=$(free_port) sp=$(free_port)
export GLOBAL_RANK_TABLE_FILE_PATH="$rt/global_ranktable_127.0.0.1.json" NODE_PORTS="$pp,$dp" USE_OPENAI=1
flags=(--model "$model" --served-model-name small --max-model-len 2048 --max-num-seqs 16
       --max-num-batched-tokens 2048 --host 127.0.0.1 --cpu-threads 1 --kv-cache-bytes 134217728)
specs=("prefill:0:$pp" "decode:1:$dp" "scheduler:host:$sp")
prompt="the cat sat on the"
want=$("$bin/tools/generate/pd-generate" --model "$model" --prompt "$prompt" --max-tokens 24 --ignore-eos \
    --temperature 0 --json --cpu-threads 1 2>/dev/null |
    $py -c 'import json,sys; print(",".join(map(str, json.load(sys.stdin)["token_ids"])))') || fail "pd-generate"
body() { # body STREAM MAX_TOKENS
    printf '{"model":"small","prompt":"%s","max_tokens":%d,"ignore_eos":true,"temperature":0,"stream":%s,"return_tokens_as_token_ids":true,"logprobs":0}' \
        "$prompt" "$2" "$1"
}
# the token ids of a completion or a stream read on stdin; a stream must end with [DONE]
ids() {
    $py -c '
import json, sys
text = sys.stdin.read()
if not text.lstrip().startswith("data:"):
    print(",".join(t.split(":")[1] for t in json.loads(text)["choices"][0]["logprobs"]["tokens"]))
    sys.exit(0)
ids, done, finish = [], False, None
for line in text.splitlines():
    if line == "data: [DONE]": done = True
    elif line.startswith("data: "):
        ev = json.loads(line[6:])
        if "error" in ev: sys.exit("in-band error: " + ev["error"]["message"])
        ids += [t.split(":")[1] for t in ev["choices"][0]["logprobs"]["tokens"]]
        finish = ev["choices"][0].get("finish_reason") or finish
print(",".join(ids) if done and finish == "length" else f"no [DONE] or not whole ({finish})")'
}

serve() { # serve IMAGE: the cluster from IMAGE, checked and stopped
    local image=$1 t spec role table port name got
    t=$(now)
    for spec in "${specs[@]}"; do
        IFS=: read -r role table port <<<"$spec"
        RANK_TABLE_FILE_PATH="$rt/local_ranktable_127.0.0.1_$table.json" \
            "$src/deploy/run_instance.sh" --no-gpus --image "$image" "${flags[@]}" --port "$port" \
            >"$work/run-$role.log" 2>&1 || fail "run_instance.sh ($role, $image)"
    done
    for _ in $(seq 600); do
        [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$sp/health")" = 200 ] && break
        sleep 0.1
    done
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$sp/health")" = 200 ] ||
        { for n in $(docker ps -aq); do docker logs "$n" >"$work/ctr-$n.log" 2>&1; done; fail "$image: /health not 200 within 60 s"; }
    local healthy; healthy=$(since "$t")
    got=$(curl -s "http://127.0.0.1:$sp/v1/completions" -H 'Content-Type: application/json' -d "$(body false 24)" | ids) ||
        fail "$image: completion"
    [ "$got" = "$want" ] || fail "$image: served $got, colocated $want"
    got=$(curl -sN "http://127.0.0.1:$sp/v1/completions" -H 'Content-Type: application/json' -d "$(body true 24)" | ids) ||
        fail "$image: stream"
    [ "$got" = "$want" ] || fail "$image: streamed $got, colocated $want"
    echo "ok $image: 3 containers (run_instance.sh --no-gpus) healthy $healthy s after the first docker run; a completion and a stream = colocated pd-generate"

    # each container is the command --dry-run prints
    for spec in "${specs[@]}"; do
        IFS=: read -r role table port <<<"$spec"
        local table_file="$rt/local_ranktable_127.0.0.1_$table.json"
        RANK_TABLE_FILE_PATH="$table_file" "$src/deploy/run_instance.sh" --dry-run --no-gpus --image "$image" \
            "${flags[@]}" --port "$port" >"$work/dry-$role.txt" || fail "--dry-run ($role)"
        name=$($py -c 'import shlex,sys; w=shlex.split(open(sys.argv[1]).read()); print(w[w.index("--name")+1])' "$work/dry-$role.txt")
        docker inspect "$name" >"$work/inspect-$role.json" || fail "no container $name"
        $py - "$work/dry-$role.txt" "$work/inspect-$role.json" <<'PY' || fail "$role: the container is not what --dry-run printed"
import json, shlex, sys
w = shlex.split(open(sys.argv[1]).read())
c = json.load(open(sys.argv[2]))[0]
assert w[:3] == ["docker", "run", "-d"], w[:3]
i, want = 3, {"binds": set(), "env": set()}
while w[i].startswith("-"):
    o = w[i]
    if o == "--net=host":
        want["net"] = "host"; i += 1; continue
    v = w[i + 1]; i += 2
    {"--name": lambda: want.update(name=v), "--shm-size": lambda: want.update(shm=v),
     "-v": lambda: want["binds"].add(v), "-e": lambda: want["env"].add(v)}[o]()
image, args = w[i], w[i + 1:]
hc = c["HostConfig"]
assert c["Name"] == "/" + want["name"], (c["Name"], want["name"])
assert hc["NetworkMode"] == want["net"], hc["NetworkMode"]
assert want["shm"] == "16g" and hc["ShmSize"] == 16 << 30, (want["shm"], hc["ShmSize"])
assert set(hc["Binds"]) == want["binds"], (hc["Binds"], want["binds"])
assert want["env"] <= set(c["Config"]["Env"]), want["env"] - set(c["Config"]["Env"])
assert c["Config"]["Image"] == image, (c["Config"]["Image"], image)
assert c["Args"] == args, (c["Args"], args)
PY
    done
    echo "ok $image: each container is the command run_instance.sh --dry-run prints (docker inspect: name, network, shm, mounts, env, image, arguments)"
    # stop under a stream: the scheduler drains it, then everything exits 0
    curl -sN "http://127.0.0.1:$sp/v1/completions" -H 'Content-Type: application/json' -d "$(body true 1500)" \
        >"$work/drain-stream.txt" &
    local cpid=$!
    for _ in $(seq 100); do [ -s "$work/drain-stream.txt" ] && break; sleep 0.05; done
    t=$(now)
    for role in scheduler decode prefill; do
        name=$($py -c 'import shlex,sys; w=shlex.split(open(sys.argv[1]).read()); print(w[w.index("--name")+1])' "$work/dry-$role.txt")
        docker stop -t 40 "$name" >/dev/null || fail "docker stop $name"
        [ "$(docker inspect -f '{{.State.ExitCode}}' "$name")" = 0 ] ||
            fail "$name exited $(docker inspect -f '{{.State.ExitCode}}' "$name")"
        docker logs "$name" >"$work/$role-$image.log" 2>&1
        grep -q "INFO .* stopped$" "$work/$role-$image.log" || fail "$name: docker logs lacks its last line"
        [ "$role" != scheduler ] || grep -q "shutting down: 1 request(s) in flight" "$work/$role-$image.log" ||
            fail "$name: the stream was not in flight when docker stop came: $(grep 'shutting down' "$work/$role-$image.log")"
        docker rm "$name" >/dev/null
    done
    wait "$cpid"
    got=$(ids <"$work/drain-stream.txt") || fail "$image: the stream under docker stop: $got"
    [[ $got == *,* ]] && [ "$(tr ',' '\n' <<<"$got" | wc -l)" = 1500 ] ||
        fail "$image: the stream under docker stop did not finish whole: ${got:0:200}"
    echo "ok $image: docker stop under a 1500-token stream: the scheduler let it finish, the 3 containers exited 0 ($(since "$t") s), their logs in docker logs"
}

serve pdserve:cpu
# the GPU command of an instance: the CPU one with the GPU words instead of the core budget
dev=$(docker run --rm -v "$rt:/rt" --entrypoint pd-ranktable pdserve:cpu --mode gen --prefill-server-list 4,5 \
    --decode-server-list 6,7 --api-server --server-ip 127.0.0.1 --save-dir /rt/gpu 2>&1) || fail "gen GPU tables: $dev"
RANK_TABLE_FILE_PATH="$rt/gpu/local_ranktable_127.0.0.1_45.json" GLOBAL_RANK_TABLE_FILE_PATH="$rt/gpu/global_ranktable_127.0.0.1.json" \
    "$src/deploy/run_instance.sh" --dry-run --image pdserve:cuda "${flags[@]}" --port "$pp" >"$work/dry-gpu.txt" || fail "--dry-run (GPU)"
RANK_TABLE_FILE_PATH="$rt/gpu/local_ranktable_127.0.0.1_45.json" GLOBAL_RANK_TABLE_FILE_PATH="$rt/gpu/global_ranktable_127.0.0.1.json" \
    "$src/deploy/run_instance.sh" --dry-run --no-gpus --image pdserve:cuda "${flags[@]}" --port "$pp" >"$work/dry-cpu.txt" || fail "--dry-run (--no-gpus)"
$py - "$work/dry-gpu.txt" "$work/dry-cpu.txt" <<'PY' || fail "the GPU command differs from the CPU one in more than the GPU words"
import shlex, sys
g, c = (shlex.split(open(p).read()) for p in sys.argv[1:])
budget = c.index("/dev/shm/pdserve-cpu-host:/dev/shm/pdserve-cpu-host") - 1
c = c[:budget] + c[budget + 2:]                     # -v of the core budget: CPU instances only
k = g.index("--gpus")
assert g[k:k + 4] == ["--gpus", '"device=4,5"', "-e", "CUDA_DEVICE_ORDER=PCI_BUS_ID"], g[k:k + 4]
assert g[:k] + g[k + 4:] == c, (g, c)
PY
echo "ok the GPU command of an instance (--dry-run) = the command run here, with --gpus '\"device=4,5\"' -e CUDA_DEVICE_ORDER=PCI_BUS_ID instead of the CPU core budget"
if [ -n "$gpu_image" ]; then
    serve "$gpu_image"
fi
echo "images: debian:12 $(size debian:12), pdserve:cpu $(size pdserve:cpu)${gpu_image:+, pdserve:cuda $(size pdserve:cuda)}"
echo "PASS"
