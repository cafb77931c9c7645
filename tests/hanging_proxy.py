"""A TCP proxy to an S3 server that hangs on SIGUSR1: from then on it accepts connections and holds them, and
passes no byte either way on old or new ones, as a server that hangs mid-run does. Run as
`python hanging_proxy.py UPSTREAM_PORT HUNG_AT_FILE`; it prints the port it listens on, then serves until killed,
and writes the time (time.time()) it was told to hang into HUNG_AT_FILE."""

import signal
import socket
import sys
import threading
import time

hung = threading.Event()


def pump(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(1 << 16):
            while hung.is_set():  # hold the bytes: the peer waits for them until its read timeout
                time.sleep(1)
            target.sendall(data)
    except OSError:
        pass


def serve(upstream_port: int) -> None:
    listener = socket.create_server(('127.0.0.1', 0))
    print(listener.getsockname()[1], flush=True)
    held = []
    while True:
        client = listener.accept()[0]
        if hung.is_set():
            held.append(client)  # never read from or written to
            continue
        upstream = socket.create_connection(('127.0.0.1', upstream_port))
        for source, target in ((client, upstream), (upstream, client)):
            threading.Thread(target=pump, args=(source, target), daemon=True).start()


if __name__ == '__main__':

    def hang(*_):
        hung.set()
        with open(sys.argv[2], 'w') as file:
            file.write(repr(time.time()))

    signal.signal(signal.SIGUSR1, hang)
    serve(int(sys.argv[1]))
