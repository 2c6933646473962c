#!/usr/bin/python3
"""The TCP listener and its flags, through real flashckptd processes and the real `flashckpt` CLI.

  1. Flags refused at startup: each bad combination makes flashckptd exit non-zero, without leaving a
     socket behind, with a message naming the flag (TLS files given alone or without --listen,
     --tcp-allow-writes without --listen, malformed --listen values, unreadable or non-PEM TLS files,
     a port another process holds, an unknown --shm-group, out-of-range request limits).
  2. Plain TCP on loopback (--listen 127.0.0.1:0, the port read from the daemon's log): a checkpoint
     saved by flashckpt-sim over the UNIX socket is seen by `flashckpt --address ... status` and
     `list`; the same commands with --tls-ca fail (exit 2), and so does a port nobody listens on.
  3. TLS (a self-signed certificate made here with openssl; skipped with a message when openssl is
     missing): `status` and `list` with --tls-ca work, without it they fail (exit 2).
  4. A non-loopback address without TLS starts, with a warning in the log.

    test_tcp.py --bin-dir build/bin [--keep]
"""

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
# gRPC's default resolver (c-ares) keeps a small allocation for the process lifetime, which
# LeakSanitizer reports in the sanitizer pass when the CLI resolves "localhost"; the system resolver
# answers the same names here.
os.environ.setdefault("GRPC_DNS_RESOLVER", "native")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (DaemonHarness, TestFailure, check, daemon_command, log, run_with_daemon_harness,  # noqa: E402
                     spawn_daemon, stop_daemon, tail, wait_for)

JOB = "tcp%d" % os.getpid()
STARTUP_REFUSAL_TIMEOUT_S = 30
PORT_LOG_TIMEOUT_S = 30
LISTEN_RE = re.compile(r"listening tcp=(\S+):(\d+) tls=(on|off)")


class TcpHarness(DaemonHarness):
    def start_listening(self, name, extra_args):
        """Starts flashckptd with extra_args, logging to <name>.log; returns the TCP port it bound."""
        self.daemon_log = os.path.join(self.tmp, name + ".log")
        self.start_daemon(extra_args=extra_args)

        def port():
            m = LISTEN_RE.search(tail(self.daemon_log, 200))
            return int(m.group(2)) if m else None
        p = wait_for(port, PORT_LOG_TIMEOUT_S, "the 'listening tcp=' line in %s" % self.daemon_log)
        check(p > 0, "the daemon logged port %d" % p)
        log("%s: listening on port %d" % (name, p))
        return p


def expect_refused(h, name, args, needle):
    """flashckptd with args must exit non-zero, saying `needle`, and leave no socket."""
    sock = os.path.join(h.tmp, name + ".sock")
    out = os.path.join(h.tmp, name + ".log")
    h.logs.append(out)
    cmd = daemon_command(h.binary("flashckptd"), sock, h.root, extra_args=args)
    proc = spawn_daemon(cmd, out)
    try:
        rc = proc.wait(timeout=STARTUP_REFUSAL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop_daemon(proc)
        raise TestFailure("flashckptd %s started although it should refuse to:\n%s" % (" ".join(args), tail(out)))
    text = tail(out, 100)
    check(rc != 0, "flashckptd %s exited 0:\n%s" % (" ".join(args), text))
    check(needle in text, "flashckptd %s: the message does not say %r:\n%s" % (" ".join(args), needle, text))
    check(not os.path.exists(sock), "flashckptd %s left its socket behind" % " ".join(args))
    log("refused (exit %d): %s -> %s" % (rc, " ".join(args), text.strip().splitlines()[-1][:160]))


def check_refused_flags(h):
    pem = os.path.join(h.tmp, "not-a-cert.pem")
    with open(pem, "w") as f:
        f.write("hello\n")
    # The holder sets SO_REUSEPORT, as a second gRPC server would: the daemon must still refuse the port.
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    busy_port = held.getsockname()[1]
    try:
        cases = [
            ("cert-alone", ["--listen", "127.0.0.1:0", "--tls-cert", pem], "--tls-cert and --tls-key go together"),
            ("key-alone", ["--listen", "127.0.0.1:0", "--tls-key", pem], "--tls-cert and --tls-key go together"),
            ("tls-no-listen", ["--tls-cert", pem, "--tls-key", pem], "need --listen"),
            ("writes-no-listen", ["--tcp-allow-writes"], "--tcp-allow-writes needs --listen"),
            ("v6-no-brackets", ["--listen", "::1:7070"], "brackets"),
            ("port-range", ["--listen", "127.0.0.1:70000"], "port must be a number from 0 to 65535"),
            ("bad-host", ["--listen", "a b:7070"], "neither an IP address nor a host name"),
            ("unreadable-cert", ["--listen", "127.0.0.1:0", "--tls-cert", os.path.join(h.tmp, "missing.pem"),
                                 "--tls-key", pem], "--tls-cert %s is not readable" % os.path.join(h.tmp, "missing.pem")),
            ("not-pem", ["--listen", "127.0.0.1:0", "--tls-cert", pem, "--tls-key", pem], "holds no PEM certificate"),
            ("port-held", ["--listen", "127.0.0.1:%d" % busy_port], "could not listen there"),
            ("unknown-group", ["--shm-group", "no-such-group-%d" % os.getpid()], "no such group"),
            ("tensors-zero", ["--max-tensors-per-rank", "0"], "--max-tensors-per-rank"),
            ("rank-bytes", ["--max-rank-bytes", "lots"], "--max-rank-bytes"),
        ]
        for name, args, needle in cases:
            expect_refused(h, name, args, needle)
    finally:
        held.close()
    return len(cases)


def cli_json(h, *args):
    rc, out, err = h.cli(*args)
    check(rc == 0, "flashckpt %s exited %d:\n%s%s" % (" ".join(args), rc, out, err))
    return json.loads(out)


def check_plain_tcp(h, cert):
    port = h.start_listening("plain", ["--listen", "127.0.0.1:0"])
    # One saved checkpoint, written over the UNIX socket as a trainer would.
    sim = subprocess.run([h.binary("flashckpt-sim"), "--socket", h.sock, "--job", JOB, "--rank", "0",
                          "--world-size", "1", "--layers", "1", "--hidden", "16", "--steps", "2", "--save-every", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60, stdin=subprocess.DEVNULL)
    check(sim.returncode == 0, "flashckpt-sim failed:\n%s" % sim.stdout.decode(errors="replace"))
    address = "127.0.0.1:%d" % port
    status = cli_json(h, "--address", address, "status", "--json")
    check(status.get("root") == h.root, "status over TCP names root %r, expected %r" % (status.get("root"), h.root))
    listing = cli_json(h, "--address", address, "list", "--job", JOB, "--json")
    steps = [(c.get("job"), c.get("step"), c.get("complete")) for c in listing]
    check((JOB, 2, True) in steps, "list over TCP does not show checkpoint 2 of %s: %s" % (JOB, steps))
    # The table form goes over TCP too (and `flashckpt status` subcommand-first spelling).
    rc, out, err = h.cli("status", "--address", address)
    check(rc == 0 and JOB in out, "flashckpt status --address: exit %d\n%s%s" % (rc, out, err))
    log("status and list over plain TCP ok (%s)" % address)

    if cert:
        rc, out, err = h.cli("--address", address, "--tls-ca", cert, "status")
        check(rc == 2, "status with --tls-ca against a plain-TCP daemon exited %d, expected 2:\n%s%s" % (rc, out, err))
        check("not reachable at %s (TLS)" % address in err, "unexpected message: %s" % err)
    rc, out, err = h.cli("--tls-ca", h.daemon_log, "status")
    check(rc not in (0, 1, 2, 3), "--tls-ca without --address was not a usage error (exit %d): %s" % (rc, err))
    free = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    free.bind(("127.0.0.1", 0))
    nobody = free.getsockname()[1]
    free.close()
    rc, out, err = h.cli("--address", "127.0.0.1:%d" % nobody, "status")
    check(rc == 2 and "not reachable" in err, "status on a closed port: exit %d: %s" % (rc, err))
    rc = h.stop_daemon()
    check(rc == 0, "flashckptd exited %s on SIGTERM" % rc)


def make_certificate(h):
    """A self-signed certificate for localhost and 127.0.0.1: (cert, key), or None without openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    cert, key = os.path.join(h.tmp, "cert.pem"), os.path.join(h.tmp, "key.pem")
    p = subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-days", "2",
                        "-keyout", key, "-out", cert],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60, stdin=subprocess.DEVNULL)
    check(p.returncode == 0, "openssl req failed:\n%s" % p.stdout.decode(errors="replace"))
    return cert, key


def check_tls(h, cert, key):
    port = h.start_listening("tls", ["--listen", "127.0.0.1:0", "--tls-cert", cert, "--tls-key", key])
    check("tls=on" in tail(h.daemon_log, 200), "the daemon did not log tls=on")
    address = "127.0.0.1:%d" % port
    status = cli_json(h, "--address", address, "--tls-ca", cert, "status", "--json")
    check(status.get("root") == h.root, "status over TLS names root %r" % status.get("root"))
    listing = cli_json(h, "--address", address, "--tls-ca", cert, "list", "--json")
    check(any(c.get("job") == JOB for c in listing), "list over TLS misses %s" % JOB)
    status = cli_json(h, "--address", "localhost:%d" % port, "--tls-ca", cert, "status", "--json")
    check(status.get("root") == h.root, "status over TLS to localhost failed")
    for cmd in (["status"], ["list"]):
        rc, out, err = h.cli("--address", address, *cmd)
        check(rc == 2, "%s without TLS against a TLS daemon exited %d, expected 2:\n%s%s" % (cmd[0], rc, out, err))
    log("status and list over TLS ok; without --tls-ca refused")
    rc = h.stop_daemon()
    check(rc == 0, "flashckptd exited %s on SIGTERM" % rc)
    return True


def check_public_warning(h):
    h.start_listening("public", ["--listen", "0.0.0.0:0"])
    text = tail(h.daemon_log, 200)  # the warning comes before the 'listening tcp=' line start_listening waited for
    check("is not loopback and has no TLS" in text, "no warning for 0.0.0.0 without TLS:\n%s" % text)
    rc = h.stop_daemon()
    check(rc == 0, "flashckptd exited %s on SIGTERM" % rc)


def run(h):
    refused = check_refused_flags(h)
    log("%d bad flag combinations refused at startup" % refused)
    made = make_certificate(h)
    check_plain_tcp(h, made[0] if made else None)
    if made:
        tls = check_tls(h, *made)
    else:
        log("SKIPPED the TLS part: openssl is not installed")
        tls = False
    check_public_warning(h)
    log("summary: refused_flag_sets=%d plain_tcp=ok tls=%s" % (refused, "ok" if tls else "skipped (no openssl)"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    return run_with_daemon_harness(run, "fctcp", [JOB], args.bin_dir, keep=args.keep, harness=TcpHarness)


if __name__ == "__main__":
    sys.exit(main())
