#!/usr/bin/env python3
"""A stand-in for Horovod's HTTP rendezvous server, for ferrogloo's compatibility tests.

It follows the behaviour of horovod/runner/http/http_server.py (RendezvousHandler on a
threading HTTPServer): HTTP/1.0 (one request per connection), the raw path split on '/'
into exactly ['', scope, key] with no URL decoding, PUT with Content-Length -> 200, GET -> 200
with the bytes or 404, DELETE -> 200 whether or not the key existed, and no POST (501, from
BaseHTTPRequestHandler). Prints the port on stdout, serves until stdin closes.
"""
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STORE = {}
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def reply(self, code, body=b""):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def parts(self):
        parts = self.path.split("/")
        if len(parts) != 3:
            # Horovod unpacks into three names and fails on any other count.
            self.reply(400)
            return None
        return parts[1], parts[2]

    def do_GET(self):
        p = self.parts()
        if p is None:
            return
        with LOCK:
            value = STORE.get(p)
        if value is None:
            self.reply(404)
        else:
            self.reply(200, value)

    def do_PUT(self):
        p = self.parts()
        if p is None:
            return
        value = self.rfile.read(int(self.headers["Content-Length"]))
        with LOCK:
            STORE[p] = value
        self.reply(200)

    def do_DELETE(self):
        p = self.parts()
        if p is None:
            return
        with LOCK:
            STORE.pop(p, None)
        self.reply(200)


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
print(server.server_address[1], flush=True)
sys.stdin.read()
server.shutdown()
