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
