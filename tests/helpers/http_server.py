"""A real HTTP(S) server on 127.0.0.1 for webhook tests, with a behaviour per path."""

import json
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Recorder(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, tls_files=None):
        super().__init__(("127.0.0.1", 0), Handler)
        self.requests: list[dict] = []  # {"path", "headers", "body", "time"}
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        if tls_files:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls_files)
            self.socket = context.wrap_socket(self.socket, server_side=True)
        self.scheme = "https" if tls_files else "http"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"{self.scheme}://127.0.0.1:{self.server_address[1]}{path}"

    def bodies(self, path: str) -> list:
        with self.lock:
            return [r["body"] for r in self.requests if r["path"] == path]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        server: Recorder = self.server
        self.path = self.path.split("?")[0]  # behaviour by path; the query may carry a token
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
        with server.lock:
            server.counts[self.path] = server.counts.get(self.path, 0) + 1
            n = server.counts[self.path]
            server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body, "time": time.monotonic()})
        if self.path == "/fail-once" and n == 1:
            return self._reply(500)
        if self.path == "/429-once" and n == 1:
            return self._reply(429, {"Retry-After": "1"})
        if self.path == "/stall":
            time.sleep(5)
        if self.path == "/redirect":
            return self._reply(302, {"Location": "/target"})
        self._reply(204)

    def _reply(self, code, headers=None):
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.end_headers()


def self_signed_cert(folder) -> tuple[str, str]:
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    return cert, key
