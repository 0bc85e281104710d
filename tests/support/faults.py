"""Seeded native-failure injection for load runs: ``llamaspec serve`` whose decodes, drafters, state loads and
admissions fail now and then, while a flag file exists (``scripts/load_faults.py --inject``).

    PYTHONPATH=tests python -m support.faults --inject decode=0.002,mirror=0.002,drafter=0.005,admit=0.01 \\
        --flag /tmp/on --seed 0 -- serve -m MODEL ...

Each point raises the error llama.cpp's failure there becomes (``DecodeError``, a drafter's ``RuntimeError``,
``StateError``) with the message ``injected fault: POINT``; the engine must confine it to the request it hit
(an error event or a 500 that says so) and serve on. Only while ``--flag`` exists (the load run creates it
after computing its references and removes it before checking them again).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import threading
from typing import Callable

__all__ = ["POINTS", "install", "parse_spec", "main"]

MESSAGE = "injected fault"


def parse_spec(text: str) -> dict[str, float]:
    """``"decode=0.01,drafter=0.02"`` -> ``{"decode": 0.01, "drafter": 0.02}`` (points of :data:`POINTS`)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, p = part.partition("=")
        if name not in POINTS or not p:
            raise ValueError(f"--inject: {part!r} is not POINT=PROBABILITY with POINT one of {', '.join(POINTS)}")
        out[name] = float(p)
        if not 0 <= out[name] <= 1:
            raise ValueError(f"--inject: the probability of {name} must be in [0, 1], got {p}")
    return out


def _wrap(owner, attr: str, point: str, hit: Callable[[str], bool], exc: Callable[[str], Exception]) -> None:
    real = getattr(owner, attr)

    def faulty(*args, **kwargs):
        if hit(point):
            raise exc(f"{MESSAGE}: {point}")
        return real(*args, **kwargs)

    setattr(owner, attr, faulty)


def _points():
    from llamaspec.chain import Chain
    from llamaspec.errors import DecodeError, StateError
    from llamaspec._llama.context import Context
    from llamaspec.round import Round
    from llamaspec.scheduler import Scheduler

    return {"decode": (Round, "_decode", DecodeError), "mirror": (Chain, "process", DecodeError),
            "drafter": (Chain, "draft", RuntimeError), "state": (Context, "state_seq_set", StateError),
            "admit": (Scheduler, "_start", StateError)}


#: a target decode (prompt chunks and verification), the drafters' mirroring of it, drafting, a state load
#: (prompt cache and checkpoint restores), a request's start
POINTS = ("decode", "mirror", "drafter", "state", "admit")


def install(spec: dict[str, float], seed: int, flag: str | None) -> None:
    """Patch the points of ``spec`` to fail with their probability (one seeded RNG), while ``flag`` exists."""
    rng, lock = random.Random(seed), threading.Lock()

    def hit(point: str) -> bool:
        if flag is not None and not os.path.exists(flag):
            return False
        with lock:
            return rng.random() < spec[point]

    for point, (owner, attr, exc) in _points().items():
        if spec.get(point):
            _wrap(owner, attr, point, hit, exc)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inject", required=True, help="POINT=PROBABILITY,... (points: " + ", ".join(POINTS) + ")")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flag", default=None, help="inject only while this file exists")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- and the llamaspec command line (e.g. serve ...)")
    args = ap.parse_args(argv)
    install(parse_spec(args.inject), args.seed, args.flag)
    from llamaspec.cli.main import main as cli

    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    sys.argv = ["llamaspec", *rest]
    cli()


if __name__ == "__main__":
    main()
