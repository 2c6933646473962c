#!/usr/bin/python3
"""Managing checkpoints with the real `flashckpt` CLI against a real flashckptd and flashckpt-sim ranks.

Two ranks (tp 2, EMA on) save checkpoints 2, 4, 6, 8 and 10; then:
  0. Status shows the daemon's node name; `list --root` (offline, from the files) prints what the
     daemon's `list` does, each step's signalled ranks with their node, and for a step one rank has
     not signalled, that rank and the node that wrote it last; `inspect` names the nodes.
  1. `inspect` of checkpoint-10 shows the topology, the EMA and the tensors; `--json` parses and its
     world size, tensor count and bytes agree with metadata.json read here, and `verify` counts the
     same tensors and pieces; an incomplete directory exits 1, a missing one 3.
  2. `delete --step 4` removes the directory; `delete --step 10` (the newest) without --force exits 2
     with FAILED_PRECONDITION naming --force and leaves it whole (`verify` passes); with --force it
     goes and LATEST moves back to 8.
  3. Over the read-only TCP listener (--listen, no --tcp-allow-writes) delete is PERMISSION_DENIED and
     nothing is deleted.
  4. `gc --keep 2 --dry-run` names what `gc --keep 2` then deletes: the older complete checkpoints
     and an older incomplete directory; a newer incomplete directory (a save in flight) stays.
  5. `reshard --progress` prints its progress on stderr only and ends at 100%.
     A copy of a checkpoint whose metadata.json swaps where two pieces of a tensor go (checksums
     intact) is refused by `inspect`, `verify` and `reshard` (exit 1, naming the tensor and its
     file), and `reshard` creates nothing.
  6. A daemon restarted with --tcp-allow-writes deletes over TCP.
  7. A run with another run id that does not resume is refused at its first save, naming --fresh, and
     changes nothing; with `flashckpt-sim --fresh` it starts a new lineage: the other run's checkpoints
     are deleted and LATEST is the new run's step.

    test_manage.py --bin-dir build/bin [--keep]
"""

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys

sys.dont_write_bytecode = True
os.environ.setdefault("GRPC_DNS_RESOLVER", "native")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import DaemonHarness, check, log, run_with_daemon_harness, tail, wait_for  # noqa: E402

JOB = "manage%d" % os.getpid()
LISTEN_RE = re.compile(r"listening tcp=(\S+):(\d+) tls=(on|off)")
STEPS = [2, 4, 6, 8, 10]


def job_dir(h):
    return os.path.join(h.root, JOB)


def ckpt(h, step):
    return os.path.join(job_dir(h), "checkpoint-%d" % step)


def latest(h):
    path = os.path.join(job_dir(h), "LATEST")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def cli_ok(h, *args):
    rc, out, err = h.cli(*args)
    check(rc == 0, "flashckpt %s exited %d:\n%s%s" % (" ".join(args), rc, out, err))
    return out, err


def start_sims(h, run_id, steps, extra=()):
    """Starts ranks 0 and 1 of JOB (tp 2, EMA on) saving every 2 steps; returns (processes, logs)."""
    procs, logs = [], []
    for rank in range(2):
        path = os.path.join(h.tmp, "sim-%s-rank%d.log" % (run_id, rank))
        logs.append(path)
        h.logs.append(path)
        with open(path, "wb") as out:
            procs.append(subprocess.Popen(
                [h.binary("flashckpt-sim"), "--socket", h.sock, "--job", JOB, "--rank", str(rank),
                 "--world-size", "2", "--tp-degree", "2", "--layers", "2", "--hidden", "32",
                 "--steps", str(steps), "--save-every", "2", "--ema-decay", "0.9", "--run-id", run_id] + list(extra),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    return procs, logs


def save_checkpoints(h):
    procs, logs = start_sims(h, "manage-run", STEPS[-1])
    for p, path in zip(procs, logs):
        check(p.wait(timeout=120) == 0, "flashckpt-sim failed:\n%s" % tail(path))
    for step in STEPS:
        check(os.path.exists(os.path.join(ckpt(h, step), "metadata.json")), "checkpoint-%d is not complete" % step)
    check(latest(h) == "10\n", "LATEST is %r, expected 10" % latest(h))
    log("saved checkpoints %s" % STEPS)


def check_fresh(h):
    """A fresh run into the job is refused, naming --fresh; with --fresh it starts a new lineage."""
    before = sorted(n for n in os.listdir(job_dir(h)) if n.startswith("checkpoint-"))
    check(before, "the job has no checkpoints left to protect")
    procs, logs = start_sims(h, "manage-other", 2)
    for p, path in zip(procs, logs):
        rc = p.wait(timeout=120)
        check(rc != 0, "a fresh run into a job with another run's checkpoints exited 0:\n%s" % tail(path))
    text = "".join(open(path, errors="replace").read() for path in logs)
    check("already has complete checkpoints" in text and "--fresh" in text,
          "the refusal does not say why or name --fresh:\n%s" % text[-2000:])
    after = sorted(n for n in os.listdir(job_dir(h)) if n.startswith("checkpoint-"))
    check(after == before, "a refused fresh run changed the checkpoints: %s -> %s" % (before, after))
    procs, logs = start_sims(h, "manage-fresh", 2, ["--fresh"])
    for p, path in zip(procs, logs):
        check(p.wait(timeout=120) == 0, "flashckpt-sim --fresh failed:\n%s" % tail(path))
    after = sorted(n for n in os.listdir(job_dir(h)) if n.startswith("checkpoint-"))
    check(after == ["checkpoint-2"], "after --fresh the job holds %s, expected only the new checkpoint-2" % after)
    with open(os.path.join(ckpt(h, 2), "metadata.json")) as f:
        run_id = json.load(f).get("run_id")
    check(run_id == "manage-fresh", "checkpoint-2 records run %r, expected manage-fresh" % run_id)
    check(latest(h) == "2\n", "LATEST is %r after --fresh, expected 2" % latest(h))
    log("a fresh run is refused naming --fresh; --fresh starts a new lineage (%d old checkpoints deleted)" %
        len(before))


def host_node_name():
    """flashckptd's default --node-name: the host name, characters outside [A-Za-z0-9._:-] as '-', cut to 64."""
    return re.sub(r"[^A-Za-z0-9._:-]", "-", socket.gethostname())[:64] or "localhost"


def check_nodes_and_offline_list(h):
    node = host_node_name()
    out, _ = cli_ok(h, "--socket", h.sock, "status", "--json")
    check(json.loads(out)["node_name"] == node, "status --json node_name: %s, expected %s" % (out[:300], node))
    out, _ = cli_ok(h, "--socket", h.sock, "status")
    check(("node    %s\n" % node) in out, "status does not show the node:\n%s" % out)
    # A step that only rank 1 has signalled, from another node: the listing names the rank that is
    # missing and the node that wrote it last.
    partial = os.path.join(job_dir(h), "checkpoint-11")
    os.makedirs(partial)
    with open(os.path.join(partial, "saved_signal_1"), "w") as f:
        json.dump({"job": JOB, "rank": 1, "step": 11, "resumed_from": 0, "files": [], "node": "node-x",
                   "world_size": 2}, f)
    try:
        online, _ = cli_ok(h, "--socket", h.sock, "list", "--job", JOB, "--json")
        offline, _ = cli_ok(h, "list", "--root", h.root, "--job", JOB, "--json")
        check(json.loads(online) == json.loads(offline),
              "list from the daemon and list --root differ:\n%s\n%s" % (online, offline))
        by_step = {c["step"]: c for c in json.loads(offline)}
        for step in STEPS:
            c = by_step[step]
            check(c["complete"] and c["signalled"] == [{"rank": 0, "node": node}, {"rank": 1, "node": node}],
                  "list of checkpoint-%d: %s" % (step, c))
        c = by_step[11]
        check(not c["complete"] and c["world_size"] == 2 and c["signalled"] == [{"rank": 1, "node": "node-x"}] and
              c["missing"] == [{"rank": 0, "last_node": node}], "list of the partial checkpoint-11: %s" % c)
        text, _ = cli_ok(h, "list", "--root", h.root, "--job", JOB)
        row = next((l for l in text.splitlines() if l.split()[:2] == [JOB, "11"]), "")
        check(("0@%s" % node) in row and "node-x" in row and "1/2" in row, "list row of checkpoint-11: %r\n%s" % (row, text))
    finally:
        shutil.rmtree(partial)
    out, _ = cli_ok(h, "inspect", ckpt(h, 10))
    check(("nodes       %s (ranks 0-1)" % node) in out, "inspect does not name the node:\n%s" % out)
    rc, out, err = h.cli("list", "--root", os.path.join(h.tmp, "no-such-root"))
    check(rc == 3 and "not a directory" in err, "list --root of a missing root: exit %d %s" % (rc, err))
    log("node %s in status, list (daemon and --root agree) and inspect; a missing rank is named" % node)


def check_inspect(h):
    with open(os.path.join(ckpt(h, 10), "metadata.json")) as f:
        meta = json.load(f)
    # The tensors as metadata.json indexes them: one per (name, kind); an EMA tensor shares its
    # parameter's name.
    tensors = {(name, p["kind"]) for name, pieces in meta["tensors"].items() for p in pieces}
    pieces = sum(len(v) for v in meta["tensors"].values())
    tensor_bytes = sum(p["offsets"][1] - p["offsets"][0] for v in meta["tensors"].values() for p in v)
    check(any(kind == "ema" for _, kind in tensors), "the sim's checkpoint has no EMA tensors: %s" % sorted(tensors))

    out, _ = cli_ok(h, "inspect", ckpt(h, 10))
    for needle in ["job         %s" % JOB, "step        10", "world size 2: tp 2 x pp 1 x shard 1",
                   "ema         decay 0.9, interval 1, init first", "%d tensors in %d pieces" % (len(tensors), pieces),
                   "model_state.tp01_pp00_shard00.safetensors", "TENSOR"]:
        check(needle in out, "inspect does not show %r:\n%s" % (needle, out))
    for name, kind in tensors:
        check(re.search(r"^%s\s+%s\s" % (re.escape(name), kind), out, re.M),
              "inspect has no row for tensor %s (%s):\n%s" % (name, kind, out))
    # verify counts in inspect's words: tensors (name, kind) and the pieces they are saved in.
    out, _ = cli_ok(h, "verify", ckpt(h, 10))
    check("%d files, %d tensors in %d pieces, " % (len(meta["files"]), len(tensors), pieces) in out,
          "verify does not count %d tensors in %d pieces:\n%s" % (len(tensors), pieces, out))
    out, _ = cli_ok(h, "verify", "--json", ckpt(h, 10))
    j = json.loads(out)
    check(j["ok"] is True and j["tensors"] == len(tensors) and j["pieces"] == pieces,
          "verify --json counts %s tensors, %s pieces; metadata.json %d, %d" %
          (j.get("tensors"), j.get("pieces"), len(tensors), pieces))

    out, _ = cli_ok(h, "inspect", "--json", ckpt(h, 10))
    j = json.loads(out)
    check(j["topology"]["world_size"] == 2 and j["topology"]["tp_degree"] == 2, "topology: %s" % j["topology"])
    check(j["step"] == 10 and j["job"] == JOB and j["complete"] is True, "job/step: %s %s" % (j["job"], j["step"]))
    check(len(j["tensors"]) == len(tensors) and j["totals"]["tensors"] == len(tensors),
          "inspect --json has %d tensors (totals %d), metadata.json %d" %
          (len(j["tensors"]), j["totals"]["tensors"], len(tensors)))
    check({(t["name"], t["kind"]) for t in j["tensors"]} == tensors, "tensor names differ from metadata.json")
    check(j["totals"]["pieces"] == pieces and j["totals"]["tensor_bytes"] == tensor_bytes,
          "totals %s, metadata.json has %d pieces, %d bytes" % (j["totals"], pieces, tensor_bytes))
    check(j["totals"]["file_bytes"] == sum(os.path.getsize(os.path.join(ckpt(h, 10), f["name"])) for f in meta["files"]),
          "file_bytes %d differs from the files' sizes" % j["totals"]["file_bytes"])
    check(j["ema"] is not None and abs(j["ema"]["decay"] - 0.9) < 1e-12 and j["ema"]["last_step"] == 10,
          "ema: %s" % j["ema"])

    incomplete = os.path.join(job_dir(h), "checkpoint-99")  # stays: newer than every complete one
    os.makedirs(incomplete)
    with open(os.path.join(incomplete, "saved_signal_0"), "w") as f:
        f.write("{}")
    rc, out, err = h.cli("inspect", incomplete)
    check(rc == 1 and "incomplete" in err and "1 saved_signal" in err, "inspect of an incomplete dir: %d %s" % (rc, err))
    rc, out, err = h.cli("inspect", os.path.join(job_dir(h), "checkpoint-12345"))
    check(rc == 3 and "no such directory" in err, "inspect of a missing dir: %d %s" % (rc, err))
    log("inspect ok: %d tensors, %d pieces" % (len(tensors), pieces))


def check_delete(h, address):
    out, _ = cli_ok(h, "--socket", h.sock, "delete", "--job", JOB, "--step", "4")
    check("deleted %s/checkpoint-4" % JOB in out, "delete output: %s" % out)
    check(not os.path.exists(ckpt(h, 4)), "checkpoint-4 is still there")
    check(not [n for n in os.listdir(job_dir(h)) if n.startswith(".deleting")], "a hidden .deleting-* is left")

    rc, out, err = h.cli("--socket", h.sock, "delete", "--job", JOB, "--step", "10")
    check(rc == 2, "deleting the newest without --force exited %d, expected 2:\n%s%s" % (rc, out, err))
    check("FAILED_PRECONDITION" in err and "newest complete checkpoint" in err and "--force" in err,
          "unexpected message: %s" % err)
    cli_ok(h, "verify", ckpt(h, 10))  # whole
    check(latest(h) == "10\n", "LATEST changed to %r" % latest(h))

    rc, out, err = h.cli("--address", address, "delete", "--job", JOB, "--step", "2")
    check(rc == 2 and "PERMISSION_DENIED" in err and "--tcp-allow-writes" in err,
          "delete over the read-only TCP listener: exit %d: %s" % (rc, err))
    rc, out, err = h.cli("--address", address, "gc", "--job", JOB, "--keep", "1")
    check(rc == 2 and "PERMISSION_DENIED" in err, "gc over the read-only TCP listener: exit %d: %s" % (rc, err))
    check(os.path.exists(os.path.join(ckpt(h, 2), "metadata.json")), "checkpoint-2 was deleted over TCP")

    rc, out, err = h.cli("--socket", h.sock, "delete", "--job", JOB, "--step", "5")
    check(rc == 2 and "NOT_FOUND" in err, "delete of a missing step: exit %d: %s" % (rc, err))
    rc, out, err = h.cli("--socket", h.sock, "delete", "--job", "../etc", "--step", "2")
    check(rc == 2 and "INVALID_ARGUMENT" in err, "delete with a bad job name: exit %d: %s" % (rc, err))

    out, _ = cli_ok(h, "--socket", h.sock, "delete", "--job", JOB, "--step", "10", "--force", "--json")
    j = json.loads(out)
    check(j["deleted"] == [10] and j["latest"] == 8, "delete --force: %s" % j)
    check(not os.path.exists(ckpt(h, 10)), "checkpoint-10 is still there after --force")
    check(latest(h) == "8\n", "LATEST is %r after deleting 10, expected 8" % latest(h))
    listing = json.loads(cli_ok(h, "--socket", h.sock, "list", "--job", JOB, "--json")[0])
    check([(c["step"], c["latest"]) for c in listing if c["complete"]] == [(2, False), (6, False), (8, True)],
          "list after the deletions: %s" % listing)
    log("delete ok: 4 deleted, 10 refused without --force then deleted, LATEST 8, TCP refused")


def check_gc(h):
    os.makedirs(ckpt(h, 1))  # an abandoned save older than every kept checkpoint
    out, _ = cli_ok(h, "--socket", h.sock, "gc", "--job", JOB, "--keep", "2", "--dry-run", "--json")
    j = json.loads(out)
    check(j["dry_run"] is True and j["deleted"] == [1, 2] and j["latest"] == 8, "gc --dry-run: %s" % j)
    check(os.path.exists(ckpt(h, 1)) and os.path.exists(ckpt(h, 2)), "gc --dry-run deleted something")
    out, _ = cli_ok(h, "--socket", h.sock, "gc", "--job", JOB, "--keep", "2")
    check("deleted %s/checkpoint-1\ndeleted %s/checkpoint-2\n" % (JOB, JOB) in out, "gc output: %s" % out)
    left = sorted(n for n in os.listdir(job_dir(h)))
    check(left == ["LATEST", "checkpoint-6", "checkpoint-8", "checkpoint-99"], "after gc --keep 2: %s" % left)
    for step in (6, 8):
        cli_ok(h, "verify", ckpt(h, step))
    out, _ = cli_ok(h, "--socket", h.sock, "gc", "--job", JOB, "--keep", "2")
    check(out.startswith("deleted nothing"), "a second gc: %s" % out)
    rc, out, err = h.cli("--socket", h.sock, "gc", "--job", JOB, "--keep", "0")
    check(rc not in (0, 1, 2, 3), "gc --keep 0 was not a usage error: %d %s" % (rc, err))
    log("gc ok: left %s" % left)


def check_reshard_progress(h):
    dst = os.path.join(h.tmp, "resharded")
    rc, out, err = h.cli("reshard", "--progress", ckpt(h, 8), dst, "--tp-degree", "1")
    check(rc == 0, "reshard exited %d:\n%s%s" % (rc, out, err))
    lines = [l for l in err.splitlines() if l.startswith("reshard ")]
    check(lines and "(100%)" in lines[-1], "no final progress line on stderr:\n%s" % err)
    check("%" not in out and "GB/s" not in out, "progress reached stdout:\n%s" % out)
    cli_ok(h, "verify", dst)
    log("reshard progress on stderr: %s" % lines[-1])


def check_misplaced_pieces(h):
    src = os.path.join(h.tmp, "misplaced")
    shutil.copytree(ckpt(h, 8), src)
    path = os.path.join(src, "metadata.json")
    with open(path) as f:
        meta = json.load(f)
    # A tensor cut over the two tp ranks: swap where its two pieces go, leave bytes and checksums.
    name, pieces = next((n, v) for n, v in sorted(meta["tensors"].items())
                        if len(v) == 2 and v[0]["kind"] == v[1]["kind"] and v[0]["box_offset"] != v[1]["box_offset"])
    pieces[0]["box_offset"], pieces[1]["box_offset"] = pieces[1]["box_offset"], pieces[0]["box_offset"]
    with open(path, "w") as f:
        json.dump(meta, f)
    want = "tensor '%s'" % name
    for args in (["inspect", src], ["verify", src]):
        rc, out, err = h.cli(*args)
        check(rc == 1 and want in err and "box offset" in err and ".safetensors" in err,
              "%s of misplaced pieces: exit %d\n%s%s" % (args[0], rc, out, err))
    dst = os.path.join(h.tmp, "misplaced-resharded")
    rc, out, err = h.cli("reshard", src, dst, "--tp-degree", "1")
    check(rc == 1 and want in err and "box offset" in err, "reshard of misplaced pieces: exit %d\n%s%s" % (rc, out, err))
    check(not os.path.exists(dst), "reshard of misplaced pieces created %s" % dst)
    log("misplaced pieces of %s refused by inspect, verify and reshard" % name)


def start_listening(h, extra_args=()):
    """Starts flashckptd with a TCP listener on a free loopback port; returns HOST:PORT."""
    h.start_daemon(extra_args=["--listen", "127.0.0.1:0"] + list(extra_args))

    def port():
        m = LISTEN_RE.search(tail(h.daemon_log, 200))
        return int(m.group(2)) if m else None
    return "127.0.0.1:%d" % wait_for(port, 30, "the 'listening tcp=' line in %s" % h.daemon_log)


def check_delete_over_tcp_with_writes(h):
    h.daemon_log = os.path.join(h.tmp, "flashckptd-writes.log")
    address = start_listening(h, ["--tcp-allow-writes"])
    out, _ = cli_ok(h, "--address", address, "delete", "--job", JOB, "--step", "6")
    check("deleted %s/checkpoint-6" % JOB in out and not os.path.exists(ckpt(h, 6)), "delete over TCP: %s" % out)
    check(latest(h) == "8\n", "LATEST is %r after deleting 6 over TCP" % latest(h))
    log("delete over TCP with --tcp-allow-writes ok")


def run(h):
    address = start_listening(h)
    save_checkpoints(h)
    check_nodes_and_offline_list(h)
    check_inspect(h)
    check_delete(h, address)
    check_gc(h)
    check_reshard_progress(h)
    check_misplaced_pieces(h)
    check(h.stop_daemon() == 0, "flashckptd did not exit 0 on SIGTERM")
    check_delete_over_tcp_with_writes(h)
    check_fresh(h)
    check(h.stop_daemon() == 0, "flashckptd (--tcp-allow-writes) did not exit 0 on SIGTERM")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()
    return run_with_daemon_harness(run, "fcman", [JOB], args.bin_dir, keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())
