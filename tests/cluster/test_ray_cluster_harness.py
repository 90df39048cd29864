"""The cluster harness's own parts that need no Ray (tests/support/ray_cluster.py and its audit
hook, tests/support/audit_site/sitecustomize.py): what the cluster tests rely on to fail when a
task touches a forbidden path, and to never hang on a killed session's leftovers."""

import os
import subprocess
import sys
import time

import pytest

from support.ray_cluster import AUDIT_LOG_ENV, AUDIT_ROOTS_ENV, AUDIT_SITE, MARK, kill_leftovers, marked_processes

pytestmark = [pytest.mark.subprocess]


def _audited(tmp_path, code, roots, log="audit.log"):
    log = tmp_path / log
    env = dict(os.environ, PYTHONPATH=AUDIT_SITE, **{AUDIT_ROOTS_ENV: os.pathsep.join(map(str, roots)),
                                                      AUDIT_LOG_ENV: str(log)})
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [line.split(" ", 2)[1:] for line in log.read_text().splitlines()] if log.exists() else []


def test_the_audit_hook_records_every_access_under_a_forbidden_root_and_nothing_else(tmp_path):
    forbidden, allowed = tmp_path / "driver", tmp_path / "node"
    forbidden.mkdir()
    allowed.mkdir()
    (forbidden / "in.txt").write_text("x")
    code = (f"import os, shutil, pathlib\n"
            f"f, a = {str(forbidden)!r}, {str(allowed)!r}\n"
            "open(os.path.join(a, 'ok'), 'w').write('fine')\n"
            "open(os.path.join(f, 'in.txt')).read()\n"
            "pathlib.Path(f, 'p').write_bytes(b'y')\n"
            "os.mkdir(os.path.join(f, 'd'))\n"
            "os.rename(os.path.join(f, 'p'), os.path.join(f, 'q'))\n"
            "os.listdir(f)\n"
            "shutil.copyfile(os.path.join(a, 'ok'), os.path.join(f, 'c'))\n"
            "os.remove(os.path.join(f, 'q'))\n"
            "shutil.rmtree(os.path.join(f, 'd'))\n")
    events = _audited(tmp_path, code, [forbidden])
    f = str(forbidden)
    for expected in (["open", f + "/in.txt"], ["open", f + "/p"], ["os.mkdir", f + "/d"], ["os.rename", f + "/p"],
                     ["os.rename", f + "/q"], ["os.listdir", f], ["shutil.copyfile", f + "/c"],
                     ["os.remove", f + "/q"], ["shutil.rmtree", f + "/d"]):
        assert expected in events, (expected, events)
    assert not [e for e in events if not e[1].startswith(f)]   # the allowed directory is not logged
    # a sibling whose name merely starts like the root is not under it
    assert _audited(tmp_path, f"open({str(tmp_path / 'driver2')!r}, 'w').write('x')", [forbidden],
                    log="sibling.log") == []


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_a_dead_owner_are_killed_and_a_live_owners_are_not(tmp_path):
    dead, alive = _dead_pid(), os.getpid()
    orphan = subprocess.Popen(["sleep", "120"], env=dict(os.environ, **{MARK: f"{dead}:old:worker1"}))
    owned = subprocess.Popen(["sleep", "120"], env=dict(os.environ, **{MARK: f"{alive}:new:worker1"}))
    try:
        end = time.monotonic() + 10
        while time.monotonic() < end and not {orphan.pid, owned.pid} <= set(marked_processes()):
            time.sleep(0.05)
        assert orphan.pid in kill_leftovers()
        assert orphan.wait(10) == -9 and owned.poll() is None
    finally:
        for p in (orphan, owned):
            p.kill()
            p.wait(10)
