"""A local HTTP server that answers the way the Hugging Face Hub does for what ``huggingface_hub`` asks when it
lists a repository's files and downloads one (``HF_ENDPOINT`` points it here): ``GET
/api/models/OWNER/NAME/tree/REV`` (a JSON list of files) and ``HEAD`` / ``GET /OWNER/NAME/resolve/REV/PATH``
(the bytes, with the ``X-Repo-Commit`` and ``ETag`` headers the client keys its cache on). Unknown paths answer
404 with the Hub's ``X-Error-Code``."""
from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def serve(repos: "dict[str, dict[str, bytes]]") -> "tuple[ThreadingHTTPServer, str]":
    """Serve ``{"owner/name": {"path/in/repo": bytes}}`` on a free port: ``(server, base URL)``; call
    ``server.shutdown()`` and ``server.server_close()`` when done."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _file(self) -> "bytes | None":
            m = re.match(r"^/(?:models/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", urlparse(self.path).path)
            if not m:
                return None
            return repos.get(m.group(1), {}).get(m.group(3))

        def _missing(self) -> None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _head(self, data: bytes, kind: str = "application/octet-stream") -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Content-Type", kind)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", '"%s"' % hashlib.sha256(data).hexdigest())
            self.end_headers()

        def do_HEAD(self):  # noqa: N802
            data = self._file()
            self._missing() if data is None else self._head(data)

        def do_GET(self):  # noqa: N802
            m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)", urlparse(self.path).path)
            if m:
                repo = repos.get(m.group(1))
                if repo is None:
                    return self._missing()
                body = json.dumps([{"type": "file", "oid": hashlib.sha1(d).hexdigest(), "size": len(d), "path": p}
                                   for p, d in sorted(repo.items())]).encode()
                self._head(body, "application/json")
                self.wfile.write(body)
                return
            data = self._file()
            if data is None:
                return self._missing()
            self._head(data)
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"
