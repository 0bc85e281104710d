"""bench --load (llamaspec.bench.load): the busy machine made on purpose, started and stopped around a run."""
from __future__ import annotations

import os
import time

import pytest

from llamaspec.bench.load import BackgroundLoad, LoadSpec
from llamaspec.errors import UsageError


def test_busy_loops_use_the_cores_and_stop():
    with BackgroundLoad(LoadSpec(busy=2)) as bg:
        pids = [p.pid for p in bg.procs]
        time.sleep(1.5)
    s = bg.summary()
    assert s["busy"] == 2 and s["died"] == [] and s["wall_s"] >= 1.4
    # they ran: a core each on an idle box, 0.25 seen beside a test run at nice -5 on 2 cores; 0 if never started
    assert s["cores_used"] > 0.1
    for pid in pids:                                  # and are gone
        with pytest.raises(OSError):
            os.kill(pid, 0)


def test_quiet_spec_starts_nothing():
    with BackgroundLoad(LoadSpec()) as bg:
        assert bg.procs == []
    assert bg.summary()["cores_used"] == 0.0


def test_bad_specs():
    with pytest.raises(UsageError, match="0 or more"):
        LoadSpec(busy=-1)
    with pytest.raises(UsageError, match="needs a model"):
        LoadSpec(decode=1)


def test_bench_records_the_load(tmp_path):
    from click.testing import CliRunner

    from llamaspec.cli.main import main as cli

    out = tmp_path / "r.json"
    res = CliRunner().invoke(cli, ["bench", "--quick", "--load", "1", "--engines", "llamaspec", "--modes", "plain",
                                   "--no-progress", "--no-costs", "-n", "8", "--json", str(out)])
    assert res.exit_code == 0, res.output
    import json

    rep = json.loads(out.read_text())
    ld = rep["load"]
    assert ld["busy"] == 1 and ld["description"] == "1 busy-loop process" and ld["died"] == []
    assert ld["cores_used"] >= 0 and ld["wall_s"] >= 0   # (a quick run of tiny models can be over in 50 ms)


def _gone(pid: int, within: float) -> bool:
    """``pid`` ended within ``within`` seconds (exited, or a zombie nobody reaps: PID 1 of a container may not)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_the_load_ends_with_the_process_that_started_it():
    """A busy loop outlives nothing: when the process that started the load is killed (SIGKILL: no ``__exit__``,
    no ``finally``), its busy-loop processes end by themselves instead of spinning on the cores for good."""
    import subprocess
    import sys

    code = ("import time\nfrom llamaspec.bench.load import BackgroundLoad, LoadSpec\n"
            "b = BackgroundLoad(LoadSpec(busy=2)).__enter__()\n"
            "print(' '.join(str(p.pid) for p in b.procs), flush=True)\ntime.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and not any(_gone(x, 0.3) for x in pids)  # running while their parent is
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    assert all(_gone(x, 10.0) for x in pids)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_sigterm_stops_the_bench_with_its_servers_and_load():
    """``llamaspec bench`` ended by SIGTERM (a CI timeout, ``kill``) stops the servers and load processes it
    started, as Ctrl-C does, and exits with 143."""
    import signal
    import subprocess
    import sys
    from importlib.util import find_spec

    if find_spec("starlette") is None or find_spec("uvicorn") is None:
        pytest.skip('bench --server needs the server extra: pip install "llamaspec[server]"')
    p = subprocess.Popen([sys.executable, "-m", "llamaspec.cli.main", "bench", "--quick", "--server", "--clients", "1",
                          "--load", "1", "-n", "8", "--native-dir", "nothing-built-here", "--no-progress"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        kids: list[int] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:
            kids = _children(p.pid)
            if len(kids) >= 2:  # the busy loop and a server
                break
            time.sleep(0.2)
        assert len(kids) >= 2, (p.poll(), p.stderr.read() if p.poll() is not None else "")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 143
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stderr.close()
    assert all(_gone(x, 5.0) for x in kids), kids
