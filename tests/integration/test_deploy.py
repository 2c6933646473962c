#!/usr/bin/python3
"""What deploy/ promises (docs/operating.md, "Running as a sidecar (Kubernetes)"), checked on the files themselves.

Every YAML file under deploy/k8s is parsed (all its documents); then:
  - the Pod runs flashckptd as a sidecar (a native one: an init container with restartPolicy
    Always, or a second container) beside a trainer container;
  - both mount the same emptyDir at the socket's directory (the `socket` of the ConfigMap) and a
    memory-backed emptyDir with a sizeLimit at /dev/shm, and run as the same uid and gid, with an
    fsGroup;
  - the daemon mounts the checkpoint volume (a PVC defined in deploy/k8s, or a hostPath) at the
    ConfigMap's `root`, and the ConfigMap at /etc/flashckpt, and is started with --config on it;
  - readiness and liveness probes are gRPC probes on port 7070, where the ConfigMap's `listen`
    serves, read-only (no tcp-allow-writes), on every address;
  - the daemon has CPU and memory requests and a memory limit of at least its max-host-memory, and
    /dev/shm's sizeLimit is at least max-host-memory;
  - every key of the ConfigMap's flashckptd.conf (and of deploy/flashckptd.conf.example) is a long
    flag of the real flashckptd (from its --help: CLI11 ignores unknown keys in a config file), and
    the real flashckptd starts from the ConfigMap's file, paths moved to a temporary folder, takes
    its values (the logged budget, the TCP listener) and stops cleanly on SIGTERM;
  - deploy/container/Containerfile builds with tests off from packages of scripts/deps.sh, and runs
    flashckptd as the non-root uid the pod runs as.

For many nodes (docs/operating.md, "Many nodes, one root"):
  - the DaemonSet (deploy/k8s/daemonset.yaml) runs flashckptd with --config on its own ConfigMap and
    --node-name from the node's name (the downward API), mounts the host's /dev/shm and a host
    directory at the socket's directory (so trainer pods on the node share both), and a
    ReadWriteMany PVC at the ConfigMap's root; its ConfigMap's keys are flags and the real daemon
    starts from it (as above);
  - deploy/slurm/prolog.sh, run for real as a Slurm prolog would (as root, SLURM_JOB_ID and
    SLURM_JOB_USER set; skipped when not root), starts a daemon whose status names the short host
    name as its node, and deploy/slurm/epilog.sh stops it and removes its run directory.

    test_deploy.py --bin-dir build/bin
"""

import argparse
import glob
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import yaml

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import TestFailure, check  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(REPO, "deploy", "k8s")
PROBE_PORT = 7070
CONFIG_DIR = "/etc/flashckpt"


def parse_size(text):
    """'48GiB', '512MiB', '50Gi', '56G', '1024' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)B?\s*", str(text))
    check(m, "not a size: %r" % text)
    power = "KMGTP".find(m.group(2)) + 1 if m.group(2) else 0
    base = 1024 if (m.group(3) or str(text).strip().endswith("iB")) else 1000
    return int(float(m.group(1)) * base ** power)


def parse_conf(text):
    """The key = value lines of an INI file (comments and blank lines skipped)."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line.startswith(";") or line.startswith("["):
            continue
        check("=" in line, "config line without '=': %r" % line)
        key, value = (s.strip() for s in line.split("=", 1))
        out[key] = value
    return out


def daemon_flags(flashckptd):
    """The long flags flashckptd --help lists, without the leading dashes."""
    p = subprocess.run([flashckptd, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
    check(p.returncode == 0, "flashckptd --help exited %d" % p.returncode)
    flags = set(re.findall(r"^\s+(?:-\w,)?--([a-z0-9][a-z0-9-]*)", p.stdout.decode(), re.M))
    check({"socket", "root", "listen", "max-host-memory"} <= flags, "unexpected --help output: %s" % sorted(flags))
    return flags - {"help", "version", "config"}


def load_documents():
    files = sorted(glob.glob(os.path.join(K8S, "*.yaml")) + glob.glob(os.path.join(K8S, "*.yml")))
    check(files, "no YAML files in %s" % K8S)
    docs = []
    for path in files:
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc is not None:
                    check(isinstance(doc, dict) and "kind" in doc and "apiVersion" in doc,
                          "%s: a document without kind/apiVersion" % path)
                    docs.append((os.path.basename(path), doc))
    print("parsed %d documents from %s" % (len(docs), ", ".join(os.path.basename(f) for f in files)))
    return docs


def one(docs, kind):
    found = [d for _, d in docs if d["kind"] == kind]
    check(len(found) >= 1, "no %s in deploy/k8s" % kind)
    return found


def mounts(container):
    return {m["name"]: m for m in container.get("volumeMounts", [])}


def security(pod_spec, container, key):
    return container.get("securityContext", {}).get(key, pod_spec.get("securityContext", {}).get(key))


def check_pod(pod, docs, conf):
    spec = pod["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    sidecars = [c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    everyone = sidecars + spec.get("containers", [])
    daemons = [c for c in everyone if "flashckptd" in c["name"]]
    check(len(daemons) == 1, "expected one flashckptd container, found %s" % [c["name"] for c in everyone])
    daemon = daemons[0]
    trainers = [c for c in spec.get("containers", []) if c is not daemon]
    check(trainers, "no trainer container beside flashckptd")
    native = daemon in sidecars
    print("sidecar: %s (%s), trainer(s): %s" % (daemon["name"], "native: initContainer with restartPolicy Always"
                                               if native else "a second container", [t["name"] for t in trainers]))

    # Started from the ConfigMap, which is mounted where --config points.
    argv = daemon.get("command", []) + daemon.get("args", [])
    check("--config" in argv and argv[argv.index("--config") + 1] == CONFIG_DIR + "/flashckptd.conf",
          "flashckptd is not started with --config %s/flashckptd.conf: %s" % (CONFIG_DIR, argv))
    cm_mount = [m for m in daemon.get("volumeMounts", []) if m["mountPath"] == CONFIG_DIR]
    check(cm_mount and "configMap" in volumes[cm_mount[0]["name"]], "the ConfigMap is not mounted at " + CONFIG_DIR)

    # Socket directory: one emptyDir, same path in every container.
    sock_dir = os.path.dirname(conf["socket"])
    for c in [daemon] + trainers:
        at = [m for m in c.get("volumeMounts", []) if m["mountPath"] == sock_dir]
        check(at, "%s does not mount the socket directory %s" % (c["name"], sock_dir))
        check("emptyDir" in volumes[at[0]["name"]], "the socket directory is not an emptyDir")
    check(len({[m["name"] for m in c["volumeMounts"] if m["mountPath"] == sock_dir][0]
               for c in [daemon] + trainers}) == 1, "the containers mount different volumes at " + sock_dir)

    # /dev/shm: one memory-backed emptyDir with a sizeLimit, in every container.
    shm_names = set()
    for c in [daemon] + trainers:
        at = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        check(at, "%s does not mount /dev/shm" % c["name"])
        shm_names.add(at[0]["name"])
    check(len(shm_names) == 1, "the containers mount different volumes at /dev/shm")
    shm = volumes[shm_names.pop()].get("emptyDir")
    check(shm is not None and shm.get("medium") == "Memory", "/dev/shm is not a memory-backed emptyDir")
    check("sizeLimit" in shm, "/dev/shm's emptyDir has no sizeLimit")
    budget = parse_size(conf["max-host-memory"])
    check(parse_size(shm["sizeLimit"]) >= budget, "/dev/shm sizeLimit %s is below max-host-memory %s"
          % (shm["sizeLimit"], conf["max-host-memory"]))

    # The checkpoint root.
    at = [m for m in daemon.get("volumeMounts", []) if m["mountPath"] == conf["root"]]
    check(at, "flashckptd does not mount a volume at root = %s" % conf["root"])
    ck = volumes[at[0]["name"]]
    if "persistentVolumeClaim" in ck:
        claim = ck["persistentVolumeClaim"]["claimName"]
        pvcs = [d["metadata"]["name"] for _, d in docs if d["kind"] == "PersistentVolumeClaim"]
        check(claim in pvcs, "the pod claims %s, deploy/k8s defines %s" % (claim, pvcs))
    else:
        check("hostPath" in ck, "the checkpoint volume is neither a PVC nor a hostPath: %s" % ck)

    # gRPC probes on the TCP listener.
    for probe in ("readinessProbe", "livenessProbe"):
        p = daemon.get(probe)
        check(p and "grpc" in p and p["grpc"].get("port") == PROBE_PORT,
              "%s is not a grpc probe on port %d: %s" % (probe, PROBE_PORT, p))
    check(conf.get("listen") in ("0.0.0.0:%d" % PROBE_PORT, "[::]:%d" % PROBE_PORT),
          "listen = %r: the kubelet probes the pod IP, port %d" % (conf.get("listen"), PROBE_PORT))
    check(conf.get("tcp-allow-writes", "false").lower() in ("false", "0", "no"),
          "the probe port must stay read-only (tcp-allow-writes)")

    # Resources: the daemon's memory covers the segments it allocates.
    res = daemon.get("resources", {})
    for what in ("cpu", "memory"):
        check(what in res.get("requests", {}), "flashckptd has no %s request" % what)
    check("memory" in res.get("limits", {}), "flashckptd has no memory limit")
    check(parse_size(res["limits"]["memory"]) >= budget and parse_size(res["requests"]["memory"]) >= budget,
          "flashckptd's memory (%s) is below max-host-memory %s" % (res, conf["max-host-memory"]))

    # Same uid and gid everywhere, and an fsGroup for the volumes.
    uids = {security(spec, c, "runAsUser") for c in [daemon] + trainers}
    gids = {security(spec, c, "runAsGroup") for c in [daemon] + trainers}
    check(len(uids) == 1 and None not in uids, "containers run as different or unset uids: %s" % uids)
    check(len(gids) == 1 and None not in gids, "containers run as different or unset gids: %s" % gids)
    check(spec.get("securityContext", {}).get("fsGroup") is not None, "the pod has no fsGroup")
    check(uids != {0}, "the pod runs as root")
    return uids.pop()


def check_conf_keys(conf, flags, what):
    unknown = sorted(set(conf) - flags)
    check(not unknown, "%s has keys that are not flashckptd flags: %s" % (what, unknown))
    print("%s: %d keys, all flashckptd flags: %s" % (what, len(conf), ", ".join(sorted(conf))))


def check_daemon_takes_conf(flashckptd, conf):
    """Runs the real flashckptd on the ConfigMap's file with its paths moved to a temporary folder."""
    tmp = tempfile.mkdtemp(prefix="fcdeploy", dir="/tmp")
    moved = dict(conf)
    moved["socket"] = os.path.join(tmp, "run", os.path.basename(conf["socket"]))
    moved["root"] = os.path.join(tmp, "root")
    moved["listen"] = "127.0.0.1:0"  # the port the kubelet would probe may be taken here
    if "state-dir" in moved:
        moved["state-dir"] = os.path.join(tmp, "state")
    path = os.path.join(tmp, "flashckptd.conf")
    with open(path, "w") as f:
        f.write("".join("%s = %s\n" % kv for kv in moved.items()))
    log_path = os.path.join(tmp, "flashckptd.log")
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([flashckptd, "--config", path], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(moved["socket"]):
            check(proc.poll() is None, "flashckptd --config exited %s:\n%s" % (proc.returncode, open(log_path).read()))
            check(time.monotonic() < deadline, "flashckptd did not create %s" % moved["socket"])
            time.sleep(0.05)
        while "listening tcp=" not in open(log_path).read():
            check(time.monotonic() < deadline, "flashckptd did not open its TCP listener")
            time.sleep(0.05)
        text = open(log_path).read()
        budget = parse_size(conf["max-host-memory"]) / 2**30
        check("max_host_memory=%.1f GiB" % budget in text, "the daemon did not take max-host-memory:\n%s" % text)
        check("slots=%s " % conf.get("slots", "2") in text, "the daemon did not take slots:\n%s" % text)
        check("keep=%s " % conf.get("keep", "0") in text, "the daemon did not take keep:\n%s" % text)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        check(rc == 0, "flashckptd exited %d on SIGTERM:\n%s" % (rc, open(log_path).read()))
        print("flashckptd started from the ConfigMap's file (paths moved to %s) and stopped cleanly" % tmp)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["rm", "-rf", tmp])


def check_containerfile(pod_uid):
    path = os.path.join(REPO, "deploy", "container", "Containerfile")
    with open(path) as f:
        text = f.read().replace("\\\n", " ")
    with open(os.path.join(REPO, "scripts", "deps.sh")) as f:
        deps = f.read()
    array = re.search(r"PACKAGES=\((.*?)\n\)", deps, re.S).group(1)
    known = set(re.sub(r"#.*", "", array).split())
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    check(len(stages) >= 2 and stages[0].startswith("debian:bookworm"), "not a multi-stage build from debian:bookworm")
    build = stages[0]
    installed = set()
    for m in re.finditer(r"apt-get install ([^&]*)", build):
        installed |= {w for w in m.group(1).split() if not w.startswith("-")}
    check(installed and installed <= known, "the build stage installs packages not in scripts/deps.sh: %s"
          % sorted(installed - known))
    check("-DFLASHCKPT_BUILD_TESTS=OFF" in build, "the build stage does not turn the tests off")
    runtime = stages[-1]
    user = re.search(r"^USER (\d+)", runtime, re.M)
    check(user and int(user.group(1)) != 0, "the runtime stage does not switch to a numeric non-root USER")
    check(int(user.group(1)) == pod_uid, "the image's USER %s is not the pod's runAsUser %s"
          % (user.group(1), pod_uid))
    entry = re.search(r"^ENTRYPOINT (.*)$", runtime, re.M)
    check(entry and "flashckptd" in entry.group(1), "the ENTRYPOINT is not flashckptd")
    print("Containerfile: %d build packages from scripts/deps.sh, tests off, USER %s, ENTRYPOINT %s"
          % (len(installed), user.group(1), entry.group(1)))


def check_daemonset(ds, docs, conf, flags):
    spec = ds["spec"]["template"]["spec"]
    containers = [c for c in spec["containers"] if "flashckptd" in c["name"]]
    check(len(containers) == 1, "DaemonSet %s has no flashckptd container" % ds["metadata"]["name"])
    c = containers[0]
    args = c.get("args", [])
    check(args[:2] == ["--config", CONFIG_DIR + "/flashckptd.conf"], "the DaemonSet's daemon is not started with "
          "--config %s/flashckptd.conf: %s" % (CONFIG_DIR, args))
    check("--node-name" in args and args[args.index("--node-name") + 1] == "$(NODE_NAME)",
          "the DaemonSet's daemon does not take --node-name $(NODE_NAME): %s" % args)
    env = {e["name"]: e for e in c.get("env", [])}
    check(env.get("NODE_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName",
          "NODE_NAME does not come from spec.nodeName")
    check(all(a[2:] in flags | {"config"} for a in args if a.startswith("--")),
          "the DaemonSet passes unknown flags: %s" % args)
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    by_path = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
    check(by_path.get("/dev/shm", {}).get("hostPath", {}).get("path") == "/dev/shm",
          "the DaemonSet does not mount the host's /dev/shm at /dev/shm")
    run_dir = os.path.dirname(conf["socket"])
    check("hostPath" in by_path.get(run_dir, {}), "the socket's directory %s is not a host directory" % run_dir)
    claim = by_path.get(conf["root"], {}).get("persistentVolumeClaim", {}).get("claimName")
    pvcs = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "PersistentVolumeClaim"}
    check(claim in pvcs and "ReadWriteMany" in pvcs[claim]["spec"]["accessModes"],
          "the root %s is not a ReadWriteMany PVC of deploy/k8s" % conf["root"])
    uid = security(spec, c, "runAsUser")
    check(uid and uid != 0 and security(spec, c, "runAsNonRoot"), "the DaemonSet's daemon may run as root")
    print("DaemonSet %s: --node-name from spec.nodeName, host /dev/shm and %s, root %s on RWX claim %s, uid %s"
          % (ds["metadata"]["name"], run_dir, conf["root"], claim, uid))


def check_slurm_scripts(bin_dir):
    scripts = os.path.join(REPO, "deploy", "slurm")
    for name in ("prolog.sh", "epilog.sh"):
        p = subprocess.run(["bash", "-n", os.path.join(scripts, name)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
        check(p.returncode == 0, "bash -n deploy/slurm/%s: %s" % (name, p.stdout.decode()))
    if os.geteuid() != 0 or subprocess.run(["which", "runuser"], stdout=subprocess.DEVNULL).returncode != 0:
        print("deploy/slurm: syntax checked; not run (needs root and runuser, as a Slurm prolog has)")
        return
    job = "fcdeploy%d" % os.getpid()
    run_dir = "/run/flashckpt/" + job
    made_parent = not os.path.exists("/run/flashckpt")
    root = tempfile.mkdtemp(prefix="fcslurm", dir="/tmp")
    env = dict(os.environ, SLURM_JOB_ID=job, SLURM_JOB_USER="root", FLASHCKPT_ROOT=root,
               FLASHCKPTD=os.path.join(bin_dir, "flashckptd"), FLASHCKPT_MAX_HOST_MEMORY="256MiB")
    try:
        p = subprocess.run(["bash", os.path.join(scripts, "prolog.sh")], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=60)
        log = os.path.join(run_dir, "flashckptd.log")
        check(p.returncode == 0, "prolog.sh exited %d: %s\n%s" % (p.returncode, p.stdout.decode(),
                                                                  open(log).read() if os.path.exists(log) else ""))
        sock = os.path.join(run_dir, "flashckptd.sock")
        out = subprocess.run([os.path.join(bin_dir, "flashckpt"), "--socket", sock, "status", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
        check(out.returncode == 0, "flashckpt status after the prolog: %s" % out.stdout.decode())
        status = __import__("json").loads(out.stdout.decode())
        host = subprocess.run(["hostname", "-s"], stdout=subprocess.PIPE).stdout.decode().strip()
        check(status["node_name"] == host and status["root"] == root,
              "the prolog's daemon: node %r root %r, expected %r %r" % (status["node_name"], status["root"], host, root))
        pid = int(open(os.path.join(run_dir, "flashckptd.pid")).read())
        p = subprocess.run(["bash", os.path.join(scripts, "epilog.sh")], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=300)
        check(p.returncode == 0, "epilog.sh exited %d: %s" % (p.returncode, p.stdout.decode()))
        check(not os.path.exists(run_dir), "the epilog left %s" % run_dir)
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        check(not alive, "the daemon (pid %d) still runs after the epilog" % pid)
        print("deploy/slurm: the prolog started flashckptd (node %s, root %s); the epilog stopped it" % (host, root))
    finally:
        subprocess.run(["bash", os.path.join(scripts, "epilog.sh")], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=300)
        subprocess.run(["rm", "-rf", root])
        if made_parent:
            try:
                os.rmdir("/run/flashckpt")
            except OSError:
                pass  # something else uses it now


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True)
    args = ap.parse_args()
    bin_dir = os.path.abspath(args.bin_dir)
    flashckptd = os.path.join(bin_dir, "flashckptd")
    try:
        check(os.access(flashckptd, os.X_OK), "%s is missing (build first)" % flashckptd)
        flags = daemon_flags(flashckptd)
        docs = load_documents()
        maps = {d["metadata"]["name"]: d for d in one(docs, "ConfigMap") if "flashckptd.conf" in d.get("data", {})}
        with open(os.path.join(REPO, "deploy", "flashckptd.conf.example")) as f:
            check_conf_keys(parse_conf(f.read()), flags, "deploy/flashckptd.conf.example")

        def mounted_conf(pod_spec, what):
            names = {v["configMap"]["name"] for v in pod_spec.get("volumes", []) if "configMap" in v} & set(maps)
            check(len(names) == 1, "%s does not mount one ConfigMap with flashckptd.conf" % what)
            conf = parse_conf(maps[names.pop()]["data"]["flashckptd.conf"])
            check_conf_keys(conf, flags, "the ConfigMap of %s" % what)
            return conf

        uid = None
        for pod in one(docs, "Pod"):
            conf = mounted_conf(pod["spec"], "pod " + pod["metadata"]["name"])
            uid = check_pod(pod, docs, conf)
            check_daemon_takes_conf(flashckptd, conf)
        for ds in one(docs, "DaemonSet"):
            conf = mounted_conf(ds["spec"]["template"]["spec"], "DaemonSet " + ds["metadata"]["name"])
            check_daemonset(ds, docs, conf, flags)
            check_daemon_takes_conf(flashckptd, conf)
        check_containerfile(uid)
        check_slurm_scripts(bin_dir)
    except TestFailure as e:
        print("FAILED: %s" % e, flush=True)
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
