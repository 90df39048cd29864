"""The path audit of tests/support/ray_cluster.py, loaded by every Python process of a test
cluster's nodes (this directory is first on their PYTHONPATH): an audit hook that records any
access to a path under the roots in ``MSI_AUDIT_FORBIDDEN`` (os.pathsep-separated) into the
node's log ``MSI_AUDIT_LOG``, one line per access: ``pid event path``.

Audited: every event below whose arguments name a path (str, bytes or os.PathLike; a file
descriptor names none). Not audited: C code that opens files itself (no Python event).
Nothing is refused: the test reads the log and asserts it is empty.
"""

import os
import sys
import threading


def _install():
    roots = [r for r in os.environ.get("MSI_AUDIT_FORBIDDEN", "").split(os.pathsep) if r]
    log_path = os.environ.get("MSI_AUDIT_LOG")
    if not roots or not log_path:
        return
    roots = tuple(os.path.join(r, "") for r in roots)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    events = {"open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.listdir", "os.scandir", "os.chmod",
              "os.chown", "os.truncate", "os.link", "os.symlink", "os.utime", "os.chdir", "os.removexattr",
              "os.setxattr", "os.walk", "os.fwalk", "glob.glob", "glob.glob/2", "shutil.copyfile",
              "shutil.copymode", "shutil.copystat", "shutil.copytree", "shutil.move", "shutil.rmtree",
              "shutil.chown", "shutil.make_archive", "shutil.unpack_archive", "tempfile.mkstemp",
              "tempfile.mkdtemp", "os.exec", "os.posix_spawn", "subprocess.Popen"}
    local = threading.local()
    pid = os.getpid()
    fspath, abspath = os.fspath, os.path.abspath

    def paths(args):
        for a in args:
            if isinstance(a, (str, bytes, os.PathLike)):
                try:
                    p = fspath(a)
                    if isinstance(p, bytes):
                        p = p.decode("utf-8", "surrogateescape")
                    yield abspath(p)
                except Exception:  # noqa: BLE001 - an odd argument is not a path
                    continue
            elif isinstance(a, (list, tuple)):
                yield from paths(a)

    def hook(event, args):
        if event not in events or getattr(local, "busy", False):
            return
        local.busy = True
        try:
            for p in paths(args):
                if os.path.join(p, "").startswith(roots):
                    os.write(fd, f"{pid} {event} {p}\n".encode("utf-8", "surrogateescape"))
        finally:
            local.busy = False

    sys.addaudithook(hook)


_install()


# --------------------------------------------------------------------------- the hold (fault injection)
#
# With MSI_HOLD_DIR set (every node of a test cluster), a tokenize unit that has finished in a
# Ray task (``run_unit`` returned: its artifacts and receipt committed wherever the run keeps
# them, the receipt not yet returned to the driver) waits while the file <MSI_HOLD_DIR>/hold
# names this node (a line "<node>" or "*"), after creating <MSI_HOLD_DIR>/held-<node>-<unit>-<pid>;
# the file <MSI_HOLD_DIR>/release (or 300 s) ends the wait. A test can then kill a node or the
# driver while units are known to be in flight, however loaded the machine. Without the file
# "hold" nothing changes. The Ray engine's module is patched when a worker first imports it
# (an import hook: nothing of the package is imported here).

_ENGINE = "megatron_sft_idx.preprocess.engines.ray"


def _held(node, control):
    import time

    def wrap(real):
        def run_unit(step, unit):
            receipt = real(step, unit)
            if getattr(step, "name", None) != "tokenize":
                return receipt
            try:
                with open(os.path.join(control, "hold")) as f:
                    names = f.read().split()
            except OSError:
                return receipt
            if node in names or "*" in names:
                open(os.path.join(control, f"held-{node}-{unit}-{os.getpid()}"), "w").close()
                end = time.monotonic() + 300
                while not os.path.exists(os.path.join(control, "release")) and time.monotonic() < end:
                    time.sleep(0.02)
            return receipt
        return run_unit
    return wrap


class _HoldFinder:
    def __init__(self, node, control):
        self.node, self.control = node, control

    def find_spec(self, name, path=None, target=None):
        if name != _ENGINE:
            return None
        import importlib.machinery

        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, wrap = spec.loader, _held(self.node, self.control)
        real_exec = loader.exec_module

        def exec_module(module):
            real_exec(module)
            module.run_unit = wrap(module.run_unit)   # what _ray_unit calls

        loader.exec_module = exec_module
        return spec


def _install_hold():
    control = os.environ.get("MSI_HOLD_DIR")
    node = os.environ.get("MSI_RAY_CLUSTER", "::").split(":")[-1]
    if control:
        sys.meta_path.insert(0, _HoldFinder(node, control))


_install_hold()
