"""A real Slurm cluster on this machine, for the ``slurm`` tests: one node, or several emulated
with network namespaces. Nothing is mocked: munged, slurmctld and slurmd run as on a cluster.

    python -m tests.slurm.cluster install            # Debian's slurm and munge (root, apt-get)
    python -m tests.slurm.cluster start DIR [--nodes 2]
    python -m tests.slurm.cluster stop DIR

Everything a cluster writes lives in DIR (config, state, logs, pid files). ``stop`` ends only the
daemons whose pid files are in DIR and removes the namespaces and bridge that ``start`` made.
See ../shared/notes/slurm-local.md and slurm-multinode.md for what this is based on.
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.ports import free_ports

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BRIDGE, SUBNET = "ldbr0", "10.251.0"
MUNGE_PID = Path("/run/munge/munged.pid")


def installed() -> bool:
    return all(shutil.which(p) for p in ("slurmctld", "slurmd", "sbatch", "munged"))


def install() -> str:
    """Install the packages if missing; returns why not when that is impossible here."""
    if installed():
        return ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "Slurm is not installed and installing it needs root and apt-get"
    # No systemd here: the packages' scripts must not try to start the daemons.
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = not policy.exists()
    if made_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
        if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                return f"apt-get install {' '.join(PACKAGES)} failed: {out.stderr[-500:]}"
    finally:
        if made_policy:
            policy.unlink()
    return ""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (this sandbox reaps exited daemons late: a zombie counts as dead)."""
    from lit_dist.runtime.processes import alive

    return alive(pid)


def _wait(check, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _start_munge() -> bool:
    """Start munged unless it runs; whether this call started it (then ``stop`` ends it too)."""
    if MUNGE_PID.exists() and _alive(int(MUNGE_PID.read_text().split()[0])):
        return False
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        subprocess.run(["mungekey", "--create", "--force"], check=True)
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
    MUNGE_PID.parent.mkdir(parents=True, exist_ok=True)
    shutil.chown(MUNGE_PID.parent, "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)
    _wait(lambda: Path("/run/munge/munge.socket.2").exists(), "munged")
    return True


def _node_hardware() -> str:
    """The node line's hardware fields from ``slurmd -C``, advertising 4 CPUs (more tasks than cores fit)."""
    line = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
    memory = max(1000, int(fields.get("RealMemory", 4000)) - 1000)
    return f"CPUs=4 Boards=1 SocketsPerBoard=1 CoresPerSocket=4 ThreadsPerCore=1 RealMemory={memory}"


def write_config(folder: Path, nodes: int, ctld_port: int, slurmd_port: int) -> Path:
    host = socket.gethostname().split(".")[0]
    hardware = _node_hardware()
    if nodes == 1:
        node_lines = f"NodeName={host} {hardware} State=UNKNOWN"
        node_names = host
    else:
        node_lines = "\n".join(f"NodeName=node{i} NodeAddr={SUBNET}.{10 + i} NodeHostname=node{i} {hardware} State=UNKNOWN"
                               for i in range(1, nodes + 1))
        node_names = f"node[1-{nodes}]"
    for sub in ("state", "spool", "log"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    # Several nodes reach the controller over the bridge; one node over the host's own name.
    controller = f"{host}({SUBNET}.1)" if nodes > 1 else host
    # cred_expire: a requeued job may start again once its old credential has expired (120 s by default;
    # started earlier, slurmd refuses it: "Job credential revoked").
    conf.write_text(f"""ClusterName=litdist
SlurmctldHost={controller}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MailProg=/bin/true
JobRequeue=1
MinJobAge=600
{node_lines}
PartitionName=debug Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
""")
    return conf


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def _make_nodes(folder: Path, nodes: int) -> None:
    """A bridge in this namespace and one network namespace per node, joined by veth pairs, no route out."""
    host = socket.gethostname().split(".")[0]
    hosts = folder / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + f"{SUBNET}.1 {host}\n"
                     + "".join(f"{SUBNET}.{10 + i} node{i}\n" for i in range(1, nodes + 1)))
    _remove_nodes(nodes)  # what a killed test session left: it never reached its teardown
    _sh("ip", "link", "add", BRIDGE, "type", "bridge")
    _sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
    _sh("ip", "link", "set", BRIDGE, "up")
    for i in range(1, nodes + 1):
        ns = f"ldnode{i}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", f"ldv{i}", "type", "veth", "peer", "name", f"ldv{i}p")
        _sh("ip", "link", "set", f"ldv{i}", "master", BRIDGE, "up")
        _sh("ip", "link", "set", f"ldv{i}p", "netns", ns)
        _sh("ip", "-n", ns, "link", "set", f"ldv{i}p", "name", "eth0")
        _sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{10 + i}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
    (folder / "nodes").write_text(str(nodes))


def node_command(folder: Path, node: int, command: str) -> list[str]:
    """Run ``command`` (a shell line) inside emulated node ``node``: its network, host name and /etc/hosts."""
    # nsenter, not `ip netns exec`: that remounts /sys, and slurmd then dies looking for cgroups.
    return ["nsenter", f"--net=/run/netns/ldnode{node}", "--", "unshare", "--uts", "--mount", "--propagation", "slave",
            "--", "sh", "-c", f"mount -n --bind {folder / 'hosts'} /etc/hosts && hostname node{node} && {command}"]


def start(folder: Path, nodes: int = 1) -> dict:
    """Start munged (if not running), slurmctld and one slurmd per node; returns the clients' environment."""
    folder.mkdir(parents=True, exist_ok=True)
    # Ports free now, not fixed ones: the one-node cluster's slurmd and every slurmctld listen in this
    # network namespace, where another session's cluster or anything else may hold a fixed port.
    conf = write_config(folder, nodes, *free_ports(2))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    if _start_munge():
        shutil.copy(MUNGE_PID, folder / "munged.pid")
    if nodes > 1:
        _make_nodes(folder, nodes)
    subprocess.run(["slurmctld", "-f", str(conf)], check=True, env=env)
    if nodes == 1:
        subprocess.run(["slurmd", "-f", str(conf)], check=True, env=env)
    else:
        for i in range(1, nodes + 1):
            subprocess.run(node_command(folder, i, f"exec slurmd -f {conf} -N node{i}"), check=True, env=env)

    def idle() -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env).stdout.split()
        return len(out) >= 1 and all(s == "idle" for s in out)

    _wait(idle, "the Slurm nodes to be idle", timeout_s=60)
    return env


def stop(folder: Path) -> None:
    """Stop the daemons whose pid files are in ``folder`` (munged only if ``start`` started it); remove
    the namespaces and bridge ``start`` made."""
    # The controller last: slurmd reports to it while stopping. munged only if this cluster started it.
    pid_files = sorted(folder.glob("slurmd*.pid")) + [folder / "slurmctld.pid", folder / "munged.pid"]
    for pid_file in pid_files:
        try:
            pid = int(pid_file.read_text().split()[0])
        except (ValueError, IndexError, FileNotFoundError):
            continue
        if _alive(pid):
            os.kill(pid, 15)
            try:
                _wait(lambda p=pid: not _alive(p), f"pid {pid} to exit", timeout_s=15)
            except RuntimeError:
                os.kill(pid, 9)
        pid_file.unlink(missing_ok=True)
    nodes_file = folder / "nodes"
    if nodes_file.exists():
        _remove_nodes(int(nodes_file.read_text()))
        nodes_file.unlink()


def _remove_nodes(nodes: int) -> None:
    """Remove the bridge and the nodes' namespaces and links, where they exist."""
    for i in range(1, nodes + 1):
        subprocess.run(["ip", "netns", "del", f"ldnode{i}"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"ldv{i}"], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["install", "start", "stop"])
    parser.add_argument("folder", nargs="?")
    parser.add_argument("--nodes", type=int, default=1)
    args = parser.parse_args()
    if args.action == "install":
        problem = install()
        print(problem or "slurm and munge are installed")
        sys.exit(1 if problem else 0)
    if args.action == "start":
        env = start(Path(args.folder).resolve(), args.nodes)
        print(f"export SLURM_CONF={env['SLURM_CONF']}")
    else:
        stop(Path(args.folder).resolve())


if __name__ == "__main__":
    main()
