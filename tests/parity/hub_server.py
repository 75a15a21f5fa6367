"""A stand-in Hugging Face Hub on 127.0.0.1 for the Hub tests (test_hub.py): it answers as the Hub does (HUB_NOTES:
HEAD/GET resolve/<rev>/<file> with X-Repo-Commit, ETag, X-Linked-Etag, X-Linked-Size; LFS files as a 302 to a CDN
URL on another host name; the tree API paginated by Link; the revision API; X-Error-Code errors), counts every
request, and injects faults on demand: a connection cut halfway, wrong bytes, a 500 before success, a slow body.

    hub = HubServer(); hub.add_repo("org/tiny", {"config.json": b"...", "model.safetensors": b"..."})
    hub.start(); ... hub.endpoint ...; hub.stop()

The CDN is this same server reached as `localhost` instead of `127.0.0.1`: another host to a client, so a client
that sent its token there would be seen (hub.cdn_requests_with_auth()).
"""
import hashlib
import json
import os
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LFS_SUFFIXES = (".safetensors", ".bin", ".model", ".parquet")


def client_env(endpoint, tmp_path):
    """The environment of a trainer (or Python) process talking to a stand-in Hub at `endpoint`: an empty cache
    under `tmp_path`, no token, no proxy, none of the caller's HF_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update({"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(tmp_path / "cache"),
                "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TRAINER_HUB_RETRY_BASE_S": "0.05",
                "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"})
    for proxy in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"):
        env.pop(proxy, None)
    return env


def git_blob_sha1(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Repo:
    def __init__(self, files, commit, branch="main", gated_token=None):
        self.commits = {commit: dict(files)}
        self.refs = {branch: commit}
        self.gated_token = gated_token  # a repo that needs this token (None: public)

    def commit_of(self, revision):
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


class Faults:
    """Faults by file path ("*" for every file); each count is how many requests it still applies to."""

    def __init__(self):
        self.cut = {}          # path -> times the body is cut after half its bytes
        self.corrupt = set()   # paths whose bytes are served with one byte changed (always)
        self.error500 = {}     # path -> times a GET answers 500 first
        self.slow = {}         # path -> seconds to sleep between 1 KiB chunks
        self.stall = {}        # path -> times the body stops after half its bytes and hangs (then the client times out)
        self.listing500 = 0    # times the tree listing answers 500
        self.missing = set()   # paths the listing shows but resolve answers 404 EntryNotFound for (a racing delete)

    def take(self, table, path):
        for key in (path, "*"):
            if table.get(key, 0) > 0:
                table[key] -= 1
                return True
        return False


class HubServer:
    def __init__(self, page_size=3):
        self.repos = {}
        self.faults = Faults()
        self.page_size = page_size
        self.requests = []  # (method, path, host, authorization header or None)
        self.ranges = []    # (path, Range header) of every request that sent one
        self.lock = threading.Lock()
        self.server = None
        self.thread = None

    # ---- content -------------------------------------------------------------------------------------------------
    def add_repo(self, repo_id, files, commit=None, gated_token=None, repo_type="model"):
        """A model repo, or with repo_type="dataset" a dataset repo (served under /datasets/ and /api/datasets/)."""
        key = repo_id if repo_type == "model" else "datasets/" + repo_id
        commit = commit or hashlib.sha1(key.encode() + "".join(sorted(files)).encode()).hexdigest()
        self.repos[key] = Repo(files, commit, gated_token=gated_token)
        return commit

    def add_commit(self, repo_id, files, branch="main", repo_type="model"):
        """A new commit that `branch` moves to (a moved branch; for a dataset, e.g. refs/convert/parquet)."""
        key = repo_id if repo_type == "model" else "datasets/" + repo_id
        repo = self.repos[key]
        commit = hashlib.sha1(repo_id.encode() + str(len(repo.commits)).encode()).hexdigest()
        repo.commits[commit] = dict(files)
        repo.refs[branch] = commit
        return commit

    # ---- life ----------------------------------------------------------------------------------------------------
    def start(self):
        handler = _make_handler(self)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return self

    def stop(self):
        if self.server:
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(timeout=5)
            self.server = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.port}"

    # ---- what happened -------------------------------------------------------------------------------------------
    def record(self, method, path, host, authorization):
        with self.lock:
            self.requests.append((method, path, host, authorization))

    def count(self, method=None, contains=""):
        with self.lock:
            return sum(1 for m, p, _, _ in self.requests if (method is None or m == method) and contains in p)

    def cdn_requests_with_auth(self):
        with self.lock:
            return [p for m, p, h, a in self.requests if p.startswith("/cdn/") and a]

    def reset_counts(self):
        with self.lock:
            self.requests.clear()
            self.ranges.clear()


def _make_handler(hub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        # ---- helpers ---------------------------------------------------------------------------------------------
        def _send(self, status, body=b"", headers=None, head=False):
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if "Content-Length" not in (headers or {}):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head and body:
                self.wfile.write(body)

        def _error(self, status, code, message, head=False):
            body = json.dumps({"error": message}).encode()
            self._send(status, body, {"X-Error-Code": code, "X-Error-Message": message,
                                      "Content-Type": "application/json"}, head)

        def _authorized(self, repo):
            if repo.gated_token is None:
                return True
            return self.headers.get("Authorization") == f"Bearer {repo.gated_token}"

        def _host(self):
            return self.headers.get("Host", "")

        def _record(self):
            hub.record(self.command, self.path, self._host(), self.headers.get("Authorization"))
            if self.headers.get("Range"):
                with hub.lock:
                    hub.ranges.append((self.path, self.headers.get("Range")))

        # ---- routes ----------------------------------------------------------------------------------------------
        def do_HEAD(self):
            self._record()
            self._route(head=True)

        def do_GET(self):
            self._record()
            self._route(head=False)

        def _route(self, head):
            url = urllib.parse.urlsplit(self.path)
            path = urllib.parse.unquote(url.path)
            query = urllib.parse.parse_qs(url.query)
            if url.path.startswith("/cdn/"):
                return self._cdn(url.path[len("/cdn/"):], head)
            if path.startswith("/api/models/"):
                return self._api(url.path[len("/api/models/"):], query, head)
            if path.startswith("/api/datasets/"):
                return self._api(url.path[len("/api/datasets/"):], query, head, kind="datasets")
            parts = url.path.lstrip("/").split("/")
            if len(parts) >= 6 and parts[0] == "datasets" and parts[3] == "resolve":
                repo_id = "datasets/" + urllib.parse.unquote(parts[1]) + "/" + urllib.parse.unquote(parts[2])
                return self._resolve(repo_id, urllib.parse.unquote(parts[4]), urllib.parse.unquote("/".join(parts[5:])),
                                     head)
            if len(parts) >= 5 and parts[2] == "resolve":
                repo_id = urllib.parse.unquote(parts[0]) + "/" + urllib.parse.unquote(parts[1])
                revision = urllib.parse.unquote(parts[3])
                file = urllib.parse.unquote("/".join(parts[4:]))
                return self._resolve(repo_id, revision, file, head)
            if len(parts) >= 4 and parts[1] == "resolve":
                return self._resolve(urllib.parse.unquote(parts[0]), urllib.parse.unquote(parts[2]),
                                     urllib.parse.unquote("/".join(parts[3:])), head)
            self._error(404, "EntryNotFound", f"no route {url.path}", head)

        def _repo_and_commit(self, repo_id, revision, head):
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository {repo_id} not found", head)
                return None, None
            if not self._authorized(repo):
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to it "
                                              "and be authenticated to access it. Please log in.", head)
                return None, None
            commit = repo.commit_of(revision)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
                return None, None
            return repo, commit

        def _api(self, rest, query, head, kind="models"):
            # {org}/{name}/tree/{rev}[/path] or {org}/{name}/revision/{rev}
            parts = rest.split("/")
            if len(parts) < 4:
                return self._error(404, "RepoNotFound", "bad api path", head)
            repo_id = urllib.parse.unquote(parts[0]) + "/" + urllib.parse.unquote(parts[1])
            public_id = repo_id
            if kind == "datasets":
                repo_id = "datasets/" + repo_id
            call, revision = parts[2], urllib.parse.unquote(parts[3])
            repo, commit = self._repo_and_commit(repo_id, revision, head)
            if repo is None:
                return
            files = repo.commits[commit]
            if call == "revision":
                body = json.dumps({"id": public_id, "modelId": public_id, "sha": commit, "private": False,
                                   "siblings": [{"rfilename": name} for name in sorted(files)]}).encode()
                return self._send(200, body, {"Content-Type": "application/json"}, head)
            if call != "tree":
                return self._error(404, "EntryNotFound", "bad api path", head)
            with hub.lock:
                if hub.faults.listing500 > 0:
                    hub.faults.listing500 -= 1
                    return self._error(500, "", "internal error", head)
            entries = []
            for name in sorted(files):
                data = files[name]
                entry = {"type": "file", "path": name, "size": len(data), "oid": git_blob_sha1(data)}
                if name.endswith(LFS_SUFFIXES):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                entries.append(entry)
            cursor = int(query.get("cursor", ["0"])[0])
            page = entries[cursor:cursor + hub.page_size]
            headers = {"Content-Type": "application/json"}
            if cursor + hub.page_size < len(entries):
                next_query = urllib.parse.urlencode({"recursive": "true", "cursor": cursor + hub.page_size})
                headers["Link"] = f'<{hub.endpoint}/api/{kind}/{public_id}/tree/{parts[3]}?{next_query}>; rel="next"'
            self._send(200, json.dumps(page).encode(), headers, head)

        def _resolve(self, repo_id, revision, file, head):
            repo, commit = self._repo_and_commit(repo_id, revision, head)
            if repo is None:
                return
            files = repo.commits[commit]
            if file not in files or file in hub.faults.missing:
                return self._error(404, "EntryNotFound", f"{file} does not exist at {revision}", head)
            data = files[file]
            common = {"X-Repo-Commit": commit}
            if file.endswith(LFS_SUFFIXES):
                sha = hashlib.sha256(data).hexdigest()
                location = f"http://localhost:{hub.port}/cdn/{sha}?file={urllib.parse.quote(file)}&sig=cdn-signature"
                return self._send(302, b"", {**common, "Location": location, "X-Linked-Etag": f'"{sha}"',
                                             "X-Linked-Size": str(len(data)), "ETag": f'"{git_blob_sha1(data)}"'},
                                  head)
            if not head:
                with hub.lock:
                    if hub.faults.take(hub.faults.error500, file):
                        return self._error(500, "", "internal error", head)
            self._send(200, data, {**common, "ETag": f'"{git_blob_sha1(data)}"', "Content-Type": "text/plain"}, head)

        def _cdn(self, rest, head):
            url = urllib.parse.urlsplit(self.path)
            sha = rest.split("?")[0]
            file = urllib.parse.parse_qs(url.query).get("file", [""])[0]
            data = None
            for repo in hub.repos.values():
                for files in repo.commits.values():
                    for content in files.values():
                        if hashlib.sha256(content).hexdigest() == sha:
                            data = content
            if data is None:
                return self._send(404, b"not found", {}, head)
            with hub.lock:
                fail = not head and hub.faults.take(hub.faults.error500, file)
                cut = not head and hub.faults.take(hub.faults.cut, file)
                stall = not head and hub.faults.take(hub.faults.stall, file)
                corrupt = file in hub.faults.corrupt or "*" in hub.faults.corrupt
                slow = hub.faults.slow.get(file, hub.faults.slow.get("*", 0))
            if fail:
                return self._send(500, b"internal error", {}, head)
            if corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:] if data else data
            start = 0
            status = 200
            headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                start = int(rng[len("bytes="):].split("-")[0])
                if start >= len(data):
                    return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"}, head)
                status = 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            body = data[start:]
            headers["Content-Length"] = str(len(body))
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            if head:
                return
            try:
                if cut or stall:
                    self.wfile.write(body[:len(body) // 2])
                    self.wfile.flush()
                    if stall:
                        time.sleep(6)
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if slow:
                    for i in range(0, len(body), 1024):
                        self.wfile.write(body[i:i + 1024])
                        self.wfile.flush()
                        time.sleep(slow)
                    return
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass

    return Handler
