"""An HTTP proxy to an S3 server that throttles as a busy bucket does: the first try of each request (by method,
path and query) is answered 503 SlowDown, every later try of it is passed on; `ThrottlingProxy(endpoint)` serves
on a port the OS assigns, in a thread, until closed. A client without retries fails at once; one with them gets
through on its second try, however the requests of its threads and processes interleave. With `refuse` (a part
of a path), every try of a PUT or POST to such a path is throttled: a failure that persists. Only requests of
`methods` are throttled; with `every` n, the n-th, 2n-th, ... of them rather than each first try. `delay` seconds
are waited before every answer, as a distant or busy server takes. `requests` lists each request as (the client's
port: its connection, method, path)."""

import collections
import http.client
import http.server
import threading
import time
import urllib.parse

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b'<Message>Please reduce your request rate.</Message></Error>'
)


class ThrottlingProxy:
    def __init__(
        self,
        upstream: str,
        refuse: str | None = None,
        every: int | None = None,
        delay: float = 0.0,
        methods: tuple[str, ...] = ('GET', 'HEAD', 'PUT', 'POST', 'DELETE'),
    ):
        upstream = urllib.parse.urlparse(upstream)
        tries, requests = collections.Counter(), iter(range(1, 1 << 62))
        lock = threading.Lock()
        self.throttled = 0
        self.requests = []

        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = 'HTTP/1.1'

            def log_message(self, *args):
                pass

            def forward(self):
                body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
                with lock:
                    tries[self.command, self.path] += 1
                    if self.command not in methods:
                        throttle = False
                    elif every is None:
                        throttle = tries[self.command, self.path] == 1
                    else:
                        throttle = next(requests) % every == 0
                    throttle = throttle or (
                        refuse is not None and refuse in self.path and self.command in ('PUT', 'POST')
                    )
                    proxy.throttled += throttle
                    proxy.requests.append((self.client_address[1], self.command, self.path))
                time.sleep(delay)
                if throttle:
                    self.send_response(503)
                    self.send_header('Content-Type', 'application/xml')
                    self.send_header('Content-Length', str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN if self.command != 'HEAD' else b'')
                    return
                connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=60)
                connection.request(self.command, self.path, body=body, headers=dict(self.headers))
                response = connection.getresponse()
                data = response.read()
                self.send_response(response.status)
                length = response.getheader('Content-Length') if self.command == 'HEAD' else str(len(data))
                for name, value in response.getheaders():
                    if name.lower() not in ('content-length', 'transfer-encoding', 'connection'):
                        self.send_header(name, value)
                self.send_header('Content-Length', length or '0')
                self.end_headers()
                if self.command != 'HEAD':
                    self.wfile.write(data)
                connection.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward  # noqa: N815 (http.server's names)

        self.server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.endpoint = f'http://127.0.0.1:{self.server.server_address[1]}'
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
