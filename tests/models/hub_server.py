"""A small stand-in for the Hugging Face Hub on 127.0.0.1, for the tests: it answers the requests ``huggingface_hub``
makes to download a snapshot (model info by revision, the file tree, file HEAD/GET with commit and ETag headers,
and the same for datasets, served under ``datasets/ORG/NAME``: what ``datasets.load_dataset`` asks;
HTTP ranges for resumed downloads), with the Hub's error codes for a missing repository or revision and a gated
repository, counts every request, and can cut a file's body short (a number of times) to imitate interrupted downloads."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    files: dict[str, bytes]  # path in repo -> bytes
    refs: dict[str, str]  # branch or tag -> commit sha
    gated: bool = False  # answers 401 GatedRepo without an Authorization header

    @classmethod
    def from_dir(cls, d: Path, refs: dict[str, str], **kw) -> Repo:
        return cls({p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}, refs, **kw)


@dataclass
class HubServer:
    repos: dict[str, Repo]
    requests: list[tuple[str, str]] = field(default_factory=list)
    cuts: dict[str, int] = field(default_factory=dict)  # file path -> how many more GETs send half the body and close
    ranged: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Range header) of files
    url: str = ""
    _cut_before: set = field(default_factory=set)

    def start(self) -> HubServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                server._answer(self, head=True)

            def do_GET(self):
                server._answer(self, head=False)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # -- answers ------------------------------------------------------------------------------------------

    def _commit(self, repo: Repo, rev: str) -> str | None:
        return rev if rev in repo.refs.values() else repo.refs.get(rev)

    def _error(self, h, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _json(self, h, obj, head: bool) -> None:
        body = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _answer(self, h, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append(("HEAD" if head else "GET", path))
        kind = "datasets/" if path.startswith(("/api/datasets/", "/datasets/")) else ""  # a dataset's paths
        if kind:
            path = path.replace("/api/datasets/", "/api/models/", 1).replace("/datasets/", "/", 1)
        m = (re.match(r"^/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(?:/(.+))?$", path)
             or re.match(r"^/([^/]+/[^/]+)/(resolve)/([^/]+)/(.+)$", path))
        if not m or kind + m[1] not in self.repos:
            return self._error(h, 404, "RepoNotFound", "Repository not found")
        repo = self.repos[kind + m[1]]
        if repo.gated and "authorization" not in {k.lower() for k in h.headers}:
            return self._error(h, 401, "GatedRepo", "Access to this model is restricted: log in")
        commit = self._commit(repo, m[3])
        if commit is None:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {m[3]}")
        if m[2] == "revision":
            return self._json(h, {"id": m[1], "modelId": m[1], "sha": commit, "private": False,
                                  "siblings": [{"rfilename": f} for f in repo.files]}, head)
        if m[2] == "tree":
            return self._json(h, self._tree(repo, m[4] or "", "recursive=true" in h.path.lower()), head)
        self._file(h, repo, commit, m[4], head)

    def _tree(self, repo: Repo, under: str, recursive: bool) -> list[dict]:
        """The Hub's tree listing of the folder ``under``: its files and folders (``recursive``: everything below)."""
        prefix = under.strip("/") + "/" if under.strip("/") else ""
        files, folders = [], set()
        for f, b in repo.files.items():
            if not f.startswith(prefix):
                continue
            parts = f[len(prefix):].split("/")
            folders.update(prefix + "/".join(parts[:i]) for i in range(1, len(parts) if recursive else min(2, len(parts))))
            if recursive or len(parts) == 1:
                files.append({"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()})
        return files + [{"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()}
                        for d in sorted(folders)]

    def _file(self, h, repo: Repo, commit: str, name: str, head: bool) -> None:
        if name not in repo.files:
            return self._error(h, 404, "EntryNotFound", f"{name} not found")
        body = repo.files[name]
        start = 0
        rng = h.headers.get("Range")
        self.ranged.append(("HEAD" if head else "GET", h.path, rng))
        if rng and not head:
            start = int(re.match(r"bytes=(\d+)-", rng)[1])
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", commit)
        h.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
        h.send_header("Content-Length", str(len(body) - start))
        h.send_header("Content-Type", "application/octet-stream")
        h.end_headers()
        if head:
            return
        if self.cuts.get(name, 0) > 0:
            self.cuts[name] -= 1
            first = name not in self._cut_before
            self._cut_before.add(name)
            h.wfile.write(body[start : start + (len(body) - start) // 2] if first else b"")  # then nothing at all
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # the connection drops mid-file
            return
        h.wfile.write(body[start:])
