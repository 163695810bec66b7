#!/usr/bin/python3
"""Regenerates the ranktable test data (run from anywhere; needs only the standard library).

guide_global.json / guide_local_67.json: the example tables of the Ascend PD-separation guide
(section "Step5 生成ranktable"), cut from the guide text, dedented by its 4-space quote
indentation, trailing blanks removed (the guide has two stray ones after "localhost",). The
result equals Python json.dump(indent=4) of the same object, which is what the Ascend tool
writes, so these are byte goldens for `pd-ranktable --mode gen`.
    make_data.py --guide GUIDE.txt   (the guide's text, which is not in this repository)

bad/*.json: one broken table per validation rule, made from a valid 1P1D TP2 table by a
single edit each (tests/unit/ranktable/test_ranktable.c asserts the message of each).
"""
import copy
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def dump(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=4)


def guide(seed):
    lines = open(seed, encoding="utf-8").read().split("\n")
    # The two example tables are the 4-space-indented blocks starting at lines 138 and 202.
    def block(first, last):
        text = "\n".join(l[4:].rstrip() for l in lines[first - 1:last])
        assert json.dumps(json.loads(text), indent=4) == text
        return text
    for name, (a, b) in {"guide_global.json": (138, 197), "guide_local_67.json": (202, 225)}.items():
        with open(os.path.join(HERE, name), "w") as f:
            f.write(block(a, b))


def dev(ids, ip):
    return [{"device_id": str(d), "device_ip": ip, "rank_id": str(r)} for r, d in enumerate(ids)]


def base():
    host = "10.0.0.1"
    srv = lambda ids: {"server_id": host, "server_ip": host, "device": dev(ids, host)}
    return {
        "version": "1.0",
        "status": "completed",
        "server_group_list": [
            {"group_id": "0", "server_count": "1",
             "server_list": [{"server_id": host, "server_ip": host}]},
            {"group_id": "1", "server_count": "1", "server_list": [srv([4, 5])]},
            {"group_id": "2", "server_count": "1", "server_list": [srv([6, 7])]},
        ],
    }


def local_of(g, group, i=0):
    return {"version": "1.0", "status": "completed", "group_id": "0", "server_count": "1",
            "server_list": [copy.deepcopy(g["server_group_list"][group]["server_list"][i])]}


def bad():
    out = os.path.join(HERE, "bad")
    os.makedirs(out, exist_ok=True)
    good = base()
    dump(os.path.join(HERE, "good_1p1d.json"), good)
    dump(os.path.join(HERE, "good_1p1d_local_45.json"), local_of(good, 1))
    dump(os.path.join(HERE, "good_1p1d_local_host.json"), local_of(good, 0))

    def g(name, edit):
        t = base()
        r = edit(t)
        dump(os.path.join(out, name), t if r is None else r)

    G = lambda t, i: t["server_group_list"][i]
    S = lambda t, i, j=0: t["server_group_list"][i]["server_list"][j]
    D = lambda t, i, k, j=0: S(t, i, j)["device"][k]

    with open(os.path.join(out, "g_parse_error.json"), "w") as f:
        f.write('{\n    "version": "1.0",\n    "status": "completed"\n    "server_group_list": []\n}')
    g("g_root_array.json", lambda t: [t])
    g("g_missing_version.json", lambda t: t.pop("version") and None)
    g("g_bad_version.json", lambda t: t.update(version="2.0"))
    g("g_bad_status.json", lambda t: t.update(status="initializing"))
    g("g_two_groups.json", lambda t: t["server_group_list"].pop(0) and None)
    g("g_group_order.json", lambda t: t["server_group_list"].reverse() or
      t["server_group_list"].insert(0, t["server_group_list"].pop()))
    g("g_count_integer.json", lambda t: G(t, 1).update(server_count=1))
    g("g_count_mismatch.json", lambda t: G(t, 2).update(server_count="2"))
    g("g_rank_id.json", lambda t: (D(t, 1, 0).update(rank_id="1"), D(t, 1, 1).update(rank_id="0"))
      and None)
    g("g_device_id_text.json", lambda t: D(t, 1, 0).update(device_id="gpu4"))
    g("g_device_id_leading_zero.json", lambda t: D(t, 2, 1).update(device_id="07"))
    g("g_device_twice_host.json", lambda t: D(t, 2, 0).update(device_id="5"))
    g("g_device_twice_instance.json", lambda t: D(t, 1, 1).update(device_id="4"))

    def tp(t):
        G(t, 1)["server_list"].append({"server_id": "10.0.0.1", "server_ip": "10.0.0.1",
                                       "device": dev([0], "10.0.0.1")})
        G(t, 1)["server_count"] = "2"
    g("g_tp_mismatch.json", tp)

    def two_sched(t):
        G(t, 0)["server_list"].append({"server_id": "10.0.0.2", "server_ip": "10.0.0.2"})
        G(t, 0)["server_count"] = "2"
    g("g_two_schedulers.json", two_sched)
    g("g_scheduler_devices.json", lambda t: S(t, 0).update(device=dev([0], "10.0.0.1")))
    g("g_no_devices.json", lambda t: S(t, 1).pop("device") and None)
    g("g_empty_decode.json", lambda t: G(t, 2).update(server_count="0", server_list=[]))
    g("g_missing_server_ip.json", lambda t: S(t, 1).pop("server_ip") and None)
    g("g_empty_device_ip.json", lambda t: D(t, 1, 1).update(device_ip=""))
    g("g_server_ip_space.json", lambda t: S(t, 2).update(server_ip="10.0.0.1 "))

    def many(t):  # three problems in one file: check prints all of them
        t["status"] = "initializing"
        G(t, 1)["server_count"] = "3"
        D(t, 2, 1)["rank_id"] = "5"
    g("g_three_problems.json", many)

    def l(name, edit, group=1):
        t = local_of(base(), group)
        r = edit(t)
        dump(os.path.join(out, name), t if r is None else r)

    l("l_group_id.json", lambda t: t.update(group_id="2"))
    l("l_count_mismatch.json", lambda t: t.update(server_count="2"))

    def two(t):
        t["server_list"].append(copy.deepcopy(t["server_list"][0]))
        t["server_count"] = "2"
    l("l_two_servers.json", two)
    l("l_rank_id.json", lambda t: t["server_list"][0]["device"][1].update(rank_id="2"))
    l("l_no_match.json", lambda t: t["server_list"][0]["device"][1].update(device_ip="10.9.9.9"))
    l("l_host_mismatch.json", lambda t: t["server_list"][0].update(server_id="10.0.0.7",
                                                                   server_ip="10.0.0.7"), group=0)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--guide":
        guide(sys.argv[2])
    bad()
