"""A per-tenant notes service in Python behind shardkit-sidecar (the sidecar's test runs it).

POST /notes {"id","text"} adds a note (a known id answers 200), GET /notes lists them. State is
in memory per tenant; the hooks of the sidecar's contract hand a tenant over in a move through
one JSON file per tenant in the directory given as the second argument: fence writes it, warm
reads it, release forgets the tenant. It listens on a free port of 127.0.0.1 and prints it.
"""
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

lock = threading.Lock()
tenants = {}  # tenant -> list of notes
store = sys.argv[1]


def path_of(tenant):
    return os.path.join(store, tenant + ".json")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go in separate writes

    def log_message(self, *args):
        pass

    def reply(self, status, body):
        b = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}")

    def do_GET(self):
        u = urlparse(self.path)
        tenant = parse_qs(u.query).get("tenant", [None])[0]
        with lock:
            if u.path == "/notes":
                self.reply(200, tenants.get(self.headers["X-Tenant-Id"], []))
            elif u.path == "/tenantmesh/applied":
                self.reply(200, {"applied": len(tenants.get(tenant, []))})
            elif u.path == "/tenantmesh/fence":
                notes = tenants.get(tenant, [])
                tmp = path_of(tenant) + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(notes, f)
                os.replace(tmp, path_of(tenant))
                self.reply(200, {"fence": len(notes)})
            else:
                self.reply(404, {"title": "no such route"})

    def do_POST(self):
        body = self.body()
        with lock:
            if self.path == "/notes":
                notes = tenants.setdefault(self.headers["X-Tenant-Id"], [])
                if any(n["id"] == body["id"] for n in notes):
                    self.reply(200, body)
                else:
                    notes.append(body)
                    self.reply(201, body)
            elif self.path == "/tenantmesh/warm":
                tenant = body["tenant"]
                if os.path.exists(path_of(tenant)):
                    with open(path_of(tenant)) as f:
                        tenants[tenant] = json.load(f)
                self.reply(200, {"applied": len(tenants.get(tenant, []))})
            elif self.path == "/tenantmesh/release":
                tenants.pop(body["tenant"], None)
                self.reply(200, {})
            else:
                self.reply(404, {"title": "no such route"})


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
