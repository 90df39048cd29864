"""A REAL multi-node Ray cluster on this one machine, with nothing listening beyond loopback.

``RayCluster`` starts a head and ``workers`` worker nodes (``ray start --head --block`` /
``ray start --address --block``), 1 CPU each, every node with its own directory: its HOME,
TMPDIR, RAY_TMPDIR, Ray's ``--temp-dir`` (its session, its logs), its working directory. All of
them -- and every driver a test starts with :meth:`RayCluster.popen` / :meth:`RayCluster.run` --
live in a private network namespace whose only interface is ``lo`` (``unshare --net``, held by a
small process; the others join it with ``nsenter --net``): Ray's agents bind the node's address
however it is asked, and in that namespace the only address there is is loopback.
:meth:`RayCluster.verify_loopback` checks it: every process of the cluster is in the namespace,
the namespace has no interface but ``lo``, and every listening socket in it is on 127.0.0.1/::1.

What is outside (the ``s3`` fixture's server on the host's 127.0.0.1) is reached through
:meth:`RayCluster.bridge`: a listener on the namespace's 127.0.0.1 (the socket made by a thread
that entered the namespace for that one call) forwarding to a host port, counting the bytes
each way -- one bridge per node and one for the driver, so the S3 bytes each node read and
wrote are known (:meth:`RayCluster.s3_bytes`).

Every process of a cluster carries ``MSI_RAY_CLUSTER=<owner pid>:<cluster id>:<node>`` in its
environment (Ray passes the raylet's environment to its workers and agents), which is how a node
is killed whole (:meth:`RayCluster.kill_node`: its raylet, agents and workers, SIGKILL), how a
clean stop is made sure of, and how the leftovers of a killed test session (whose owner pid is
gone) are found and killed before a new cluster starts. Every wait has a deadline.

The path audit (``tests/support/audit_site/sitecustomize.py``, on every node's PYTHONPATH):
every Python process of a node records any ``open``, ``mkdir``, ``rename``, ``remove``, ... of a
path under the cluster's forbidden roots (``forbidden=``: the driver's directories, the user's
local paths) into its node's ``audit.log``; :meth:`RayCluster.audit` reads what was logged
since a mark.

Which node ran a task: Ray's worker writes ``:task_name:<name>`` into its log in the session
directory of its node when it starts a task; each node has its own, so
:meth:`RayCluster.task_nodes` counts a task's runs per node from them.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Dict, Iterable, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUDIT_SITE = os.path.join(ROOT, "tests", "support", "audit_site")
MARK = "MSI_RAY_CLUSTER"
AUDIT_ROOTS_ENV = "MSI_AUDIT_FORBIDDEN"
AUDIT_LOG_ENV = "MSI_AUDIT_LOG"
GCS_PORT = 6379
#: The Ray task every unit of every step runs as (engines/ray.py): what :meth:`RayCluster.task_nodes` counts.
UNIT_TASK = "_ray_unit"
#: The ``ray`` command next to this interpreter (a pyenv shim would look for its root under HOME,
#: which every node has its own of).
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
#: Deadlines (seconds): a node up, the whole cluster up, a clean stop.
NODE_DEADLINE, CLUSTER_DEADLINE, STOP_DEADLINE = 90.0, 120.0, 30.0
_CLONE_NEWNET = 0x40000000
#: Fast detection of a dead node: the GCS health-checks raylets every 500 ms, 3 misses = dead.
_HEAD_ENV = {"RAY_health_check_initial_delay_ms": "500", "RAY_health_check_period_ms": "500",
             "RAY_health_check_timeout_ms": "500", "RAY_health_check_failure_threshold": "3"}


class ClusterError(RuntimeError):
    """The test cluster could not be started, verified or stopped (the message says which node)."""


# --------------------------------------------------------------------------- processes by marker


def _environ(pid: int) -> Dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def marked_processes() -> Dict[int, str]:
    """{pid: marker} of every live process carrying an ``MSI_RAY_CLUSTER`` marker."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            value = _environ(int(name)).get(MARK)
            if value:
                found[int(name)] = value
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_all(pids: Iterable[int], sig=signal.SIGKILL, deadline: float = 10.0) -> List[int]:
    """Send ``sig`` to ``pids``; wait (with a deadline) until they are gone; the survivors."""
    pids = list(pids)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        pids = [p for p in pids if _alive(p)]
        if not pids:
            break
        time.sleep(0.05)
    return pids


def kill_leftovers() -> List[int]:
    """Kill (SIGKILL) the processes of clusters whose owner process is gone (a killed test
    session's); the pids killed. Clusters of live owners (another xdist worker) are left alone."""
    dead = [pid for pid, value in marked_processes().items() if not _alive(int(value.split(":", 1)[0]))]
    _kill_all(dead)
    return dead


def _set_pdeathsig():  # preexec_fn: die with the test process, even if it is SIGKILLed
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# --------------------------------------------------------------------------- the namespace

_HOLDER = ("import subprocess, sys\n"
           "subprocess.run(['ip', 'link', 'set', 'lo', 'up'], check=True, timeout=30)\n"
           "print('ready', flush=True)\n"
           "sys.stdin.read()\n")


class Namespace:
    """A private network namespace with only ``lo`` (up), held by a process that exits when
    its stdin closes (the owner stopped or died)."""

    def __init__(self) -> None:
        self.holder = subprocess.Popen(["unshare", "--net", sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, preexec_fn=_set_pdeathsig)
        line = _readline(self.holder.stdout, 30.0)
        if line.strip() != "ready":
            self.close()
            raise ClusterError(f"unshare --net failed (this needs root or CAP_SYS_ADMIN): {line!r}")
        self.path = f"/proc/{self.holder.pid}/ns/net"
        self.inode = os.stat(self.path).st_ino

    def argv(self, cmd: Sequence[str]) -> List[str]:
        return ["nsenter", f"--net={self.path}", "--", *cmd]

    def contains(self, pid: int) -> bool:
        try:
            return os.stat(f"/proc/{pid}/ns/net").st_ino == self.inode
        except OSError:
            return False

    def interfaces(self) -> List[str]:
        with open(f"/proc/{self.holder.pid}/net/dev") as f:
            return [line.split(":", 1)[0].strip() for line in f.readlines()[2:]]

    def listeners(self) -> List[tuple]:
        """(address, port) of every listening TCP socket in the namespace (v4 and v6)."""
        out = []
        for name, v6 in (("tcp", False), ("tcp6", True)):
            with open(f"/proc/{self.holder.pid}/net/{name}") as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] != "0A":   # LISTEN
                        continue
                    addr, port = fields[1].split(":")
                    out.append((_decode_addr(addr, v6), int(port, 16)))
        return out

    def socket_in(self, factory):
        """``factory()`` called in a thread that has entered the namespace: a socket made there
        stays in the namespace (the rest of this process is untouched)."""
        result = {}

        def enter():
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(self.path, os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    result["error"] = OSError(ctypes.get_errno(), "setns")
                    return
                result["value"] = factory()
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                result["error"] = exc
            finally:
                os.close(fd)
            # this thread ends here: its namespace goes with it

        t = threading.Thread(target=enter, daemon=True)
        t.start()
        t.join(30.0)
        if "error" in result or "value" not in result:
            raise ClusterError(f"could not make a socket in the namespace: {result.get('error', 'timed out')}")
        return result["value"]

    def close(self) -> None:
        if self.holder.poll() is None:
            try:
                self.holder.stdin.close()
            except OSError:
                pass
            try:
                self.holder.wait(10)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait(10)


def _decode_addr(hexaddr: str, v6: bool) -> str:
    raw = bytes.fromhex(hexaddr)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def _readline(stream, deadline: float) -> str:
    box = []
    t = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    t.start()
    t.join(deadline)
    return box[0] if box else ""


# --------------------------------------------------------------------------- a counting bridge


class Bridge:
    """127.0.0.1:<port> inside the namespace → 127.0.0.1:<target> outside; counts bytes
    ``up`` (sent by the namespace side: written to S3) and ``down`` (received: read from S3)."""

    def __init__(self, ns: Namespace, target_port: int, name: str) -> None:
        def listener():
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            s.listen(64)
            return s

        self.name, self.target = name, target_port
        self.sock = ns.socket_in(listener)
        self.port = self.sock.getsockname()[1]
        self.up = self.down = 0
        self.connections = 0
        self.requests: List[tuple] = []   # (method, path, body bytes, copy source or "")
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"bridge-{name}").start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                inner, _ = self.sock.accept()
            except OSError:
                return
            try:
                outer = socket.create_connection(("127.0.0.1", self.target), timeout=30)
                outer.settimeout(None)
            except OSError:
                inner.close()
                continue
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._pump, args=(inner, outer, "up", _RequestLog(self)), daemon=True).start()
            threading.Thread(target=self._pump, args=(outer, inner, "down"), daemon=True).start()

    def _pump(self, src, dst, direction: str, log=None) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if log is not None:
                    log.feed(data)
                dst.sendall(data)
                with self._lock:
                    setattr(self, direction, getattr(self, direction) + len(data))
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def reset(self) -> None:
        with self._lock:
            self.up = self.down = self.connections = 0
            self.requests = []

    def counts(self) -> dict:
        with self._lock:
            return {"read": self.down, "written": self.up, "connections": self.connections}

    def close(self) -> None:
        self._closed = True
        self.sock.close()


class _RequestLog:
    """The HTTP/1.1 requests of one connection's upstream bytes: request line and headers, then
    a body of Content-Length bytes (a body without one -- chunked -- ends the parsing of that
    connection: it is then logged as ``("?", "", 0, "")``)."""

    def __init__(self, bridge: Bridge) -> None:
        self.bridge, self.buf, self.skip, self.lost = bridge, b"", 0, False

    def feed(self, data: bytes) -> None:
        if self.lost:
            return
        self.buf += data
        while True:
            if self.skip:
                take = min(self.skip, len(self.buf))
                self.buf, self.skip = self.buf[take:], self.skip - take
                if self.skip:
                    return
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head, self.buf = self.buf[:end].decode("latin-1"), self.buf[end + 4:]
            lines = head.split("\r\n")
            method, _, rest = lines[0].partition(" ")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            if "content-length" not in headers and headers.get("transfer-encoding"):
                self.lost = True
                with self.bridge._lock:
                    self.bridge.requests.append(("?", "", 0, ""))
                return
            self.skip = int(headers.get("content-length", "0") or 0)
            with self.bridge._lock:
                self.bridge.requests.append((method, rest.rsplit(" ", 1)[0], self.skip,
                                             headers.get("x-amz-copy-source", "")))


# --------------------------------------------------------------------------- the cluster


class RayCluster:
    """A head and ``workers`` worker nodes in a private loopback-only namespace (module docstring).

    ``env``: added to every node's environment (e.g. ``s3_env`` of the ``s3`` fixture: its
    ``AWS_ENDPOINT_URL`` is replaced by the node's own bridge). ``forbidden``: the roots no
    task may touch (the path audit). The driver's own directories are ``self.driver_dir``.
    """

    def __init__(self, root: str, workers: int = 2, env: Optional[dict] = None, forbidden: Sequence[str] = (),
                 object_store_bytes: int = 80 << 20) -> None:
        self.root = os.path.abspath(root)
        self.id = uuid.uuid4().hex[:8]
        self.names = ["head"] + [f"worker{i}" for i in range(1, workers + 1)]
        self.extra_env = dict(env or {})
        self.driver_dir = os.path.join(self.root, "driver")
        self.control_dir = os.path.join(self.root, "control")
        base = os.environ.get("MEGATRON_SFT_IDX_TEST_ROOT") or tempfile.gettempdir()
        self.short_dir = tempfile.mkdtemp(prefix="rc", dir=base if len(base) <= 40 else "/tmp")
        os.makedirs(self.control_dir, exist_ok=True)
        self.forbidden = [os.path.realpath(p) for p in [self.driver_dir, *forbidden]]
        self.object_store_bytes = object_store_bytes
        self.address = f"127.0.0.1:{GCS_PORT}"
        self.procs: Dict[str, subprocess.Popen] = {}
        self.bridges: Dict[str, Bridge] = {}
        self.ns: Optional[Namespace] = None

    # -- directories and environments

    def node_dir(self, name: str) -> str:
        return os.path.join(self.root, "nodes", name)

    def ray_dir(self, name: str) -> str:
        """Ray's ``--temp-dir`` of node ``name`` (its session, sockets and logs): short, since a
        socket path in it must fit AF_UNIX's 107 bytes."""
        return os.path.join(self.short_dir, name)

    def _dirs(self, base: str) -> dict:
        home, tmp = os.path.join(base, "home"), os.path.join(base, "tmp")
        for d in (home, tmp):
            os.makedirs(d, exist_ok=True)
        return {"HOME": home, "TMPDIR": tmp, "RAY_TMPDIR": tmp, "XDG_CACHE_HOME": os.path.join(home, ".cache"),
                "XDG_CONFIG_HOME": os.path.join(home, ".config"), "MPLCONFIGDIR": os.path.join(home, ".mpl")}

    def _base_env(self) -> dict:
        keep = ("PATH", "LANG", "LC_ALL", "TZ", "NUMBA_CACHE_DIR", "MEGATRON_SFT_IDX_CRC")
        env = {k: os.environ[k] for k in keep if k in os.environ}
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", os.defpath)])
        env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
        return env

    def node_env(self, name: str) -> dict:
        env = self._base_env()
        env.update(self.extra_env)
        env.update(self._dirs(self.node_dir(name)))
        env["PYTHONPATH"] = os.pathsep.join([AUDIT_SITE, ROOT])
        env[AUDIT_ROOTS_ENV] = os.pathsep.join(self.forbidden)
        env[AUDIT_LOG_ENV] = os.path.join(self.node_dir(name), "audit.log")
        env[MARK] = f"{os.getpid()}:{self.id}:{name}"
        env["MSI_HOLD_DIR"] = self.control_dir
        if name in self.bridges:
            env["AWS_ENDPOINT_URL"] = self.bridges[name].endpoint
        if name == "head":
            env.update(_HEAD_ENV)
        return env

    def driver_env(self, extra: Optional[dict] = None) -> dict:
        """The environment of a driver: its own HOME/TMPDIR (under ``driver_dir``, forbidden to
        tasks), the repository on PYTHONPATH, RAY_ADDRESS, the S3 env through its own bridge."""
        env = self._base_env()
        env.update(self.extra_env)
        env.update(self._dirs(self.driver_dir))
        env.update(PYTHONPATH=ROOT, RAY_ADDRESS=self.address)
        env[MARK] = f"{os.getpid()}:{self.id}:driver"
        if "driver" in self.bridges:
            env["AWS_ENDPOINT_URL"] = self.bridges["driver"].endpoint
        env.update(extra or {})
        return env

    # -- start / stop

    def start(self) -> "RayCluster":
        kill_leftovers()
        self.ns = Namespace()
        try:
            target = self.extra_env.get("AWS_ENDPOINT_URL")
            if target:
                port = int(target.rsplit(":", 1)[1].split("/")[0])
                for name in self.names + ["driver"]:
                    self.bridges[name] = Bridge(self.ns, port, name)
            for i, name in enumerate(self.names):
                self._start_node(i, name)
            self.wait_nodes(len(self.names), CLUSTER_DEADLINE)
            self.verify_loopback()
        except BaseException:
            self.stop()
            raise
        return self

    def restart_node(self, name: str) -> None:
        """Start worker node ``name`` again (after :meth:`kill_node`) and wait for it to join."""
        self._start_node(self.names.index(name), name)
        self.wait_nodes(len(self.names), CLUSTER_DEADLINE)

    def _node_argv(self, i: int, name: str) -> List[str]:
        base = 20000 + 2000 * i
        argv = [RAY, "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                f"--temp-dir={self.ray_dir(name)}",
                f"--object-store-memory={self.object_store_bytes}",
                f"--node-manager-port={base + 1}", f"--object-manager-port={base + 2}",
                f"--metrics-export-port={base + 3}", f"--dashboard-agent-listen-port={base + 4}",
                f"--dashboard-agent-grpc-port={base + 5}", f"--runtime-env-agent-port={base + 6}",
                f"--min-worker-port={base + 100}", f"--max-worker-port={base + 1999}"]
        if name == "head":
            argv += ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
        else:
            argv += [f"--address={self.address}"]
        return argv

    def _start_node(self, i: int, name: str, attempts: int = 2) -> None:
        """Start node ``name`` and wait (deadline) for ``ray start`` to say it is up. Ray gives a
        raylet 30 s to register with the GCS (fixed in ray/_private/node.py); on a loaded machine
        it can miss that, so a node that fails to start is cleared (SIGKILL) and started again."""
        d = self.node_dir(name)
        os.makedirs(d, exist_ok=True)
        for attempt in range(1, attempts + 1):
            log = open(os.path.join(d, "ray-start.log"), "w")
            self.procs[name] = subprocess.Popen(self.ns.argv(self._node_argv(i, name)), env=self.node_env(name),
                                                cwd=d, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True, preexec_fn=_set_pdeathsig)
            log.close()
            end = time.monotonic() + NODE_DEADLINE
            while time.monotonic() < end:
                if "Ray runtime started" in self.start_log(name):
                    return
                if self.procs[name].poll() is not None:
                    break
                time.sleep(0.2)
            text = self.start_log(name)
            with open(os.path.join(d, f"ray-start.failed-{attempt}.log"), "w") as f:
                f.write(text)
            _kill_all(self.processes(name))
            self.procs.pop(name).wait(10)
        raise ClusterError(f"Ray node {name} did not start in {attempts} attempts of {NODE_DEADLINE:.0f} s; "
                           f"the last log:\n{text[-3000:]}")

    def start_log(self, name: str) -> str:
        try:
            with open(os.path.join(self.node_dir(name), "ray-start.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def wait_nodes(self, alive: int, deadline: float) -> None:
        """Wait until the GCS counts exactly ``alive`` live nodes (a driver script in the namespace)."""
        code = ("import ray, sys, time\n"
                "ray.init(address=sys.argv[1], logging_level='ERROR')\n"
                "end = time.monotonic() + float(sys.argv[3])\n"
                "while time.monotonic() < end:\n"
                "    n = sum(1 for x in ray.nodes() if x['Alive'])\n"
                "    if n == int(sys.argv[2]): print(n); sys.exit(0)\n"
                "    time.sleep(0.3)\n"
                "print(n); sys.exit(3)\n")
        proc = self.run([sys.executable, "-c", code, self.address, str(alive), str(deadline)], timeout=deadline + 60)
        if proc.returncode != 0:
            raise ClusterError(f"the cluster did not reach {alive} live nodes within {deadline:.0f} s: "
                               f"{proc.stdout.strip()} {proc.stderr[-2000:]}")

    def processes(self, name: Optional[str] = None) -> List[int]:
        """The live pids of this cluster (of one node, or the driver, when ``name`` is given)."""
        prefix = f"{os.getpid()}:{self.id}:"
        return sorted(pid for pid, v in marked_processes().items()
                      if v.startswith(prefix) and (name is None or v == prefix + name))

    def kill_node(self, name: str) -> List[int]:
        """SIGKILL every process of worker node ``name`` (``ray start``, raylet, agents, workers)
        at once, as a machine that loses power; the pids killed."""
        if name == "head":
            raise ValueError("kill a worker node; the head holds the GCS")
        pids = self.processes(name)
        left = _kill_all(pids)
        if left:
            raise ClusterError(f"node {name}: processes {left} survived SIGKILL")
        self.procs.pop(name, None)
        return pids

    def stop(self) -> None:
        """SIGTERM every ``ray start --block`` (each stops its node's processes), then SIGKILL
        whatever of the cluster is left after the deadline; then the namespace and bridges."""
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + STOP_DEADLINE
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while self.processes() and time.monotonic() < end:
            time.sleep(0.2)
        left = _kill_all(self.processes())
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        self.procs.clear()
        for bridge in self.bridges.values():
            bridge.close()
        if self.ns is not None:
            self.ns.close()
            self.ns = None
        shutil.rmtree(self.short_dir, ignore_errors=True)
        if left:
            raise ClusterError(f"processes {left} of the cluster survived SIGKILL")

    def __enter__(self) -> "RayCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- running things in the namespace

    def popen(self, cmd: Sequence[str], env: Optional[dict] = None, **kw) -> subprocess.Popen:
        """``cmd`` in the namespace as a driver (``driver_env`` unless ``env``), own session."""
        kw.setdefault("cwd", self.driver_dir)
        return subprocess.Popen(self.ns.argv(cmd), env=env or self.driver_env(), start_new_session=True,
                                preexec_fn=_set_pdeathsig, **kw)

    def run(self, cmd: Sequence[str], env: Optional[dict] = None, timeout: float = 300.0,
            **kw) -> subprocess.CompletedProcess:
        """``cmd`` in the namespace to completion (text output captured); killed at the deadline."""
        proc = self.popen(cmd, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=30)
            raise ClusterError(f"{cmd[:3]} did not finish within {timeout:.0f} s:\n{err[-3000:]}") from None
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    # -- holding tokenize units (tests/support/audit_site/sitecustomize.py)

    def hold(self, *nodes: str) -> None:
        """From now on, a tokenize unit finished on one of ``nodes`` ("*": any) waits, its part
        and receipt written, its receipt not returned, until :meth:`release`."""
        self.release(clear=True)
        with open(os.path.join(self.control_dir, "hold"), "w") as f:
            f.write("\n".join(nodes) + "\n")

    def held(self) -> List[tuple]:
        """(node, unit, pid) of every unit that has been held so far."""
        out = []
        for n in os.listdir(self.control_dir):
            if n.startswith("held-"):
                node, unit, pid = n[len("held-"):].rsplit("-", 2)
                out.append((node, int(unit), int(pid)))
        return sorted(out)

    def wait_held(self, count: int, deadline: float = 120.0, proc: Optional[subprocess.Popen] = None) -> List[tuple]:
        """Wait (deadline) until ``count`` units are held; fails if ``proc`` ends first."""
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            held = self.held()
            if len(held) >= count:
                return held
            if proc is not None and proc.poll() is not None:
                err = proc.stderr.read()[-3000:] if proc.stderr else ""
                raise ClusterError(f"the driver ended (exit {proc.returncode}) before {count} units were held: {err}")
            time.sleep(0.02)
        raise ClusterError(f"{count} units were not held within {deadline:.0f} s (held: {self.held()})")

    def release(self, clear: bool = False) -> None:
        """End every hold (and, ``clear``: forget the held markers, stop holding)."""
        ctl = self.control_dir
        if clear:
            for n in os.listdir(ctl):
                os.remove(os.path.join(ctl, n))
        else:
            open(os.path.join(ctl, "release"), "w").close()
            try:
                os.remove(os.path.join(ctl, "hold"))
            except FileNotFoundError:
                pass

    # -- what the cluster saw

    def verify_loopback(self) -> dict:
        """Every process of the cluster is in the namespace, the namespace's only interface is
        ``lo`` and everything listening in it is on loopback; what was checked (raises otherwise)."""
        pids = self.processes()
        outside = [p for p in pids if not self.ns.contains(p)]
        interfaces = self.ns.interfaces()
        listeners = self.ns.listeners()
        wide = [(a, p) for a, p in listeners if not _loopback(a)]
        if outside or interfaces != ["lo"] or wide or not listeners:
            raise ClusterError(f"not loopback-only: processes outside the namespace {outside}, interfaces "
                               f"{interfaces}, listening beyond loopback {wide} (of {len(listeners)})")
        return {"processes": len(pids), "interfaces": interfaces, "listeners": sorted(listeners)}

    def task_nodes(self, task: str) -> Dict[str, int]:
        """{node: how many times a task whose name contains ``task`` started there} (from the
        ``:task_name:`` lines Ray's workers log in their node's own session directory)."""
        counts = {}
        for name in self.names:
            logs = os.path.join(self.ray_dir(name), "session_latest", "logs")
            n = 0
            for entry in (os.listdir(logs) if os.path.isdir(logs) else ()):
                if entry.startswith("worker-") and entry.endswith(".out"):  # (.err repeats the line)
                    with open(os.path.join(logs, entry), errors="replace") as f:
                        n += sum(1 for line in f if line.startswith(":task_name:") and task in line)
            if n:
                counts[name] = n
        return counts

    def audit_mark(self) -> Dict[str, int]:
        """The current size of every node's audit log (pass to :meth:`audit`)."""
        return {n: _size(os.path.join(self.node_dir(n), "audit.log")) for n in self.names}

    def audit(self, since: Optional[Dict[str, int]] = None) -> Dict[str, List[str]]:
        """{node: the audit lines logged since ``since``}: accesses to a forbidden root."""
        out = {}
        for name in self.names:
            path = os.path.join(self.node_dir(name), "audit.log")
            start = (since or {}).get(name, 0)
            if _size(path) > start:
                with open(path, "rb") as f:
                    f.seek(start)
                    out[name] = f.read().decode(errors="replace").splitlines()
        return out

    def findings(self, since: Optional[Dict[str, int]] = None) -> Dict[str, List[str]]:
        """:meth:`audit` without the one access Ray itself makes of a driver path: Ray puts the
        driver's working directory on every worker's ``sys.path`` (``job_config.py_driver_sys_path``),
        so the import system lists it (``os.listdir`` of exactly that directory, nothing read from
        it; on a node without that directory the listing fails harmlessly). Anything else stays."""
        ray_listing = f"os.listdir {self.driver_dir}"
        out = {}
        for node, lines in self.audit(since).items():
            kept = [line for line in lines if line.split(" ", 1)[1] != ray_listing]
            if kept:
                out[node] = kept
        return out

    def s3_requests(self) -> Dict[str, List[tuple]]:
        """{node or "driver": [(method, path, body bytes, copy source)]} through each bridge so far."""
        out = {}
        for name, b in self.bridges.items():
            with b._lock:
                out[name] = list(b.requests)
        return out

    def s3_bytes(self) -> Dict[str, dict]:
        """{node or "driver": {"read", "written", "connections"}} through each bridge so far."""
        return {name: b.counts() for name, b in self.bridges.items()}


def finish(proc: subprocess.Popen, timeout: float = 300.0) -> tuple:
    """(returncode, stdout, stderr) of a driver started by :meth:`RayCluster.popen`; killed, failing, at the deadline."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        raise AssertionError(f"the driver did not finish within {timeout} s") from None
    return proc.returncode, out, err


#: Runs ``argv[2:]`` as its own child and writes that child's peak RSS (KiB) to ``argv[1]``. A
#: process's own ru_maxrss keeps the size its forking parent had before exec (Linux carries it
#: over), so a driver started straight from a pytest worker or a benchmark reports their size.
PEAK_LAUNCHER = ("import os, sys\n"
                 "pid = os.fork()\n"
                 "if pid == 0:\n"
                 "    os.execv(sys.argv[2], sys.argv[2:])\n"
                 "_, status, usage = os.wait4(pid, 0)\n"
                 "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
                 "sys.exit(os.waitstatus_to_exitcode(status) & 255)\n")


def with_peak(cmd: Sequence[str], path: str) -> List[str]:
    """``cmd`` (its first item a path) run by :data:`PEAK_LAUNCHER`, its peak RSS written to ``path``
    (:func:`peak_mib` reads it once the launcher has exited)."""
    return [sys.executable, "-c", PEAK_LAUNCHER, path, *cmd]


def peak_mib(path: str) -> float:
    with open(path) as f:
        return int(f.read()) / 1024


def _loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback (``::ffff:127.0.0.1``); never a wildcard."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
