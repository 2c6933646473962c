#!/usr/bin/python3
"""Watching the daemon: the Prometheus endpoint, the WatchEvents stream and the status table, through a
real flashckptd, real trainers (flashckpt-sim) and the real `flashckpt` CLI.

  1. --metrics-listen 127.0.0.1:0 (the port read from the daemon's log): /metrics answers valid
     exposition text (every sample belongs to a family with # TYPE, histogram buckets are cumulative
     and end at +Inf = _count), HEAD has no body, other paths 404, other methods 405, a malformed
     request 400.
  2. `flashckpt watch --job J --json` over the socket and `flashckpt --address ... watch` over TCP,
     both started before a save: they print the events of 8 EMA steps with a save every 2 and
     --keep 2 (committed, ema-updated, persisted with GB/s, complete, deleted by retention).
  3. The counters moved by what the save did: snapshots 8, persists 4, EMA updates 8, complete 4,
     deleted 2, bytes > 0, the persist histogram counted 4, last durable step 8.
  4. A save that fails (the root on a 1 MiB tmpfs; skipped where mount is not allowed): the watcher
     prints `failed` with the error code and the failure counter moves under that reason.
  5. `flashckpt status` shows the per-job line (ranks, committed, durable, lag, GB/s, EMA, failures).
  6. SIGTERM: the watchers end with exit 2 saying the daemon is stopping.
  7. deploy/prometheus/flashckpt-alerts.yaml parses, and every flashckpt_* metric its rules use is one
     the daemon exports.

    test_observe.py --bin-dir build/bin [--keep]
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

sys.dont_write_bytecode = True
os.environ.setdefault("GRPC_DNS_RESOLVER", "native")  # see test_tcp.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import DaemonHarness, TestFailure, check, log, run_with_daemon_harness, tail, wait_for  # noqa: E402

JOB = "obs%d" % os.getpid()
FULL_JOB = "obsfull%d" % os.getpid()
LOG_TIMEOUT_S = 30
EVENT_TIMEOUT_S = 60
METRICS_RE = re.compile(r"metrics listening http=(\S+):(\d+)")
TCP_RE = re.compile(r"listening tcp=(\S+):(\d+)")
SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})? '
                       r'(-?[0-9.e+-]+|\+Inf|-Inf|NaN)$')


def http(port, request):
    """Sends raw bytes to the metrics port; returns (status code, headers dict, body bytes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    code = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
    return code, headers, body


def scrape(port):
    code, headers, body = http(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    check(code == 200, "GET /metrics answered %d" % code)
    check(headers.get("content-type", "").startswith("text/plain; version=0.0.4"),
          "content-type %r" % headers.get("content-type"))
    check(int(headers.get("content-length", -1)) == len(body), "content-length does not match the body")
    return parse_exposition(body.decode())


def parse_exposition(text):
    """Checks the text format and returns {(name, frozenset(labels)): value}."""
    types, samples = {}, {}
    check(text.endswith("\n"), "the exposition does not end with a newline")
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            check(kind in ("counter", "gauge", "histogram", "summary", "untyped"), "line %d: type %r" % (n, kind))
            check(name not in types, "line %d: second # TYPE for %s" % (n, name))
            types[name] = kind
            continue
        m = SAMPLE_RE.match(line)
        check(m is not None, "line %d is not a valid sample: %r" % (n, line))
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        check(name in types or (family in types and types[family] == "histogram"),
              "line %d: %s has no # TYPE before it" % (n, name))
        pairs = frozenset(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels))
        check((name, pairs) not in samples, "line %d: duplicate sample %s%s" % (n, name, labels))
        samples[(name, pairs)] = float(value)
    # Histograms: cumulative buckets ending at +Inf, which equals _count.
    for name, kind in types.items():
        if kind != "histogram":
            continue
        buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in samples.items() if k[0] == name + "_bucket"))
        check(buckets and buckets[-1][0] == float("inf"), "%s has no +Inf bucket" % name)
        counts = [v for _, v in buckets]
        check(counts == sorted(counts), "%s buckets are not cumulative: %s" % (name, counts))
        check(counts[-1] == samples[(name + "_count", frozenset())], "%s +Inf bucket != _count" % name)
    return samples


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())), 0.0)


def check_http_edges(port):
    code, headers, body = http(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    check(code == 200 and body == b"" and int(headers.get("content-length", 0)) > 0,
          "HEAD /metrics: %d, body %d bytes, content-length %s" % (code, len(body), headers.get("content-length")))
    code, _, _ = http(port, b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n")
    check(code == 404, "GET /other answered %d, expected 404" % code)
    code, headers, _ = http(port, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    check(code == 405 and "GET" in headers.get("allow", ""), "POST /metrics answered %d, expected 405" % code)
    code, _, _ = http(port, b"NOT HTTP AT ALL\r\n\r\n")
    check(code == 400, "a malformed request answered %d, expected 400" % code)
    code, _, _ = http(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n")
    check(code == 400, "a 20 kB header answered %d, expected 400" % code)
    log("HTTP: HEAD 200 without body, /other 404, POST 405, garbage 400, oversized header 400")


class Watcher:
    """`flashckpt watch --json` in the background; lines collected by read_until."""

    def __init__(self, h, name, args):
        self.name = name
        self.out_path = os.path.join(h.tmp, name + ".out")
        self.err_path = os.path.join(h.tmp, name + ".err")
        h.logs += [self.out_path, self.err_path]
        self.proc = subprocess.Popen([h.binary("flashckpt")] + args + ["--json"], stdout=open(self.out_path, "w"),
                                     stderr=open(self.err_path, "w"), stdin=subprocess.DEVNULL)
        wait_for(lambda: "watching events" in open(self.err_path).read() or self.proc.poll() is not None,
                 LOG_TIMEOUT_S, "%s to subscribe" % name)
        check(self.proc.poll() is None, "%s exited at once:\n%s" % (name, open(self.err_path).read()))

    def events(self):
        with open(self.out_path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]

    def wait_for_events(self, pred, what):
        """Waits until pred(events) holds; returns the events then."""
        wait_for(lambda: pred(self.events()), EVENT_TIMEOUT_S, "%s: %s" % (self.name, what))
        return self.events()


def kinds(events, kind, job=JOB):
    return [e for e in events if e["event"] == kind and e.get("job") == job]


def run_sim(h, job, steps, save_every, expect_ok=True):
    cmd = [h.binary("flashckpt-sim"), "--socket", h.sock, "--job", job, "--rank", "0", "--world-size", "1",
           "--layers", "2", "--hidden", "64", "--steps", str(steps), "--save-every", str(save_every),
           "--ema-decay", "0.9", "--ema-interval", "1", "--wait-timeout", "30"]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120, stdin=subprocess.DEVNULL)
    out = p.stdout.decode(errors="replace")
    if expect_ok:
        check(p.returncode == 0, "flashckpt-sim failed:\n%s" % out)
    return p.returncode, out


def check_save_events(w):
    evs = w.wait_for_events(lambda e: len(kinds(e, "deleted")) >= 2 and len(kinds(e, "complete")) >= 4,
                            "4 complete and 2 deleted events")
    time.sleep(0.2)  # the last persisted/deleted lines of the same moment
    committed = sorted(e["step"] for e in kinds(evs, "committed"))
    check(committed == list(range(1, 9)), "%s: committed steps %s, expected 1..8" % (w.name, committed))
    ema = sorted(e["step"] for e in kinds(evs, "ema-updated"))
    check(ema == list(range(1, 9)), "%s: EMA steps %s, expected 1..8" % (w.name, ema))
    persisted = kinds(evs, "persisted")
    check(sorted(e["step"] for e in persisted) == [2, 4, 6, 8], "%s: persisted %s" % (w.name, persisted))
    check(all(e["bytes"] > 0 and e["seconds"] > 0 and e["gbps"] > 0 for e in persisted),
          "%s: persisted events without bytes/seconds/gbps: %s" % (w.name, persisted))
    check(sorted(e["step"] for e in kinds(evs, "complete")) == [2, 4, 6, 8], "%s: complete events" % w.name)
    deleted = kinds(evs, "deleted")
    check(sorted(e["step"] for e in deleted) == [2, 4] and all(e["reason"] == "retention" for e in deleted),
          "%s: deleted events %s, expected steps 2 and 4 by retention" % (w.name, deleted))
    # Order per step: committed first; the last rank's `complete` comes just before its `persisted`
    # (the rank's persist ends once it has completed the checkpoint).
    order = {(e["event"], e["step"]): i for i, e in enumerate(evs) if e.get("job") == JOB}
    for s in (2, 4, 6, 8):
        check(order[("committed", s)] < order[("complete", s)] < order[("persisted", s)],
              "%s: events of step %d out of order" % (w.name, s))
    check(not [e for e in evs if e.get("job") not in (JOB, None)], "%s: events of another job" % w.name)
    log("%s: %d events: committed 1..8, ema-updated 1..8, persisted/complete 2,4,6,8, deleted 2,4 (retention)" %
        (w.name, len(evs)))


def check_counters(before, after, persisted_bytes):
    j = {"job": JOB}
    d = lambda name, **extra: value(after, name, **dict(j, **extra)) - value(before, name, **dict(j, **extra))
    expected = {"flashckpt_snapshots_total": 8, "flashckpt_persists_total": 4, "flashckpt_ema_updates_total": 8,
                "flashckpt_checkpoints_completed_total": 4}
    for name, want in expected.items():
        check(d(name) == want, "%s{job=%s} moved by %s, expected %d" % (name, JOB, d(name), want))
    check(d("flashckpt_checkpoints_deleted_total", reason="retention") == 2, "deleted{reason=retention} != 2")
    check(d("flashckpt_persisted_bytes_total") == persisted_bytes,
          "persisted bytes moved by %s, the events say %d" % (d("flashckpt_persisted_bytes_total"), persisted_bytes))
    hist = value(after, "flashckpt_persist_duration_seconds_count") - value(before, "flashckpt_persist_duration_seconds_count")
    check(hist == 4, "the persist duration histogram counted %s persists, expected 4" % hist)
    check(value(after, "flashckpt_last_durable_step", **j) == 8, "last durable step %s, expected 8" %
          value(after, "flashckpt_last_durable_step", **j))
    check(value(after, "flashckpt_host_memory_budget_bytes") > 0, "no memory budget gauge")
    check(("flashckpt_cuda_compiled", frozenset()) in after and ("flashckpt_cuda_devices", frozenset()) in after,
          "no CUDA gauges")
    stamp = value(after, "flashckpt_last_complete_timestamp_seconds", **j)
    check(abs(time.time() - stamp) < 300, "last complete timestamp %s is not about now" % stamp)
    log("counters moved: snapshots +8, persists +4, ema +8, completed +4, deleted +2, bytes +%d, "
        "histogram +4, last durable step 8" % persisted_bytes)


def check_failure(h, port, w):
    """The root of FULL_JOB on a 1 MiB tmpfs: its save fails with RESOURCE_EXHAUSTED."""
    full = os.path.join(h.root, FULL_JOB)
    os.makedirs(full)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", full], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
    if r.returncode != 0:
        log("SKIPPED the failure case: cannot mount a tmpfs here (%s)" % r.stdout.decode(errors="replace").strip())
        return
    try:
        before = scrape(port)
        cmd = [h.binary("flashckpt-sim"), "--socket", h.sock, "--job", FULL_JOB, "--rank", "0", "--world-size", "1",
               "--layers", "2", "--hidden", "512", "--steps", "2", "--save-every", "2", "--wait-timeout", "30"]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120,
                           stdin=subprocess.DEVNULL)
        check(p.returncode != 0, "a save onto a 1 MiB file system succeeded:\n%s" % p.stdout.decode(errors="replace"))
        evs = w.wait_for_events(lambda e: kinds(e, "failed", FULL_JOB), "a failed event")
        failed = kinds(evs, "failed", FULL_JOB)[0]
        check(failed["code"] == "RESOURCE_EXHAUSTED" and failed["step"] == 2 and "No space left" in failed["reason"],
              "failed event %s" % failed)
        after = scrape(port)
        moved = (value(after, "flashckpt_persist_failures_total", job=FULL_JOB, reason="RESOURCE_EXHAUSTED") -
                 value(before, "flashckpt_persist_failures_total", job=FULL_JOB, reason="RESOURCE_EXHAUSTED"))
        check(moved == 1, "failures{reason=RESOURCE_EXHAUSTED} moved by %s, expected 1" % moved)
        log("a full disk: `failed code=RESOURCE_EXHAUSTED` event and the failure counter +1")
    finally:
        subprocess.run(["umount", "-l", full])


def check_alert_rules(port):
    import yaml  # python3-yaml (scripts/deps.sh)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy", "prometheus",
                        "flashckpt-alerts.yaml")
    with open(path) as f:
        doc = yaml.safe_load(f)
    _, _, body = http(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    families = re.findall(r"^# TYPE (\S+) (\S+)$", body.decode(), re.M)
    exported = {name for name, _ in families}
    exported |= {name + suffix for name, kind in families if kind == "histogram" for suffix in ("_bucket", "_sum", "_count")}
    rules = [r for g in doc["groups"] for r in g["rules"]]
    check(len(rules) >= 5, "only %d alert rules" % len(rules))
    for r in rules:
        check(r.get("alert") and r.get("expr") and r.get("annotations", {}).get("summary"), "incomplete rule %s" % r)
        for name in re.findall(r"\bflashckpt_[a-z_]+", r["expr"]):
            check(name in exported, "alert %s uses %s, which the daemon does not export" % (r["alert"], name))
    log("%d alert rules parse and use only exported metrics" % len(rules))


def run(h):
    h.daemon_log = os.path.join(h.tmp, "flashckptd.log")
    # One writer thread: the saves complete in step order, so retention deletes exactly steps 2 and 4.
    h.start_daemon(extra_args=["--metrics-listen", "127.0.0.1:0", "--listen", "127.0.0.1:0", "--keep", "2",
                               "--writer-threads", "1"])
    port = wait_for(lambda: (lambda m: int(m.group(2)) if m else None)(METRICS_RE.search(tail(h.daemon_log, 200))),
                    LOG_TIMEOUT_S, "the 'metrics listening' line")
    tcp_port = wait_for(lambda: (lambda m: int(m.group(2)) if m else None)(TCP_RE.search(tail(h.daemon_log, 200))),
                        LOG_TIMEOUT_S, "the 'listening tcp' line")
    log("metrics on port %d, gRPC TCP on port %d" % (port, tcp_port))
    before = scrape(port)
    check_http_edges(port)

    local = Watcher(h, "watch-socket", ["--socket", h.sock, "watch", "--job", JOB])
    remote = Watcher(h, "watch-tcp", ["--address", "127.0.0.1:%d" % tcp_port, "watch"])
    run_sim(h, JOB, steps=8, save_every=2)
    check_save_events(local)
    check_save_events(remote)
    persisted_bytes = sum(e["bytes"] for e in kinds(local.events(), "persisted"))
    after = scrape(port)
    check_counters(before, after, persisted_bytes)
    check_alert_rules(port)

    rc, out, err = h.cli("--socket", h.sock, "status")
    row = [ln for ln in out.splitlines() if ln.startswith(JOB + " ")]
    check(row and row[0].split()[1:5] == ["1/1", "8", "8", "0"],
          "status has no job line '%s 1/1 8 8 0 ...':\n%s%s" % (JOB, out, err))
    check("LAG" in out and "PERSIST GB/s" in out, "status table lacks LAG / PERSIST GB/s:\n%s" % out)
    rc, out, err = h.cli("--socket", h.sock, "status", "--json")
    job = [j for j in json.loads(out)["jobs"] if j["job"] == JOB][0]
    check(job["last_committed_step"] == 8 and job["ranks"][0]["last_persist_gbps"] > 0, "status --json: %s" % job)
    log("status: %s" % row[0])

    check_failure(h, port, remote)

    check(h.stop_daemon() == 0, "flashckptd did not stop cleanly on SIGTERM")
    for w in (local, remote):
        rc = w.proc.wait(timeout=30)
        err = open(w.err_path).read()
        check(rc == 2 and "stopping" in err, "%s after SIGTERM: exit %d, %r" % (w.name, rc, err))
        check("not reachable" not in err and "is flashckptd" not in err,
              "%s after SIGTERM blames the address of a daemon it was connected to: %r" % (w.name, err))
    log("watchers ended with exit 2: the daemon is stopping")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    return run_with_daemon_harness(run, "fcobs", [JOB, FULL_JOB], args.bin_dir, keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())
