"""`bench.up`: a racer up that does not stop on SIGTERM leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_racer_up_that_ignores_sigterm_is_killed_with_the_process_groups_it_recorded(tmp_path):
    from bench.up import kill_left_behind

    # a stand-in for racer up: ignores SIGTERM, starts a child in its own session (as racer up
    # starts each process) and records it in DATA/processes.json as racer up does
    fake_up = ("import json, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "c = subprocess.Popen(['sleep', '300'], start_new_session=True); "
               "open(sys.argv[1] + '/processes.json', 'w').write(json.dumps({'supervisor_pid': 0, 'processes': "
               "{'node-0': {'pid': c.pid, 'url': None, 'restarts': 0, 'log': ''}, "
               "'dashboard': {'pid': None, 'url': None, 'restarts': 0, 'log': ''}}})); "
               "print('ready', flush=True); time.sleep(300)")
    p = subprocess.Popen([sys.executable, "-c", fake_up, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    child = json.loads((tmp_path / "processes.json").read_text())["processes"]["node-0"]["pid"]
    p.terminate()
    time.sleep(0.3)
    assert p.poll() is None and _alive(child)  # SIGTERM did nothing
    assert kill_left_behind(p, tmp_path) == [child]
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.poll() is not None and not _alive(child)
    p.stdout.close()
