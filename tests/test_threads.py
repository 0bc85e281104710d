"""The thread tuner (llamaspec._llama.threads): each decode's thread count chosen from measured times, per
batch size; on a real context, outputs do not depend on the count."""
from __future__ import annotations

import random

import pytest

from llamaspec._llama.threads import ThreadTuner


def drive(t: ThreadTuner, n: int, cost, rows: int = 1, rng=None) -> list[int]:
    rng = rng or random.Random(0)
    used = []
    for _ in range(n):
        k = t.before(rows)
        used.append(k)
        t.after(rows, cost(k) * (1 + 0.2 * rng.random()))
    return used


def test_keeps_two_threads_on_a_quiet_machine_and_probes_rarely():
    t = ThreadTuner([2, 1], lambda k: None)
    used = drive(t, 600, lambda k: 0.010 if k == 2 else 0.016)
    assert t.choice(1) == 2
    assert used[300:].count(1) / 300 < 0.03       # the interval doubled: probes cost little


def test_other_processes_cap_the_threads_without_probing_and_the_cap_lifts():
    """While other processes use a core (the OS's count), decodes run with one thread and nothing is probed, whatever
    the timings say; when they stop, the configured count is back at the next decode."""
    free = [1.0]
    t = ThreadTuner([2, 1], lambda k: None, free_cores=lambda: free[0])
    used = drive(t, 300, lambda k: 0.010 if k == 2 else 0.016)   # (timings that would favour two threads)
    assert used == [1] * 300 and t.n_probes == 0 and t.n_capped == 300
    free[0] = 1.9                                                # the load stopped
    used = drive(t, 32, lambda k: 0.010 if k == 2 else 0.016)
    assert used[0] == 2 and used.count(2) >= 29 and t.choice(1) == 2


def test_free_cores_counts_what_other_processes_use(tmp_path):
    """FreeCores: the busy time of all cores less this process's own CPU time, per interval."""
    from llamaspec._llama.threads import FreeCores

    stat = tmp_path / "stat"
    clock, own = [0.0], [0.0]

    def write(busy, idle):  # jiffies summed over 2 cpus
        stat.write_text(f"cpu {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 0\ncpu1 0\n")

    write(0, 0)
    f = FreeCores(str(stat), clock=lambda: clock[0], own_cpu=lambda: own[0])
    assert f.n_cpus == 2 and f.read() is None        # no interval yet
    clock[0], own[0] = 1.0, 1.0                      # 1 s: both cores busy, this process used one
    write(200, 0)
    assert f.read() == pytest.approx(1.0)
    clock[0], own[0] = 2.0, 2.0                      # next second: one core busy, all of it ours
    write(300, 100)
    assert f.read() == pytest.approx(2.0)
    assert FreeCores(str(tmp_path / "absent")).read() is None


@pytest.mark.parametrize("own_nice, free", [(0, 2.0), (-5, 2.0), (10, 1.0)])
def test_free_cores_leaves_out_processes_niced_below_ours(tmp_path, own_nice, free):
    """A niced process (a background build, a test run at nice 19) yields its core to a process of normal
    priority: its time (/proc/stat's nice column) does not cap the threads, unless this process is niced too."""
    from llamaspec._llama.threads import FreeCores

    stat = tmp_path / "stat"
    clock = [0.0]

    def write(user, nice, idle):  # jiffies summed over 2 cpus
        stat.write_text(f"cpu {user} {nice} 0 {idle} 0 0 0 0 0 0\ncpu0 0\ncpu1 0\n")

    write(0, 0, 0)
    f = FreeCores(str(stat), clock=lambda: clock[0], own_cpu=lambda: 0.0, own_nice=lambda: own_nice)
    clock[0] = 1.0                                   # 1 s: one core idle, the other running a niced process
    write(0, 100, 100)
    assert f.read() == pytest.approx(free)


def test_a_new_batch_size_starts_from_the_nearest_choice():
    t = ThreadTuner([2, 1], lambda k: None)
    drive(t, 60, lambda k: 0.030 if k == 2 else 0.012, rows=1)
    assert t.choice(1) == 1
    assert t.before(8) == 1                       # not two threads for its first decodes
    t.after(8, 0.02)


def test_apply_only_on_change():
    applied = []
    t = ThreadTuner([4, 2, 1], applied.append, probe_every=4, probe_len=2)
    drive(t, 40, lambda k: {4: 0.01, 2: 0.02, 1: 0.03}[k])
    assert all(a != b for a, b in zip(applied, applied[1:]))
    assert set(applied) == {4, 2, 1} and t.choice(1) == 4     # every alternative was tried


def test_needs_a_count():
    with pytest.raises(ValueError):
        ThreadTuner([0], lambda k: None)


@pytest.mark.parametrize("kind", ["llama", "mamba"])
def test_outputs_do_not_depend_on_the_thread_count(tiny_model, kind):
    """Greedy output with the tuner on (it tries 2 and 1 threads) equals output with 1 thread and 2 threads
    fixed: the count changes the speed, not what a decode computes."""
    from llamaspec.engine import Engine

    outs = {}
    for name, kw in (("t1", {"n_threads": 1}), ("t2", {"n_threads": 2}), ("tuned", {})):
        with Engine(tiny_model(kind), n_ctx=256, flash_attn=False, kv_f32=True, **kw) as e:
            if name == "tuned":
                assert e.ctx.threads is not None
                e.ctx.threads.probe_every = 2     # switch often
                e.ctx.threads.free_cores = None   # and also when other processes use the cores (no cap)
            outs[name] = e.generate([1, 2, 3, 4, 5, 6], n_predict=48).tokens
            if name == "tuned":
                assert e.ctx.threads.n_probes >= 3
    assert outs["t1"] == outs["t2"] == outs["tuned"]
