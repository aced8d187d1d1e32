"""A local stand-in for the Hugging Face Hub's file API, enough for clients to download models:
``GET /api/models/{repo}/revision/{rev}`` (the repository's commit and file list),
``GET /api/models/{repo}/tree/{rev}`` (its files, as newer clients list them) and
``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` (the file, with ``X-Repo-Commit``, ``ETag`` and byte
ranges). The tests check it with the official ``huggingface_hub`` client, so it speaks the real
protocol rather than one invented for rlmerge."""

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class Repo:
    def __init__(self, folder: Path, commit: str, branches=("main",), extra_files=None):
        self.commit = commit
        self.branches = set(branches)
        self.files = {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}
        self.files.update(extra_files or {})


class HubServer:
    """Serves ``repos`` ({"org/name": Repo}) on 127.0.0.1; records each request's path and its
    Authorization header."""

    def __init__(self, repos):
        self.repos = repos
        self.requests = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.answer(body=False)

            def do_GET(self):
                self.answer(body=True)

            def answer(self, body):
                path = unquote(urlparse(self.path).path)
                server.requests.append((self.command, path, self.headers.get("Authorization")))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and "tree" in parts:
                    at = parts.index("tree")
                    repo, rev = "/".join(parts[2:at]), parts[at + 1] if len(parts) > at + 1 else "main"
                    return self.tree(repo, rev, body)
                if parts[:2] == ["api", "models"] and "revision" in parts:
                    at = parts.index("revision")
                    repo, rev = "/".join(parts[2:at]), "/".join(parts[at + 1:])
                    return self.info(repo, rev, body)
                if "resolve" in parts:
                    at = parts.index("resolve")
                    repo = "/".join(parts[:at])
                    rev, name = parts[at + 1], "/".join(parts[at + 2:])
                    return self.file(repo, rev, name, body)
                self.fail(404, "not found")

            def lookup(self, repo, rev):
                r = server.repos.get(repo)
                if r is None or (rev not in r.branches and rev != r.commit):
                    return None
                return r

            def fail(self, code, message):
                data = json.dumps({"error": message}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("X-Error-Message", message)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def info(self, repo, rev, body):
                r = self.lookup(repo, rev)
                if r is None:
                    return self.fail(404, "Repository not found")
                data = json.dumps({
                    "_id": hashlib.sha1(repo.encode()).hexdigest()[:24],
                    "id": repo,
                    "modelId": repo,
                    "sha": r.commit,
                    "private": False,
                    "disabled": False,
                    "gated": False,
                    "lastModified": "2026-12-01T00:00:00.000Z",
                    "tags": [],
                    "siblings": [{"rfilename": f} for f in r.files],
                }).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def tree(self, repo, rev, body):
                r = self.lookup(repo, rev)
                if r is None:
                    return self.fail(404, "Repository not found")
                data = json.dumps([
                    {"type": "file", "oid": hashlib.sha1(d).hexdigest(), "size": len(d), "path": f}
                    for f, d in r.files.items()
                ]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def file(self, repo, rev, name, body):
                r = self.lookup(repo, rev)
                if r is None:
                    return self.fail(404, "Repository not found")
                if name not in r.files:
                    return self.fail(404, "Entry not found")
                data = r.files[name]
                etag = hashlib.sha256(data).hexdigest()
                start, end, status = 0, len(data) - 1, 200
                ranged = self.headers.get("Range")
                if ranged and ranged.startswith("bytes="):
                    first, _, last = ranged[len("bytes="):].partition("-")
                    start = int(first) if first else 0
                    end = min(int(last), len(data) - 1) if last else len(data) - 1
                    status = 206
                chunk = data[start:end + 1]
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(chunk)))
                self.send_header("ETag", f'"{etag}"')
                self.send_header("X-Repo-Commit", r.commit)
                self.send_header("Accept-Ranges", "bytes")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                self.end_headers()
                if body:
                    self.wfile.write(chunk)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
